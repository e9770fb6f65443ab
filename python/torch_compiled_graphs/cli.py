"""Console script ``torch-compiled-graphs``: the native command line.

``toolchain``, ``build`` and ``build-cell`` need torch or user recipes and run in Python
(:mod:`torch_compiled_graphs.build.cli`); everything else is forwarded to the native CLI.
"""

from __future__ import annotations

import sys

_PYTHON_COMMANDS = ("build", "build-cell", "toolchain")


def main() -> None:
    """Run the CLI with this process's arguments and exit with its code."""
    args = sys.argv[1:]
    if args and args[0] in _PYTHON_COMMANDS:
        from .build.cli import main as python_main

        sys.exit(python_main(args))
    from . import _native

    sys.exit(_native.cli_main(["torch-compiled-graphs", *args]))


if __name__ == "__main__":
    main()
