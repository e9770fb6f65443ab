"""``python -m torch_compiled_graphs``: the command line (the same as the ``torch-compiled-graphs`` script)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
