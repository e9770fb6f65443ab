"""Type stubs of the native extension ``torch_compiled_graphs._native``."""

from typing import Any

COMPILED_GRAPH_FORMAT: int
ARTIFACT_KIND: str
KEY_SCHEME: str
KEY_AXES: list[str]
KEY_DIGEST_HEX: int
MAX_KEY_LENGTH: int
TOOLCHAIN_EXCLUDED: list[str]
GRAPH_FACTS_VERSION: int
CALL_INGRESS_VERSION: int

def is_compiled_graph_key(value: object) -> bool: ...
def derive_key(axes: object) -> str: ...
def key_from_metadata(metadata: object) -> str: ...
def toolchain_axis(block: object) -> str: ...
def literal_digest(rows: list[tuple[str, str, list[int], bytes]]) -> str: ...
def ingress_digest(ingress: object) -> str: ...
def graph_witness(lines: list[str]) -> str: ...
def canonical_json(value: object) -> bytes: ...
def declare(
    graph_class: object,
    target: object,
    graph: object,
    graph_witness: object,
    range_digest: object,
    fork: object,
    class_dims: object,
    strict: object,
    lora_bucket: object,
    literal_values: object,
    placement: object,
) -> dict[str, Any]: ...
def cli_main(argv: list[str]) -> int: ...
def error_codes() -> list[tuple[str, str]]: ...
