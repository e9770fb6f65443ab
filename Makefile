# The single developer entry point. `make test` and `make demo` work on a
# fresh machine that has only Rust, Python 3.11 and pip.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
UV := $(PYTHON) -m uv
CARGO_TEST_FLAGS ?=
# Hard links from uv's cache into the venv (torch's wheels are ~5 GB: a copy
# would hold them twice on disk); uv falls back to copying across filesystems.
export UV_LINK_MODE ?= hardlink

.PHONY: test demo bench develop deps ssh-keygen rust-checks python-checks realmodels clean

# Everything CI checks: formatting, lints, Rust tests, Python lints, types
# (mypy, and stubtest of the hand-written _native.pyi) and tests.
test: develop rust-checks python-checks

# Mint a real model, then resolve, load and run it from a fresh process.
# Built in release mode so that the printed times are representative.
demo: deps
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --uv --release --quiet
	$(VPY) scripts/demo.py

bench: deps
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --uv --release --quiet
	$(VPY) scripts/bench.py

$(VENV)/.uv-ready:
	@$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "uv>=0.4"
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(VENV)
	@touch $@

# Dependencies come from pyproject.toml (the torch and test extras); uv's cache
# makes a repeated install cost seconds.
$(VENV)/.deps-ready: pyproject.toml $(VENV)/.uv-ready
	$(UV) pip install --quiet --python $(VPY) -r pyproject.toml --extra torch --extra test "maturin>=1.7,<2"
	@touch $@

deps: $(VENV)/.deps-ready

# Build the extension module into the virtual environment (editable install).
develop: deps
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --uv --quiet

# The trust tests run the real OpenSSH ssh-keygen (interop both ways). A
# machine without it gets openssh-client from apt (as root, or through
# passwordless sudo); anything else fails here with the reason.
ssh-keygen:
	@command -v ssh-keygen >/dev/null 2>&1 || { \
	  echo "ssh-keygen is missing: installing openssh-client for the trust tests" >&2; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq openssh-client; \
	  else sudo -n apt-get update -qq && sudo -n apt-get install -y -qq openssh-client; fi; }
	@command -v ssh-keygen >/dev/null 2>&1 || { echo "error: ssh-keygen is required (install openssh-client)" >&2; exit 2; }

rust-checks: deps ssh-keygen  # tcg-run's tests load libtorch from the venv
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	cargo test --workspace --exclude tcg-py $(CARGO_TEST_FLAGS)

python-checks: ssh-keygen
	$(VENV)/bin/ruff check python tests scripts
	$(VENV)/bin/ruff format --check python tests scripts
	$(VENV)/bin/mypy
	$(VPY) -m mypy.stubtest torch_compiled_graphs._native
	$(VPY) -m pytest -m "not realmodels"

# The whole real-model tier (diffusers, transformers, timm from small configs):
# each model through export, mint, fresh-process load / load_native from the
# checkpoints a user has, and reuse. `make test` runs two of them.
realmodels: develop
	$(VPY) -m pytest -v tests/test_realmodels.py
	$(VPY) -m pytest -v -m realmodels --ignore=tests/test_realmodels.py

clean:
	cargo clean
	rm -rf $(VENV)
