from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT / "testdata"


@pytest.fixture(scope="session")
def spec_vectors() -> dict[str, Any]:
    return json.loads((TESTDATA / "spec_vectors.json").read_text())
