"""How a loaded graph holds the tensors it binds (docs/run.md, "Weights once").

A graph binds the caller's own tensors in place (torch's package loader with
``user_managed=True``: the container keeps a handle to the same storage, no copy)
whenever their layout is one the compiled code reads as is, and copies only the
others, saying which, how many bytes and why. What is bound in place stays the
caller's memory, so two things can make the graph disagree with the weights:

- an **out-of-place** change (a parameter reassigned, ``p.data = other``, a
  submodule replaced, ``module.to(...)`` that moves a tensor): the container still
  reads the old storage. Global registration hooks mark a bound module's graph
  stale when a bound parameter, buffer or submodule is reassigned, and every call
  compares the bound tensors' data pointers: the next call refuses with
  ``run.weights_stale`` until ``rebind``. Never silently old weights.
- an **in-place** change (``load_state_dict``, ``copy_``, a LoRA fused into a
  weights set): the graph reads the live memory, except where it does not read
  the tensor itself: a copy the binding made, or a constant the compiler folded
  from it (``_FOLDED_CONST_*``, computed once by the container). For those, each
  call compares the sources' version counters (bumped by every in-place op) and
  refreshes what they feed: the copy is rewritten in place, and the folds are
  recomputed (which moves the folded buffers, so ``binding_generation`` is bumped).
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .errors import BindingError

LOGGER = logging.getLogger("torch_compiled_graphs")

#: Bytes a bound tensor's address must be a multiple of. Triton kernels are compiled
#: assuming 16-byte aligned pointers (``tt.divisibility=16``), so a tensor at another
#: offset (a view into a larger buffer) is copied rather than read misaligned.
ALIGNMENT = 16


def copy_reason(tensor: Any) -> str | None:
    """Why ``tensor`` cannot be bound in place (``None`` when it can): the compiled
    code reads a constant as a dense, row-major, aligned block of its dtype."""
    import torch

    if tensor.layout != torch.strided:
        return f"layout {tensor.layout} (the graph reads strided memory)"
    if tensor.is_conj() or tensor.is_neg():
        return "a lazy conjugate or negative view"
    if not tensor.is_contiguous():
        return f"not contiguous (strides {list(tensor.stride())})"
    if tensor.data_ptr() % ALIGNMENT:
        return f"address not {ALIGNMENT}-byte aligned (a view at an odd offset)"
    return None


def bind_in_place(sources: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tensors to hand the container, by graph name: each source itself
    (detached: same storage) or a dense copy, and the report of the copies."""
    import torch

    bound: dict[str, Any] = {}
    copied: list[dict[str, Any]] = []
    for name, tensor in sources.items():
        reason = copy_reason(tensor)
        if reason is None:
            bound[name] = tensor.detach()
            continue
        if tensor.layout != torch.strided:
            dense = tensor.detach().to_dense()
        else:
            dense = tensor.detach().resolve_conj().resolve_neg()
        bound[name] = dense.clone(memory_format=torch.contiguous_format)
        copied.append({"name": name, "nbytes": tensor.numel() * tensor.element_size(), "reason": reason})
    return bound, copied


class SharedLock:
    """A readers-writer lock: calls on the graphs of a weights set hold it shared,
    a LoRA update holds it exclusive (no call runs with half-updated weights). Writers
    go first: a call that arrives while an update waits queues behind it. A call
    with no update pending takes one uncontended mutex (C-level ``with``)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False

    def acquire_shared(self) -> None:
        with self._mutex:
            while self._writer:
                self._cond.wait()
            self._readers += 1

    def release_shared(self) -> None:
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._writer:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._mutex:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._mutex:
                self._writer = False
                self._cond.notify_all()


# The per-call checks map C-level accessors over the bound tensors (about 0.1-0.2 us
# a tensor), not Python functions (three times that).
_version = operator.attrgetter("_version")


def _ptr(tensor: Any) -> int:
    return int(tensor.data_ptr())


class Binding:
    """What one loaded graph bound: per graph name the caller's tensor (the source)
    and what the container reads (the same storage or a copy)."""

    def __init__(
        self,
        sources: Mapping[str, Any],
        bound: Mapping[str, Any],
        copied: list[dict[str, Any]],
        *,
        borrowed: bool,
        folds: bool,
        lock: SharedLock | None,
        module: Any = None,
        module_names: Mapping[str, str] | None = None,
    ) -> None:
        self.sources = dict(sources)
        self.bound = dict(bound)
        self.copied = copied
        #: Calls hold it shared; a refresh (and a weights set's LoRA update) exclusive.
        self.lock = lock if lock is not None else SharedLock()
        self._stale: set[str] = set()
        self._names = list(self.sources)
        self._tensors = [self.sources[n] for n in self._names]
        # Pointers are compared only for memory the caller can move; a graph's own
        # allocation (a checkpoint read by the pipeline) cannot be.
        import torch

        self._data_ptr = torch.Tensor.data_ptr
        self._ptrs = list(map(self._data_ptr, self._tensors)) if borrowed else None
        copies = {row["name"] for row in copied}
        watched = self._names if folds else [n for n in self._names if n in copies]
        try:
            self._watched = [(n, self.sources[n]) for n in watched]
            self._watched_tensors = [t for _, t in self._watched]
            self._versions = list(map(_version, self._watched_tensors))
        except RuntimeError:
            # Inference-mode tensors have no version counter; their in-place
            # changes cannot be seen (docs/run.md).
            self._watched, self._watched_tensors, self._versions = [], [], []
        self._folds = folds
        self._keys: dict[tuple[int, str], tuple[Any, list[str]]] = {}
        #: Per bound name of a module: (owner, attribute, the tensor bound), for
        #: stale() to see an attribute that now holds another tensor however it got there.
        self._leaves: list[tuple[Any, str, Any, str]] = []
        if module is not None and module_names is not None:
            self._watch_module(module, module_names)

    def _watch_module(self, module: Any, module_names: Mapping[str, str]) -> None:
        """Register every (owner, attribute) on the path of each bound name with the
        registration hooks: reassigning any of them marks this binding stale."""
        for fqn, name in module_names.items():
            owner = module
            parts = name.split(".")
            for depth, attr in enumerate(parts):
                expected = getattr(owner, attr, None)
                if expected is None:
                    break
                key = (id(owner), attr)
                leaf = depth == len(parts) - 1
                ref: Any = self.sources[fqn] if leaf else weakref.ref(expected)
                if leaf:
                    self._leaves.append((weakref.ref(owner), attr, self.sources[fqn], fqn))
                try:
                    _REGISTRY.setdefault(owner, {}).setdefault(attr, weakref.WeakSet()).add(self)
                except TypeError:
                    # A module class that is not hashable (it defines __eq__ alone) cannot
                    # be watched by the hooks; the per-call pointer check still applies.
                    pass
                else:
                    self._keys.setdefault(key, (ref, []))[1].append(fqn)
                owner = expected
        _install_hooks()

    def _on_assign(self, owner: Any, attr: str, value: Any) -> None:
        entry = self._keys.get((id(owner), attr))
        if entry is None:
            return
        expected, fqns = entry
        current = expected() if isinstance(expected, weakref.ref) else expected
        if value is not current:
            self._stale.update(fqns)

    def stale(self) -> list[str]:
        """Names whose source moved: marked by a hook, or another data pointer."""
        out = set(self._stale)
        for owner_ref, attr, tensor, fqn in self._leaves:
            owner = owner_ref()
            if owner is None or getattr(owner, attr, None) is not tensor:
                out.add(fqn)
        if self._ptrs is not None:
            for name, tensor, ptr in zip(self._names, self._tensors, self._ptrs, strict=True):
                if _ptr(tensor) != ptr:
                    out.add(name)
        return sorted(out)

    def check(self) -> bool:
        """Before a call (lock held shared): refuse a stale binding; whether a source
        of a copy or a fold changed in place since (then :meth:`refresh`)."""
        if self._stale or (self._ptrs is not None and list(map(self._data_ptr, self._tensors)) != self._ptrs):
            names = self.stale()
            raise BindingError(
                f"the weights bound to this graph changed out of place ({', '.join(names[:5])}"
                f"{', …' if len(names) > 5 else ''}): the graph still reads the old tensors; "
                "call graph.rebind(module) (or rebind the state_dict / weights set)",
                "run.weights_stale",
            )
        return bool(self._watched) and list(map(_version, self._watched_tensors)) != self._versions

    def refresh(self) -> bool:
        """With the lock held exclusive: rewrite the copies whose sources changed, in
        place; whether the folds must be recomputed (the caller reloads the container)."""
        import torch

        versions = list(map(_version, self._watched_tensors))
        if versions == self._versions:
            return False
        copies = {row["name"] for row in self.copied}
        changed = [n for (n, _), a, b in zip(self._watched, versions, self._versions, strict=True) if a != b]
        with torch.no_grad():
            for name in changed:
                if name in copies:
                    source = self.sources[name].detach()
                    dense = source.to_dense() if source.layout != torch.strided else source.resolve_conj().resolve_neg()
                    self.bound[name].copy_(dense)
        self._versions = versions
        return self._folds


_REGISTRY: weakref.WeakKeyDictionary[Any, dict[str, weakref.WeakSet[Binding]]] = weakref.WeakKeyDictionary()
_HOOKS: list[Any] = []
_HOOKS_LOCK = threading.Lock()


def _on_registration(module: Any, name: str, value: Any) -> None:
    # Runs on every registration in the process (model construction included): it
    # must never fail for a module it does not watch.
    try:
        entry = _REGISTRY.get(module)
    except TypeError:
        return
    if entry:
        for binding in list(entry.get(name, ())):
            binding._on_assign(module, name, value)


def _install_hooks() -> None:
    """One set of global registration hooks per process, installed by the first
    module binding: a dict lookup per registration anywhere, nothing else."""
    with _HOOKS_LOCK:
        if _HOOKS:
            return
        from torch.nn.modules import module as nn_module

        _HOOKS.extend(
            [
                nn_module.register_module_parameter_registration_hook(_on_registration),
                nn_module.register_module_buffer_registration_hook(_on_registration),
                nn_module.register_module_module_registration_hook(_on_registration),
            ]
        )


def log_copies(what: str, copied: list[dict[str, Any]]) -> None:
    if copied and LOGGER.isEnabledFor(logging.DEBUG):
        total = sum(int(row["nbytes"]) for row in copied)
        LOGGER.debug(
            "%s: %d constants copied (%d bytes): %s",
            what,
            len(copied),
            total,
            "; ".join(f"{row['name']} ({row['reason']})" for row in copied),
        )
