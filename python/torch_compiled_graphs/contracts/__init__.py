"""The identity contract corpora, shipped byte-identical with the package.

These files pin every key and digest this package derives; the test suites of
the Rust core and of this package reproduce every vector in them.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["CONTRACT_NAMES", "load_contract", "read_contract"]

CONTRACT_NAMES: tuple[str, ...] = (
    "KEY_GRAMMAR_DIGEST",
    "call_ingress_v1.json",
    "compiled_graph_key_vectors.json",
    "graph_class_identity_v3.json",
    "graph_class_identity_v3_with_ingress.json",
    "literal_identity_v1.json",
    "toolchain_identity_v1.json",
)


def read_contract(name: str) -> bytes:
    """The exact bytes of the shipped contract file ``name``.

    Unknown names are refused with ``ValueError``; the names are
    :data:`CONTRACT_NAMES`.
    """
    if name not in CONTRACT_NAMES:
        raise ValueError(f"unknown contract {name!r}; known contracts: {', '.join(CONTRACT_NAMES)}")
    return resources.files(__name__).joinpath(name).read_bytes()


def load_contract(name: str) -> Any:
    """The parsed JSON of a ``.json`` contract file."""
    if not name.endswith(".json"):
        raise ValueError(f"contract {name!r} is not a JSON file")
    return json.loads(read_contract(name))
