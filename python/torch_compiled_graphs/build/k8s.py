"""The ``k8s`` executor: an Indexed Job per target, rendered as one JSON ``List``.

The rendered list holds a ConfigMap with the matrix and the lock (mounted at
``/etc/tcg-build``) and one Job per target that has cells needing work. Job ``i`` runs the
cell step with ``--cells`` (the matrix indices of that target's cells, in order) and no
``--index``: each pod's ``JOB_COMPLETION_INDEX`` picks its position in that list. The
``podFailurePolicy`` fails an index at once on the deterministic exit codes (3, and 2 for
usage), ignores disruptions (preemption, eviction: the ``DisruptionTarget`` condition) and
leaves everything else (the transient code 75, a killed container) to
``backoffLimitPerIndex``. GPU Jobs select nodes by the GPU feature discovery labels
``nvidia.com/gpu.compute.major`` / ``.minor`` and ask for one ``nvidia.com/gpu``; CPU Jobs
set ``NVIDIA_VISIBLE_DEVICES=none`` and ``CUDA_VISIBLE_DEVICES=``.

Rendering needs no Kubernetes package; ``kubectl apply -f -`` submits it.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from typing import Any

from .errors import EXIT_DETERMINISTIC, EXIT_USAGE, BuildError
from .matrix import Cell, Matrix

__all__ = ["CONTAINER", "MOUNT", "apply", "label_value", "node_selector", "render", "resource_name"]

#: Where the ConfigMap with the matrix and the lock is mounted in every pod.
MOUNT = "/etc/tcg-build"
#: The cell container's name (the podFailurePolicy's exit-code rule names it).
CONTAINER = "build-cell"
_LOCK_NAME = "fleet-toolchain.json"
_MATRIX_NAME = "matrix.toml"


def _dns(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


#: A DNS label (RFC 1123): what a Job name (its pods carry it as a label value) and a
#: label value must be.
_LABEL_MAX = 63
#: Targets whose DNS form loses nothing: ``sm_NN`` (``_`` is its only change, and no target
#: has a ``-`` there) and names already of ``[a-z0-9-]``.
_LOSSLESS = re.compile(r"sm_[0-9]+a?|[a-z0-9]([a-z0-9-]*[a-z0-9])?")


def _short(text: str, room: int) -> str:
    return text[: max(0, room)].strip("-")


def resource_name(prefix: str, digest: str, part: str) -> str:
    """``<prefix>-<digest>-<part>`` as a DNS label, one per distinct ``part``.

    Kept as is when it fits in 63 characters and ``part``'s DNS form loses nothing;
    otherwise the prefix is shortened first (then ``part``) and a hash of the exact
    ``(prefix, digest, part)`` is appended, so two targets never render one name
    (``cpu-x86_64`` and ``cpu-x86.64`` share a DNS form, and a long prefix used to cut
    the target off).
    """
    head, tail = _dns(prefix), _dns(part)
    plain = "-".join(p for p in (head, digest, tail) if p)
    if len(plain) <= _LABEL_MAX and _LOSSLESS.fullmatch(part):
        return plain
    tag = hashlib.sha256(json.dumps([prefix, digest, part]).encode("utf-8")).hexdigest()[:10]
    # digest, tag and three '-' are fixed; the target keeps at least 30 characters.
    room = _LABEL_MAX - len(digest) - len(tag) - 3
    tail = _short(tail, room - min(len(head), 12))
    head = _short(head, room - len(tail))
    return "-".join(p for p in (head, digest, tail, tag) if p)


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63, alphanumeric at both ends), distinct per text."""
    plain = _dns(text)
    if len(plain) <= _LABEL_MAX and _LOSSLESS.fullmatch(text):
        return plain
    tag = hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]
    return "-".join(p for p in (_short(plain, _LABEL_MAX - len(tag) - 1), tag) if p)


def node_selector(matrix: Matrix, target: str) -> dict[str, str]:
    """The nodeSelector of a target: ``[k8s.node_selectors]`` first, else GFD's compute
    capability labels for ``sm_NN`` (``nvidia.com/gpu.compute.major`` = N / ``minor`` = N),
    else none."""
    stated = dict(matrix.k8s.get("node_selectors") or {})
    if target in stated:
        return {str(k): str(v) for k, v in dict(stated[target]).items()}
    match = re.fullmatch(r"sm_([0-9]+)([0-9])a?", target)
    if match is None:
        return {}
    return {"nvidia.com/gpu.compute.major": match.group(1), "nvidia.com/gpu.compute.minor": match.group(2)}


def _job(matrix: Matrix, target: str, cells: list[Cell], config_name: str) -> dict[str, Any]:
    k = matrix.k8s
    image = k.get("image")
    if not isinstance(image, str) or not image:
        raise BuildError(
            "the k8s executor needs [k8s] image (a serving image with the recipes)", "build.executor_invalid"
        )
    python = str(k.get("python", "python3"))
    command = [python, "-m", "torch_compiled_graphs", "build-cell", f"{MOUNT}/{_MATRIX_NAME}"]
    command += ["--toolchain", f"{MOUNT}/{_LOCK_NAME}", "--cells", ",".join(str(c.index) for c in cells)]
    env: list[dict[str, Any]] = [{"name": str(n), "value": str(v)} for n, v in dict(k.get("env") or {}).items()]
    gpu = cells[0].gpu
    if not gpu:
        env += [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}, {"name": "CUDA_VISIBLE_DEVICES", "value": ""}]
    if matrix.remote:
        env.append({"name": "TORCH_COMPILED_GRAPHS_REMOTE", "value": matrix.remote})
    requests: dict[str, str] = {"cpu": str(k.get("cpu", "1")), "memory": str(k.get("memory", "4Gi"))}
    resources: dict[str, Any] = {"requests": dict(requests)}
    if gpu:
        resources["limits"] = {"nvidia.com/gpu": "1"}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "env": env,
        "resources": resources,
        "volumeMounts": [{"name": "matrix", "mountPath": MOUNT, "readOnly": True}],
    }
    secrets = list(k.get("env_from_secrets") or [])
    if secrets:
        container["envFrom"] = [{"secretRef": {"name": str(s)}} for s in secrets]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "matrix", "configMap": {"name": config_name}}],
    }
    selector = node_selector(matrix, target)
    if selector:
        pod["nodeSelector"] = selector
    if k.get("service_account"):
        pod["serviceAccountName"] = str(k["service_account"])
    n = len(cells)
    name = resource_name(str(k.get("name", "tcg-build")), matrix.digest[:8], target)
    labels = {
        "app.kubernetes.io/name": "torch-compiled-graphs-build",
        "torch-compiled-graphs/target": label_value(target),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": str(k.get("namespace", "default")), "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": n,
            "parallelism": min(n, int(k.get("parallelism", n))),
            "backoffLimitPerIndex": int(k.get("backoff_limit_per_index", 2)),
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailIndex",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": sorted([EXIT_USAGE, EXIT_DETERMINISTIC]),
                        },
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]
            },
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def render(matrix: Matrix, cells: list[Cell]) -> dict[str, Any]:
    """The manifest (a ``v1`` ``List``) that builds ``cells``: a ConfigMap and a Job per target."""
    config_name = resource_name(str(matrix.k8s.get("name", "tcg-build")), matrix.digest[:8], "matrix")
    items: list[dict[str, Any]] = []
    by_target: dict[str, list[Cell]] = {}
    for cell in cells:
        by_target.setdefault(cell.target, []).append(cell)
    if by_target:
        items.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": config_name, "namespace": str(matrix.k8s.get("namespace", "default"))},
                "data": {_MATRIX_NAME: matrix.text, _LOCK_NAME: matrix.toolchain_path.read_text(encoding="utf-8")},
            }
        )
    seen: dict[str, str] = {}
    for target, group in by_target.items():
        job = _job(matrix, target, group, config_name)
        name = job["metadata"]["name"]
        if name in seen or name == config_name:
            # `kubectl apply` would patch one object with the other: refused, never rendered.
            raise BuildError(
                f"the Jobs of targets {seen.get(name, 'matrix')!r} and {target!r} would share the name {name!r}",
                "build.executor_invalid",
            )
        seen[name] = target
        items.append(job)
    return {"apiVersion": "v1", "kind": "List", "items": items}


def apply(manifest: dict[str, Any], kubectl: str = "kubectl") -> str:
    """``kubectl apply -f -`` the manifest; its stdout (``build.executor_failed`` on failure)."""
    try:
        proc = subprocess.run(
            [kubectl, "apply", "-f", "-"], input=json.dumps(manifest), capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"cannot run {kubectl} apply: {exc}", "build.executor_failed") from exc
    if proc.returncode != 0:
        raise BuildError(f"{kubectl} apply failed: {proc.stderr.strip()}", "build.executor_failed")
    return proc.stdout
