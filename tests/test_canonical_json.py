"""Canonical JSON equals Python's json.dumps byte for byte (property tests)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_compiled_graphs import IdentityError
from torch_compiled_graphs.identity import canonical_json

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(st.characters(exclude_categories=("Cs",)))
JSON = st.recursive(
    st.none() | st.booleans() | I64 | FLOATS | TEXT,
    lambda children: (
        st.lists(children, max_size=6) | st.tuples(children, children) | st.dictionaries(TEXT, children, max_size=6)
    ),
    max_leaves=40,
)


def reference(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


@settings(max_examples=600, deadline=None)
@given(JSON)
def test_canonical_json_equals_python_json_dumps(value: Any) -> None:
    assert canonical_json(value) == reference(value)


@settings(max_examples=2000, deadline=None)
@given(FLOATS)
def test_canonical_json_float_repr_equals_python(value: float) -> None:
    assert canonical_json(value) == reference(value)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1))
def test_canonical_json_unicode_strings_equal_python(value: str) -> None:
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        with pytest.raises(IdentityError) as e:
            canonical_json(value)
        assert e.value.code == "cj.invalid_value"
    else:
        assert canonical_json(value) == reference(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1, {"x": math.nan}]])
def test_non_finite_floats_are_refused(value: Any) -> None:
    with pytest.raises(IdentityError) as e:
        canonical_json(value)
    assert e.value.code == "cj.non_finite"


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, {"deep": [2**64]}])
def test_out_of_range_integers_are_refused_with_path_and_bound(value: Any) -> None:
    with pytest.raises(IdentityError) as e:
        canonical_json(value)
    assert e.value.code == "cj.integer_range"
    assert "9223372036854775807" in str(e.value)
    assert "$" in str(e.value)


@pytest.mark.parametrize("value", [{1: "a"}, {("a",): 1}, {1.5}, b"bytes", object(), "\ud800", {"\udc00": 1}])
def test_values_outside_the_model_are_refused(value: Any) -> None:
    with pytest.raises(IdentityError) as e:
        canonical_json(value)
    assert e.value.code == "cj.invalid_value"


def test_integer_extremes_encode_as_themselves() -> None:
    assert canonical_json(2**63 - 1) == b"9223372036854775807"
    assert canonical_json(-(2**63)) == b"-9223372036854775808"
    assert canonical_json(True) == b"true"
    assert canonical_json(1.0) == b"1.0"


@settings(max_examples=500, deadline=None)
@given(st.integers())
def test_large_integers_encode_like_python_or_are_refused(value: int) -> None:
    if -(2**63) <= value < 2**63:
        assert canonical_json(value) == reference(value)
    else:
        with pytest.raises(IdentityError) as e:
            canonical_json([value])
        assert e.value.code == "cj.integer_range"
        assert "$[0]" in str(e.value)


@settings(max_examples=1500, deadline=None)
@given(st.integers(1, 99), st.integers(-320, 308))
def test_short_decimal_floats_equal_python(mantissa: int, exponent: int) -> None:
    value = float(f"{mantissa}e{exponent}")
    if math.isfinite(value):
        assert canonical_json(value) == reference(value)
