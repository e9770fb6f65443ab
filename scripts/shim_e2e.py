"""The shim stage of ``scripts/cuda_e2e.py`` (``--shim``; issue 34, items 4 and 5).

Every step is independent (one that fails records its error and the next runs) and
``OUT/shim.json`` is written after each; ``--shim-only`` runs a subset, in this order:

``shim-test``
    the tcg-shim GPU test binary (``--shim-test-bin``; ``cargo test -p tcg-shim --test
    cuda_device --no-run --release``) with ``--ignored --test-threads=1``: each test's
    outcome.
``mint``
    each model (the graphs bench's bf16 block stack; the smallest transformers and
    diffusers models of the real-model tier; on the CPU also an elementwise model) minted
    as ``shim-v1`` and as the default variant, every mint in its own child, at once. A
    refusal is a result: its code and the ops it names. The cold-start models are minted
    beside them (``coldstart``).
``run``
    each admitted ``shim-v1`` graph in a fresh child that never imports torch, on the shim
    runtime (``TORCH_COMPILED_GRAPHS_RUNTIME=shim``): fixed inputs in, outputs back on the
    host, its ``runtime``, ``runtime_reason``, ``timings`` and the libtorch libraries in its
    memory map; outputs compared here with eager under the mint's parity tolerances.
``serve``
    the Rust ``serve`` example (``--serve-bin``) with ``--runtime shim`` on the block stack:
    its JSON line, its output checked the same way, the libraries its process loaded
    (``LD_DEBUG=files``).
``install-bytes``
    ``scripts/install_bytes.py --json`` for the wheel, with this machine's torch.
``hitpath``
    the torch-free hit path in fresh processes (``import``, ``Engine()``, ``resolve`` of
    the reference artifact) against ``python -c pass``.
``steady``
    the block stack at batch 1 and 8: the ``shim-v1`` graph on the shim against the
    default graph on libtorch, ``load_native`` with CUDA graphs on and off, wall time of a
    call and a wait for the device, medians of 200 after 20 warm-up calls, in ``--repeat``
    rounds of the two processes in turn, the median of the rounds (goal: <= 1.2x).
``coldstart``
    ``scripts/coldstart.py --variant shim-v1 --runtime shim`` (``--shim-sizes``): the
    libtorch-free path against the libtorch path and the floor, in fresh processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
CHILD = SCRIPTS / "shim_child.py"

STEPS = ("shim-test", "mint", "run", "serve", "install-bytes", "hitpath", "steady", "coldstart")
#: The steps that time something: they start once the cold-start models are minted
#: (no compile beside them).
TIMED = ("hitpath", "steady", "coldstart")
VARIANTS = ("shim-v1", "default")
#: The models minted on a GPU: the graphs bench's block stack and the smallest
#: transformers and diffusers models of the real-model tier (tests/realmodels.py).
GPU_MODELS = ("blocks", "llama-tied", "vae-decoder")
#: On the CPU the elementwise model too: the CPU variant refuses GEMMs, so it is the one
#: graph the rehearsal's run, serve and steady steps have.
CPU_MODELS = (*GPU_MODELS, "elementwise")
#: The model of the serve and steady steps: the first of these admitted as shim-v1.
BENCH_MODELS = ("blocks", "elementwise")
#: The ways of the cold start in this stage (scripts/coldstart.py).
COLDSTART_WAYS = "floor_read,floor_context,native,native_variant,libraries,rust_variant"


@dataclass
class Options:
    device: str
    out: Path
    work: Path
    wheel: str
    steps: tuple[str, ...] = STEPS
    models: tuple[str, ...] = ()
    test_bin: str | None = None
    serve_bin: str | None = None
    cxx: str | None = None
    repeat: int = 3
    sizes: str = "small"
    jobs: int = 16
    budget_s: float = 540.0
    calls: int = 200
    warm: int = 20
    hit_rounds: int = 20
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[-4000:]


class Child:
    """A child process in a session of its own, so that a timeout ends it and every
    process it started (compile workers, its own children) by its process group."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    def wait(self, timeout: float | None) -> tuple[int | None, str, str]:
        """``(returncode, stdout, stderr)``; ``None`` when it ran past ``timeout`` and was ended."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
            return self.proc.returncode, out, err
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            return None, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: this child and its descendants
            except ProcessLookupError:
                pass


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> tuple[int | None, str, str]:
    return Child(argv, env, cwd).wait(timeout)


def _child_json(argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> dict[str, Any]:
    """Run a child; its last JSON line is its result, with ``error`` added when it failed,
    printed nothing or ran past ``timeout``. Never raises."""
    t = time.perf_counter()
    rc, stdout, stderr = _run(argv, env, timeout, cwd)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    out: dict[str, Any] = {}
    if lines:
        try:
            out = json.loads(lines[-1])
        except ValueError as exc:
            out = {"error": f"unreadable result: {exc}"}
    out["wall_s"] = time.perf_counter() - t
    if rc is None:
        out["error"] = f"timed out after {timeout:.0f} s"
        out["stderr"] = stderr[-3000:]
    elif rc != 0 or not lines:
        out.setdefault("error", f"exit {rc}")
        out["stderr"] = stderr[-3000:]
    return out


# ---------------------------------------------------------------------- steps


def shim_test(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """The tcg-shim GPU tests (every one ``#[ignore]``d: run with ``--ignored``)."""
    if not opts.test_bin:
        return {"skipped": "no --shim-test-bin"}
    argv = [opts.test_bin, "--ignored", "--test-threads=1"]
    t = time.perf_counter()
    rc, stdout, stderr = _run(argv, env, max(30.0, min(300.0, opts.left())))
    if rc is None:
        return {"error": "timed out", "output_tail": stdout[-3000:] + stderr[-3000:]}
    tests: dict[str, str] = {}
    for line in stdout.splitlines():
        # libtest: "test NAME ... ok" / "... FAILED" / "... ignored".
        if line.startswith("test ") and " ... " in line:
            name, _, outcome = line[5:].partition(" ... ")
            tests[name.strip()] = outcome.strip()
    passed = [n for n, o in tests.items() if o == "ok"]
    return {
        "returncode": rc,
        "seconds": time.perf_counter() - t,
        "tests": tests,
        "passed": len(passed),
        "failed": len([o for o in tests.values() if o.startswith("FAILED")]),
        "ok": rc == 0 and len(passed) == len(tests) and bool(tests),
        "output_tail": (stdout[-3000:] + stderr[-3000:]) if rc else "",
    }


def _mint_dir(opts: Options, model: str, variant: str) -> Path:
    return opts.work / "models" / model / variant


def _admitted(opts: Options, model: str, variant: str = "shim-v1") -> bool:
    return (_mint_dir(opts, model, variant) / "mint.json").exists()


def mint(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """Every model as both variants, each mint in its own child, ``opts.jobs`` at once,
    except that on a GPU the ``shim-v1`` mints run first, one at a time and alone: they
    autotune their Triton templates by timing them on the GPU, and a figure should not
    depend on what else the GPU ran meanwhile (a default mint's compile-time tuning and
    parity check included). Each mint has an inductor cache of its own, so that it tunes
    afresh. A mint this work folder already holds (its ``mint.json`` and result) is
    reused."""

    def one(job: tuple[str, str]) -> tuple[str, dict[str, Any]]:
        model, variant = job
        work = _mint_dir(opts, model, variant)
        saved = work / "mint-result.json"
        if saved.exists():
            return f"{model}/{variant}", {**json.loads(saved.read_text()), "reused_from_work": True}
        work.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, str(CHILD), "mint", model, variant, str(work), opts.device]
        # Its own inductor cache: each mint tunes afresh, not from an earlier mint's choices.
        own = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}
        # Leave a minute to the run and report (from when the mint starts: it may have waited).
        got = _child_json(argv, own, max(60.0, opts.left() - 60.0))
        if "error" not in got:
            saved.write_text(json.dumps(got))
        return f"{model}/{variant}", got

    jobs = [(m, v) for v in VARIANTS for m in opts.models]  # shim-v1's first
    alone = [job for job in jobs if job[1] == "shim-v1" and opts.device != "cpu"]
    results = dict(one(job) for job in alone)
    rest = [job for job in jobs if job not in alone]
    with ThreadPoolExecutor(max_workers=max(1, min(opts.jobs, len(rest)))) as pool:
        results.update(pool.map(one, rest))
    table: dict[str, dict[str, str]] = {}
    for name, got in results.items():
        model, variant = name.split("/")
        if got.get("refused"):
            cell = f"refused ({got.get('code')}): " + "; ".join(got.get("ops") or [])
        elif "error" in got:
            cell = f"error: {str(got['error'])[:300]}"
        else:
            cell = str(got.get("outcome"))
        table.setdefault(model, {})[variant] = cell
    return {"table": table, "mints": results}


def _compare(expected_file: Path, got_file: Path, outputs: int) -> dict[str, Any]:
    """Each output against eager's, leaf by leaf, as the mint's parity check compares
    (``_parity``'s tolerances by dtype: bf16 atol 5e-2 + rtol 5e-2 x |eager|)."""
    from safetensors.torch import load_file

    from torch_compiled_graphs import _parity

    expected, got = load_file(os.fspath(expected_file)), load_file(os.fspath(got_file))
    leaves, failures = [], []
    for i in range(outputs):
        name = f"out{i}"
        if name not in got:
            failures.append(f"{name}: missing from the outputs")
            continue
        leaf, message = _parity._compare(name, expected[name], got[name])
        leaves.append(leaf)
        if message:
            failures.append(message)
    if len(got) != outputs:
        failures.append(f"{len(got)} outputs, eager has {outputs}")
    return {"leaves": leaves, "failures": failures, "ok": not failures}


def run(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """Each admitted shim-v1 graph, torch-free, on the shim runtime; outputs against eager."""
    out: dict[str, Any] = {}
    shim_env = {**env, "TORCH_COMPILED_GRAPHS_RUNTIME": "shim"}
    for model in opts.models:
        if not _admitted(opts, model):
            out[model] = {"skipped": "not minted as shim-v1 (see mint)"}
            continue
        work = _mint_dir(opts, model, "shim-v1")
        got_file = work / "outputs-shim.safetensors"
        got_file.unlink(missing_ok=True)
        argv = [sys.executable, str(CHILD), "run", str(work), opts.device, str(got_file)]
        got = _child_json(argv, shim_env, max(30.0, min(180.0, opts.left())))
        if "error" not in got:
            meta = json.loads((work / "mint.json").read_text())
            try:
                got["parity"] = _compare(work / "io.safetensors", got_file, int(meta["outputs"]))
            except Exception as exc:
                got["parity"] = {"error": _error(exc), "ok": False}
        got["libtorch_free"] = (
            got.get("runtime") == "shim-v1" and not got.get("libtorch_mapped") and got.get("torch_imported") is False
        )
        got["ok"] = bool(got["libtorch_free"] and got.get("parity", {}).get("ok"))
        out[model] = got
    return out


def _bench_model(opts: Options) -> str | None:
    return next((m for m in BENCH_MODELS if m in opts.models and _admitted(opts, m)), None)


def _loaded_objects(prefix: Path) -> tuple[int, list[str]]:
    """How many objects a process loaded, and which of them are libtorch's, from its
    ``LD_DEBUG=files`` log (the dynamic loader's own record, ``dlopen`` included). Only
    ``generating link map`` lines count: a ``dlopen(RTLD_NOLOAD)`` probe (whether
    libtorch's allocator is loaded) logs the name it asked for without loading it."""
    names: set[str] = set()
    for log in prefix.parent.glob(prefix.name + ".*"):
        for line in log.read_text(errors="replace").splitlines():
            _, found, rest = line.partition("file=")
            if found and rest.split() and "generating link map" in rest:
                names.add(os.path.basename(rest.split()[0]))
    return len(names), sorted(n for n in names if n.startswith(("libtorch", "libc10")))


def serve(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """The Rust ``Served`` (serve example) on the shim runtime, on the bench model."""
    if not opts.serve_bin:
        return {"skipped": "no --serve-bin"}
    model = _bench_model(opts)
    if model is None:
        return {"skipped": f"none of {BENCH_MODELS} was minted as shim-v1 (see mint)"}
    from torch_compiled_graphs import _parity
    from torch_compiled_graphs.native import find_torch_lib

    work = _mint_dir(opts, model, "shim-v1")
    meta = json.loads((work / "mint.json").read_text())
    if meta["outputs"] != 1 and model == "blocks":
        return {"error": f"the block stack has {meta['outputs']} outputs"}
    import torchfree_io

    dtype = torchfree_io.read_safetensors(meta["io"])["out0"][0]
    atol, rtol = _parity.tolerance(dtype)
    log = work / "serve-ld"
    for old in work.glob("serve-ld.*"):
        old.unlink()
    argv = [opts.serve_bin, "--store", meta["store"], "--key", meta["key"], "--dest", str(work / "serve-dest")]
    argv += ["--torch-lib", find_torch_lib(), "--weights", meta["weights"], "--io", meta["io"]]
    for name in [*meta["args"], *meta["kwargs"].values()]:
        argv += ["--in", name]
    for i in range(int(meta["outputs"])):
        argv += ["--out", f"out{i}"]
    argv += ["--device", opts.device, "--runtime", "shim", "--repeat", str(opts.calls), "--verbose"]
    argv += ["--rtol", str(rtol), "--atol", str(atol)]
    out: dict[str, Any] = {"model": model, "argv": argv, "tolerance": {"atol": atol, "rtol": rtol}}
    run_env = {**env, "LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(log)}
    if opts.device.startswith("cuda"):
        from torch_compiled_graphs.native import find_cuda_runtime

        # A process without Python is told where the CUDA runtime is (docs/run.md, "Runtime").
        cudart = find_cuda_runtime()
        if cudart and "TORCH_COMPILED_GRAPHS_CUDART" not in run_env:
            run_env["TORCH_COMPILED_GRAPHS_CUDART"] = cudart
        out["cudart"] = run_env.get("TORCH_COMPILED_GRAPHS_CUDART")
    rc, stdout, stderr = _run(argv, run_env, max(30.0, min(180.0, opts.left())))
    if rc is None:
        return {**out, "error": "timed out", "stderr": stderr[-2000:]}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    out["returncode"] = rc
    out["stderr"] = stderr[-2000:]
    if lines:
        out["report"] = json.loads(lines[-1])
    else:
        out["error"] = f"exit {rc}, no report: {stdout[-1000:]}"
    objects, out["libtorch_loaded"] = _loaded_objects(log)
    out["ld_debug_objects"] = objects
    report = out.get("report") or {}
    out["ok"] = (
        rc == 0
        and report.get("ok") is True
        and report.get("runtime") == "shim-v1"
        and objects > 0  # the loader's log was read: an empty list means something
        and not out["libtorch_loaded"]
    )
    return out


HIT_CODE = {
    "import torch_compiled_graphs": "import torch_compiled_graphs",
    "import + Engine(root)": "import sys, torch_compiled_graphs as t; t.Engine(sys.argv[1])",
    "import + Engine(root) + resolve": (
        "import sys, torch_compiled_graphs as t; t.Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])"
    ),
}


def hitpath(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """The torch-free hit path in fresh processes against ``python -c pass`` (medians,
    rounds interleaved, one warm-up round; the reference artifact, 2 KB of code)."""
    import bench
    from torch_compiled_graphs import Engine

    root = opts.work / "hit-store"
    engine = Engine(root)
    if engine.resolve(bench.KEY, opts.work / "hit-check") is None:
        engine.import_artifact(bench.KEY, bench.REFERENCE)
    py = sys.executable

    def sh(*argv: str) -> None:
        subprocess.run(list(argv), check=True, stdout=subprocess.DEVNULL, env=env)

    cases: dict[str, Callable[[int], None]] = {"python -c pass": lambda i: sh(py, "-c", "pass")}
    for name, code in HIT_CODE.items():
        cases[name] = lambda i, c=code: sh(py, "-c", c, str(root), bench.KEY, str(opts.work / f"hit-{time.time_ns()}"))
    medians = bench.medians(cases, opts.hit_rounds)
    code = HIT_CODE["import + Engine(root) + resolve"] + "; print('torch' in sys.modules)"
    check = subprocess.run(
        [py, "-c", code, str(root), bench.KEY, str(opts.work / "hit-torch-check")],
        capture_output=True,
        text=True,
        env=env,
    )
    base = medians["python -c pass"]
    return {
        "rounds": opts.hit_rounds,
        "median_s": medians,
        "over_python_c_pass": {k: v / base for k, v in medians.items() if k != "python -c pass"},
        "torch_imported": check.stdout.strip(),
        "goal_met": medians["import + Engine(root) + resolve"] / base <= 1.5,
    }


def install_bytes(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """What a worker installs for each path, with this machine's torch (its JSON is indented)."""
    argv = [sys.executable, str(SCRIPTS / "install_bytes.py"), "--wheel", opts.wheel, "--json"]
    rc, stdout, stderr = _run(argv, env, 120.0, ROOT)
    if rc != 0:
        return {"error": f"exit {rc}: {stderr[-3000:]}"}
    got: dict[str, Any] = json.loads(stdout)
    got["goal_met"] = got["ratio"] < 0.05
    return got


def steady(opts: Options, env: dict[str, str]) -> dict[str, Any]:
    """shim-v1 on the shim against the default on libtorch, each in a fresh torch-free child,
    ``opts.repeat`` rounds of the two in turn (a round's processes run back to back, so a
    drift of the machine between rounds moves both); each cell is the median over rounds
    of each round's median call, and the ratios are of those medians."""
    import statistics

    model = _bench_model(opts)
    if model is None:
        return {"skipped": f"none of {BENCH_MODELS} was minted as shim-v1 (see mint)"}
    if not _admitted(opts, model, "default"):
        return {"skipped": f"{model} was not minted as the default variant (see mint)"}
    out: dict[str, Any] = {"model": model, "calls": opts.calls, "warm": opts.warm, "rounds": []}
    for _ in range(max(1, opts.repeat)):
        if out["rounds"] and opts.left() < 60.0:
            break
        one: dict[str, Any] = {}
        for variant, runtime in (("shim-v1", "shim"), ("default", "libtorch")):
            work = _mint_dir(opts, model, variant)
            argv = [sys.executable, str(CHILD), "steady", str(work), opts.device, str(opts.calls), str(opts.warm)]
            one[variant] = _child_json(
                argv, {**env, "TORCH_COMPILED_GRAPHS_RUNTIME": runtime}, max(30.0, min(240.0, opts.left()))
            )
        out["rounds"].append(one)
    for variant in ("shim-v1", "default"):
        # The first round's report (runtime, capture statistics, mapped libraries), with
        # the cells of every round.
        first = dict(out["rounds"][0][variant])
        per_round = [r[variant].get("cells", {}) for r in out["rounds"]]
        first["cells_by_round"] = per_round
        cells = sorted({c for cells in per_round for c in cells})
        first["cells"] = {c: statistics.median(r[c] for r in per_round if c in r) for c in cells}
        out[variant] = first
    shim_cells, default_cells = out["shim-v1"].get("cells", {}), out["default"].get("cells", {})
    ratios = {cell: shim_cells[cell] / default_cells[cell] for cell in shim_cells if default_cells.get(cell)}
    out["variant_over_default"] = ratios
    out["goal_met"] = {cell: r <= 1.2 for cell, r in ratios.items()}
    return out


def _coldstart_argv(opts: Options, site: Path, mint_only: bool) -> list[str]:
    argv = [sys.executable, str(SCRIPTS / "coldstart.py"), "--out", str(opts.out / "shim-coldstart")]
    argv += ["--device", opts.device, "--sizes", opts.sizes, "--repeat", str(opts.repeat), "--site", str(site)]
    argv += ["--work", str(opts.work / "coldstart"), "--variant", "shim-v1", "--runtime", "shim"]
    argv += ["--ways", COLDSTART_WAYS]
    if opts.serve_bin:
        argv += ["--serve-bin", opts.serve_bin]
    if opts.cxx:
        argv += ["--cxx", opts.cxx]
    if mint_only:
        argv.append("--mint-only")
    return argv


class Minting:
    """The cold-start models' mints (``coldstart.py --mint-only``), started beside the
    mint step and waited for before the first timed step."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._child = Child(argv, env)
        self._started = time.perf_counter()
        self.result: dict[str, Any] | None = None

    def wait(self, timeout: float) -> dict[str, Any]:
        if self.result is None:
            rc, _, err = self._child.wait(max(1.0, timeout))
            self.result = {"returncode": rc, "seconds": time.perf_counter() - self._started}
            if rc != 0:
                self.result["error"] = ("timed out: " if rc is None else "") + err[-3000:]
        return self.result

    def stop(self) -> None:
        """End the mints if no step waited for them (the budget ran out first)."""
        if self.result is None:
            self._child.kill()
            self.result = {"error": "stopped: no step used them"}


def coldstart(opts: Options, site: Path, env: dict[str, str], minting: Minting | None) -> dict[str, Any]:
    """The cold start of the 0.8 GB model (``--shim-sizes``) through both paths and the floor."""
    if minting is not None and "error" in minting.wait(opts.left()):
        return {"error": f"the cold-start mints failed: {minting.wait(0)}"}
    t = time.perf_counter()
    # Within the stage's budget: past it, what coldstart.py saved so far is the result.
    rc, _, stderr = _run(_coldstart_argv(opts, site, False), env, max(10.0, opts.left()))
    report_file = opts.out / "shim-coldstart" / "coldstart.json"
    out: dict[str, Any] = json.loads(report_file.read_text()) if report_file.exists() else {}
    out["wall_s"] = time.perf_counter() - t
    if rc != 0:
        out["error"] = ("timed out (the stage's budget): " if rc is None else f"exit {rc}: ") + stderr[-3000:]
    return out


# ---------------------------------------------------------------------- the stage


def shim_stage(
    site: Path, opts: Options, child_env: Callable[[Path], dict[str, str]], save: Callable[[], None]
) -> dict[str, Any]:
    """Run the chosen steps in order, each recorded (figures or error) and saved at once."""
    sys.path.insert(0, str(SCRIPTS))
    sys.path.insert(0, str(site))  # the installed wheel, for the parent's comparisons
    if not opts.models:
        opts.models = CPU_MODELS if opts.device == "cpu" else GPU_MODELS
    opts.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": opts.device,
        "steps": list(opts.steps),
        "models": list(opts.models),
        "work": str(opts.work),
        "budget_s": opts.budget_s,
    }
    out_file = opts.out / "shim.json"

    def write() -> None:
        out_file.write_text(json.dumps(result, indent=1, default=str))
        save()

    env = child_env(site)
    # The cold-start models mint beside the models of the mint step (the compiles overlap).
    minting = Minting(_coldstart_argv(opts, site, True), env) if "coldstart" in opts.steps else None
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "shim-test": lambda: shim_test(opts, env),
        "mint": lambda: mint(opts, env),
        "run": lambda: run(opts, env),
        "serve": lambda: serve(opts, env),
        "hitpath": lambda: hitpath(opts, env),
        "install-bytes": lambda: install_bytes(opts, env),
        "steady": lambda: steady(opts, env),
        "coldstart": lambda: coldstart(opts, site, env, minting),
    }
    for name in STEPS:
        if name not in opts.steps:
            continue
        if opts.left() <= 0:
            result[name] = {"skipped": f"the stage's budget of {opts.budget_s:.0f} s was spent"}
            write()
            continue
        if name in TIMED and minting is not None and "coldstart_mints" not in result:
            result["coldstart_mints"] = minting.wait(opts.left())
        t = time.perf_counter()
        print(f"shim: {name} ...", file=sys.stderr, flush=True)
        try:
            result[name] = steps[name]()
        except Exception as exc:  # recorded; the next step runs
            result[name] = {"error": _error(exc)}
        result[name]["step_s"] = time.perf_counter() - t
        write()
    if minting is not None:
        minting.stop()
    result["summary"] = summary(result)
    result["total_s"] = time.monotonic() - opts.started
    write()
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's checks and goals in one place (``None``: not measured)."""
    out: dict[str, Any] = {}
    test = result.get("shim-test", {})
    out["shim_tests_ok"] = test.get("ok")
    out["mint_table"] = result.get("mint", {}).get("table")
    runs = result.get("run", {})
    out["runs_libtorch_free_and_equal_to_eager"] = {
        m: r.get("ok") for m, r in runs.items() if isinstance(r, dict) and "skipped" not in r and m != "step_s"
    }
    out["serve_ok"] = result.get("serve", {}).get("ok")
    hit = result.get("hitpath", {})
    out["hitpath_over_python_c_pass"] = hit.get("over_python_c_pass", {}).get("import + Engine(root) + resolve")
    out["install_ratio"] = result.get("install-bytes", {}).get("ratio")
    out["steady_variant_over_default"] = result.get("steady", {}).get("variant_over_default")
    cold = result.get("coldstart", {})
    out["coldstart_ratios"] = {
        size: cold[size].get("ratios") for size in ("small", "large", "tiny") if isinstance(cold.get(size), dict)
    }
    return out


def failed_checks(summary: dict[str, Any]) -> list[str]:
    """The checks of :func:`summary` that ran and failed (a refusal at mint is a result, not a failure)."""
    failed = [name for name in ("shim_tests_ok", "serve_ok") if summary.get(name) is False]
    runs = summary.get("runs_libtorch_free_and_equal_to_eager") or {}
    failed += [f"run {model}" for model, ok in runs.items() if not ok]
    return failed
