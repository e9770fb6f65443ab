"""`make demo`: derive the key of the identity contract example through the package.

It reads the shipped toolchain contract (graph class c59210f4ddf6b420 for sm_89)
and prints the key that both this project and the original implementation derive.
"""

from __future__ import annotations

from torch_compiled_graphs import CompiledGraphKey
from torch_compiled_graphs.contracts import load_contract
from torch_compiled_graphs.identity import toolchain_axis_digest


def main() -> None:
    contract = load_contract("toolchain_identity_v1.json")
    axis = toolchain_axis_digest(contract["block"])
    key = CompiledGraphKey(contract["graph"], contract["sm"], axis)
    print(f"graph axis      {key.graph}")
    print(f"sm axis         {key.sm}")
    print(f"toolchain axis  {key.toolchain}")
    print(f"key             {key}")
    if key != contract["key"]:
        raise SystemExit(f"demo key {key} differs from the contract's {contract['key']}")


if __name__ == "__main__":
    main()
