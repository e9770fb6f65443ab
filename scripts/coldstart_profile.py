"""Where a cold start's time goes, beyond its phases: native stack samples of
fresh ``load_native`` processes, and the libraries' loading on their own.

    python3 scripts/coldstart_profile.py --work WORK --key KEY --out OUT
        [--py-spy PATH] [--device cuda:0] [--runs 5] [--site SITE]

``WORK`` is a model folder of ``scripts/coldstart.py`` (its ``store`` and
``weights.safetensors``), ``KEY`` its key. Writes to ``OUT``:

- ``profile-<i>.txt``: py-spy's folded native stacks (``--native``, every
  thread) of one fresh process running coldstart's native way;
- ``profile.json``: for each run its phases; the libraries opened alone in
  fresh processes with ``RTLD_NOW`` and with ``RTLD_LAZY``; the native way by
  default (``load_native`` sets ``CUDA_MODULE_LOADING=LAZY`` when unset), with the
  driver's own default (the variable set empty), interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coldstart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--py-spy", help="the py-spy binary (no profiles without it)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--site", help="a directory the wheel was installed into")
    args = parser.parse_args()
    if args.site:
        coldstart.SITE.append(os.path.abspath(args.site))
    args.out.mkdir(parents=True, exist_ok=True)
    env = coldstart._env()
    report: dict[str, object] = {}

    def save() -> None:
        (args.out / "profile.json").write_text(json.dumps(report, indent=1))

    torch_lib = coldstart.torch_lib_dir()
    native = [sys.executable, "-c", coldstart.NATIVE, str(args.work), args.key, args.device, "0"]
    if args.py_spy:
        runs = []
        for i in range(args.runs):
            folded = args.out / f"profile-{i}.txt"
            spy = [args.py_spy, "record", "--native", "--threads", "--idle", "-r", "1000", "-f", "raw"]
            proc = subprocess.run(
                [*spy, "-o", str(folded), "--", *native],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            # py-spy prints its own lines too; the child's is the JSON one.
            found: dict[str, object] = {"error": (proc.stdout + proc.stderr)[-3000:]}
            for line in reversed(proc.stdout.splitlines()):
                if line.startswith("{"):
                    found = json.loads(line)
                    break
            runs.append(found)
            report["profiled"] = runs
            save()
    opened: dict[str, list[float]] = {"now": [], "lazy": []}
    for _ in range(args.runs):
        for mode in opened:
            opened[mode].append(float(coldstart.child(coldstart.LIBRARIES, torch_lib, mode)["s"]))  # type: ignore[arg-type]
    report["open_libraries"] = {m: {"median": statistics.median(v), "runs": v} for m, v in opened.items()}
    save()
    # Variants of the native way, by environment, interleaved.
    variants = {
        "default": {},
        # Set but empty: the driver's own default (load_native sets LAZY only when unset).
        "module_loading_driver_default": {"CUDA_MODULE_LOADING": ""},
    }
    loading: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, extra in variants.items():
            loading[name].append(
                coldstart.child(coldstart.NATIVE, args.work, args.key, args.device, 0, env={**env, **extra})
            )
    report["variants"] = {
        name: {"median": statistics.median(float(r["s"]) for r in runs), "runs": runs}  # type: ignore[arg-type]
        for name, runs in loading.items()
    }
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "profiled"}, default=str)[:4000])


if __name__ == "__main__":
    main()
