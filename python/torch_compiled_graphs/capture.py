"""CUDA-graph replay for graphs loaded with torch's package loader (``load()``).

At batch 1 a compiled graph spends most of its time launching kernels: the
container launches each kernel from the host, one after the other. A CUDA graph
records those launches once and replays them with one launch. Nothing upstream
captures AOTInductor packages, so this module does, around the container's run:

- per *shape set* (the shape, strides, dtype and device of every flat tensor
  input), after ``WARMUP_RUNS`` uncaptured runs the run is captured once, with
  static input buffers owned by the graph, and later calls copy their inputs
  into those buffers and replay it;
- all captures of one loaded graph share one private memory pool of torch's
  caching allocator, which never hands that memory to other work;
- at most ``max_captures`` shape sets stay captured (least recently used out);
- a capture records the graph's *binding generation* (docs/run.md): a call
  whose generation differs drops every capture, since a captured graph reads
  the constants it was captured with, by address;
- where capture is unsafe (custom ops through the proxy executor, a capture
  that fails) the graph falls back to uncaptured runs and says why in the
  debug log (logger ``torch_compiled_graphs``).

Everything except the CUDA calls lives in :class:`GraphCapture`, which drives a
*capture backend*: :class:`CudaGraphBackend` (``torch.cuda.CUDAGraph``) on a
GPU, or :class:`RecordingBackend`, which emulates capture and replay by running
the container and records what it did, so the logic is tested on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

# The options both load paths read (cuda_graphs, max_captures and their variables).
from ._loadpath import ENV_CUDA_GRAPHS, ENV_MAX_CAPTURES, MAX_CAPTURES, capture_options
from .errors import BindingError

if TYPE_CHECKING:
    from .engine import StoredCompiledGraph

__all__ = [
    "ENV_CUDA_GRAPHS",
    "ENV_MAX_CAPTURES",
    "MAX_CAPTURES",
    "OUTPUT_MODES",
    "WARMUP_RUNS",
    "CaptureBackend",
    "CudaGraphBackend",
    "GraphCapture",
    "RecordingBackend",
]

LOGGER = logging.getLogger("torch_compiled_graphs")

#: Uncaptured runs of a shape set before it is captured. The first run after
#: constants are bound folds constants (and waits for the device), and kernels,
#: cuBLAS handles and workspaces are made on first use: none of it may happen
#: under capture, and a shape set seen once is often never seen again.
WARMUP_RUNS = 2
#: ``copy``: a call returns its own copy of the outputs; ``static``: the graph's
#: output buffers, valid until its next call.
OUTPUT_MODES = ("copy", "static")
#: Shape sets whose warm-up count is remembered: a graph called with ever new
#: shapes (a growing sequence) must not grow without bound.
_WARM_REMEMBERED = 64
#: One capture at a time in the process: torch's graph capture assumes it.
_CAPTURE_LOCK = threading.Lock()


class CaptureBackend(Protocol):
    """What :class:`GraphCapture` needs from the device: capture, replay and stream order."""

    name: str

    def pool(self) -> object:
        """A private memory pool, shared by every capture of one loaded graph."""

    def capture(self, run: Callable[[], list[Any]], pool: object) -> tuple[object, list[Any]]:
        """Capture ``run`` (which reads the static inputs); return a handle and the static outputs."""

    def replay(self, handle: object) -> None:
        """Replay a capture on the caller's current stream: it rewrites the static outputs."""

    def capturing(self) -> bool:
        """Whether the caller's current stream is being captured by the caller."""

    def fence(self) -> object:
        """Mark the end of the work just queued on the caller's current stream."""

    def follow(self, fence: object) -> None:
        """Order the caller's current stream after ``fence``."""

    def drain(self, fence: object) -> None:
        """Wait on the host until ``fence`` is reached (before memory a capture uses is released)."""


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` on one device.

    A capture runs on a stream of the graph's own (the legacy default stream
    cannot be captured), ordered after the caller's current stream; the run is
    first made once on that stream uncaptured, so that the per-stream state of
    the libraries it calls (cuBLAS workspaces) exists before the capture. The
    capture mode is ``thread_local``: other threads of the process may keep
    working while one graph captures. Replays run on the caller's current
    stream."""

    name = "cuda"

    def __init__(self, device: Any) -> None:
        self._device = device
        # Made at the first capture, not at load: loading allocates nothing for
        # capture's sake (on a device too full for a stream, load() still refuses
        # or binds with its own typed errors; a capture that cannot start falls back).
        self._stream: Any = None

    def pool(self) -> object:
        import torch

        return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], list[Any]], pool: object) -> tuple[object, list[Any]]:
        import torch

        with _CAPTURE_LOCK, torch.cuda.device(self._device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            caller = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(caller)
            with torch.cuda.stream(self._stream):
                run()
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph ends the capture and restores the stream when the run
            # raises, so a failed capture leaves the stream and the allocator usable.
            with torch.cuda.graph(graph, pool=pool, stream=self._stream, capture_error_mode="thread_local"):  # type: ignore[arg-type]
                outputs = run()
            caller.wait_stream(self._stream)
        return graph, list(outputs)

    def replay(self, handle: object) -> None:
        handle.replay()  # type: ignore[attr-defined]

    def capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())

    def fence(self) -> object:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    def follow(self, fence: object) -> None:
        import torch

        torch.cuda.current_stream(self._device).wait_event(fence)  # type: ignore[arg-type]

    def drain(self, fence: object) -> None:
        fence.synchronize()  # type: ignore[attr-defined]


class _Recorded:
    __slots__ = ("outputs", "run")

    def __init__(self, run: Callable[[], list[Any]], outputs: list[Any]) -> None:
        self.run = run
        self.outputs = outputs


class RecordingBackend:
    """Capture and replay emulated by running the container, on any device.

    A capture runs once and keeps the outputs as the static outputs; a replay
    runs again and writes the result into them, as a CUDA graph's replay
    writes its output buffers, reading the live constants. ``events`` records
    what was done: ``("pool",)``, ``("capture", shapes)``, ``("replay", shapes)``,
    ``("drain",)``. ``fail`` makes every capture raise it (a capture that fails);
    ``outer`` stands for a capture of the caller's own around the calls."""

    name = "recording"

    def __init__(self, *, fail: BaseException | None = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.fail = fail
        self.outer = False

    def pool(self) -> object:
        self.events.append(("pool",))
        return object()

    def capture(self, run: Callable[[], list[Any]], pool: object) -> tuple[object, list[Any]]:
        if self.fail is not None:
            self.events.append(("capture failed",))
            raise self.fail
        outputs = list(run())
        self.events.append(("capture", [tuple(o.shape) for o in outputs]))
        return _Recorded(run, outputs), outputs

    def replay(self, handle: object) -> None:
        assert isinstance(handle, _Recorded)
        for static, value in zip(handle.outputs, handle.run(), strict=True):
            static.copy_(value)
        self.events.append(("replay", [tuple(o.shape) for o in handle.outputs]))

    def capturing(self) -> bool:
        return self.outer

    def fence(self) -> object:
        # Work on the CPU is done when the call returns: the fence only marks that
        # there was a call to wait for, so that drains are recorded.
        return len(self.events)

    def follow(self, fence: object) -> None:
        pass

    def drain(self, fence: object) -> None:
        self.events.append(("drain",))


class GraphCapture:
    """The calls of one loaded graph, captured and replayed per shape set.

    ``run`` is the container's uncaptured run (a list of input tensors in, the
    output tensors out). ``backend`` is ``None`` where calls are never captured
    (``reason`` says why); every call then goes straight to ``run``, without a
    lock, as before this module existed. With a backend the container runs
    single-threaded, so every call takes the lock, also after a fallback.
    ``timings`` is the loaded graph's dict: ``capture`` is set to the duration
    of the last capture."""

    def __init__(
        self,
        run: Callable[[list[Any]], list[Any]],
        backend: CaptureBackend | None,
        *,
        max_captures: int,
        outputs: str,
        timings: dict[str, float],
        reason: str | None,
        fallback: bool = False,
        name: str = "",
    ) -> None:
        self._run = run
        self._backend = backend
        self._serialised = backend is not None
        self._max = max_captures
        self._copy = outputs == "copy"
        self._timings = timings
        self._name = name
        #: Why calls are not captured (``None`` while they are).
        self.reason: str | None = reason if backend is None else None
        self.stats: dict[str, float] = {
            "captures": 0,
            "replays": 0,
            "evictions": 0,
            "invalidated": 0,
            "fallbacks": 1 if fallback else 0,
            "capture_seconds": 0.0,
            "uncaptured_runs": 0,
        }
        self._lock = threading.Lock()
        self._local = threading.local()
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._warm: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._generation: int | None = None
        self._pool: object = None
        self._fence: object = None
        if self.reason is not None:
            LOGGER.debug("%s: CUDA graphs off: %s", name, self.reason)

    @property
    def active(self) -> bool:
        """Whether calls are captured and replayed (after their warm-up)."""
        return self._backend is not None

    @property
    def captured(self) -> int:
        """Shape sets captured now."""
        return len(self._entries)

    def run(self, tensors: list[Any], generation: int) -> list[Any]:
        """One call at binding ``generation``: uncaptured, captured or replayed."""
        if not self._serialised:
            self.stats["uncaptured_runs"] += 1
            return self._run(tensors)
        import torch

        with self._lock, torch.no_grad():
            backend = self._backend
            if backend is None or backend.capturing():
                # After a fallback: uncaptured, still one call at a time. Inside a capture
                # of the caller's own: its capture records the container's kernels.
                self.stats["uncaptured_runs"] += 1
                return self._run(tensors)
            if generation != self._generation:
                self._invalidate(generation)
            key = _shape_set(tensors)
            entry = self._entries.get(key)
            if entry is None:
                seen = self._warm.pop(key, 0)
                if seen < WARMUP_RUNS:
                    self._warm[key] = seen + 1
                    while len(self._warm) > _WARM_REMEMBERED:
                        self._warm.popitem(last=False)
                    self.stats["uncaptured_runs"] += 1
                    return self._run(tensors)
                try:
                    entry = self._capture(backend, key, tensors)
                except Exception as exc:
                    self._give_up(f"the capture of shape set {_describe(key)} failed: {type(exc).__name__}: {exc}")
                    self.stats["uncaptured_runs"] += 1
                    return self._run(tensors)
            else:
                self._entries.move_to_end(key)
                if self._fence is not None:
                    backend.follow(self._fence)
                for buffer, value in zip(entry.inputs, tensors, strict=True):
                    buffer.copy_(value)
            backend.replay(entry.handle)
            self.stats["replays"] += 1
            copy = self._copy and not getattr(self._local, "static", False)
            outputs = [_copy(o) for o in entry.outputs] if copy else list(entry.outputs)
            self._fence = backend.fence()
            return outputs

    @contextlib.contextmanager
    def static_outputs(self) -> Iterator[None]:
        """Calls of this thread in the block return the static outputs of a replay (no copy)."""
        before = getattr(self._local, "static", False)
        self._local.static = True
        try:
            yield
        finally:
            self._local.static = before

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """A block no call of this graph runs beside, entered once the work of the last
        call is done: where the constants change. A threaded container (no capture)
        orders a change of constants with its runs itself."""
        if not self._serialised:
            yield
            return
        with self._lock:
            if self._backend is not None and self._fence is not None:
                self._backend.drain(self._fence)
            yield

    def _capture(self, backend: CaptureBackend, key: tuple[Any, ...], tensors: list[Any]) -> _Entry:
        import torch

        if len(self._entries) >= self._max:
            old, _ = self._drop_oldest()
            self.stats["evictions"] += 1
            LOGGER.debug("%s: evicted the capture of shape set %s (max_captures %d)", self._name, old, self._max)
        if self._fence is not None:
            backend.follow(self._fence)
        # empty_like keeps the caller's strides (contiguous for an overlapping view).
        inputs = [torch.empty_like(t).copy_(t) for t in tensors]
        if self._pool is None:
            self._pool = backend.pool()
        started = time.perf_counter()
        handle, outputs = backend.capture(lambda: self._run(list(inputs)), self._pool)
        elapsed = time.perf_counter() - started
        entry = _Entry(handle, inputs, outputs)
        self._entries[key] = entry
        self.stats["captures"] += 1
        self.stats["capture_seconds"] += elapsed
        self._timings["capture"] = elapsed
        LOGGER.debug(
            "%s: captured shape set %s in %.1f ms (%d of at most %d captured)",
            self._name,
            _describe(key),
            elapsed * 1e3,
            len(self._entries),
            self._max,
        )
        return entry

    def _drop_oldest(self) -> tuple[str, _Entry]:
        assert self._backend is not None
        if self._fence is not None:
            self._backend.drain(self._fence)
        key, entry = self._entries.popitem(last=False)
        return _describe(key), entry

    def _invalidate(self, generation: int) -> None:
        dropped = len(self._entries)
        if dropped:
            assert self._backend is not None
            if self._fence is not None:
                self._backend.drain(self._fence)
            self._entries.clear()
            self.stats["invalidated"] += dropped
            LOGGER.debug(
                "%s: binding generation %s -> %d: dropped %d captures",
                self._name,
                self._generation,
                generation,
                dropped,
            )
        # The constants changed: the next run folds them again, uncaptured.
        self._warm.clear()
        self._generation = generation

    def _give_up(self, reason: str) -> None:
        if self._backend is not None and self._fence is not None:
            self._backend.drain(self._fence)
        self._entries.clear()
        self._warm.clear()
        self._backend = None
        self.reason = reason
        self.stats["fallbacks"] += 1
        LOGGER.debug("%s: CUDA graphs off, uncaptured runs from now on: %s", self._name, reason)


class _Entry:
    __slots__ = ("handle", "inputs", "outputs")

    def __init__(self, handle: object, inputs: list[Any], outputs: list[Any]) -> None:
        self.handle = handle
        self.inputs = inputs
        self.outputs = outputs


def _shape_set(tensors: list[Any]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


def _describe(key: tuple[Any, ...]) -> str:
    return "[" + ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, _, dtype, _ in key) + "]"


def _copy(value: Any) -> Any:
    """A copy of a static output in the layout the uncaptured run returns it in.

    ``clone()`` keeps the strides of a dense tensor only: a slice with gaps or an
    expanded (stride 0) output would come back compact, unlike the same call
    uncaptured. The memory the output spans from its first element is copied instead
    and viewed with the output's own sizes and strides (as the native path does)."""
    import torch

    if not isinstance(value, torch.Tensor):
        clone = getattr(value, "clone", None)
        return clone() if clone is not None else value
    if value.numel() == 0 or value.is_contiguous():
        return value.clone()
    span = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride(), strict=True))
    return value.as_strided((span,), (1,)).clone().as_strided(value.shape, value.stride())


def plan(
    stored: StoredCompiledGraph,
    device: Any,
    *,
    cuda_graphs: bool | None,
    max_captures: int | None,
    outputs: str,
    backend: CaptureBackend | None,
    environ: Mapping[str, str] = os.environ,
) -> tuple[CaptureBackend | None, int, str | None, bool]:
    """Decide how a graph loaded on ``device`` runs: ``(backend, max_captures, reason, fallback)``.

    An argument wins over its environment variable; an invalid value of either
    is refused (``run.option_invalid``). ``backend`` is ``None`` where calls are
    never captured, with ``reason``; ``fallback`` marks the reasons that are
    fallbacks from a capture that was wanted (custom ops)."""
    if outputs not in OUTPUT_MODES:
        raise BindingError(
            f"cuda_graph_outputs must be one of {list(OUTPUT_MODES)}, got {outputs!r}", "run.option_invalid"
        )
    count, off = capture_options(cuda_graphs, max_captures, environ)
    if off is not None:
        return None, count, off, False
    if backend is None and device.type != "cuda":
        return None, count, f"a {device.type} graph has no CUDA graphs", False
    if count == 0:
        return None, count, "max_captures is 0", False
    calls = stored.native_unsupported_calls
    if calls:
        names = sorted({str(c.get("call", c)) for c in calls})
        reason = f"the graph calls custom ops through torch's proxy executor ({', '.join(names)})"
        return None, count, reason, True
    return backend if backend is not None else CudaGraphBackend(device), count, None, False
