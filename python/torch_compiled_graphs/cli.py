"""Console script ``torch-compiled-graphs``: the native command line."""

from __future__ import annotations

import sys

from . import _native


def main() -> None:
    """Run the native CLI with this process's arguments and exit with its code."""
    sys.exit(_native.cli_main(["torch-compiled-graphs", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
