"""The sole compile policy and the AOTInductor compile of one graph class (SPEC-v1 §11).

One policy object, :data:`POLICY`, is defined here and nowhere else. It drives
the inductor options of every compile and the two metadata stamps
(``package_constants_in_so`` and ``constant_folding_fenced``). The public API
takes no compiler, packager, options, context or callback. Every option and
the reason for it is listed in ``docs/compile-policy.md``.

torch is imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _tuning
from ._attention import rewrite_to_flex
from .errors import AdmissionError, CompileError, DeclarationError
from .runtime import RuntimeCompatibility, clamp_options, impose_clamp
from .variant import DEFAULT_VARIANT, SHIM_V1, VARIANTS

if TYPE_CHECKING:
    from torch.export import ExportedProgram

LOGGER = logging.getLogger("torch_compiled_graphs")

__all__ = [
    "POLICY",
    "SHIM_V1_POLICY",
    "CompilePolicy",
    "compile_package",
    "literal_tensors",
    "policy_of",
]


@dataclass(frozen=True)
class CompilePolicy:
    """The compile policy: fixed inductor options plus the stamps derived from them.

    Instances are immutable; accessors return copies. Only :data:`POLICY` is
    used by the compiler.
    """

    #: Inductor options that shape generated code; they enter ``settings_declaration``.
    code_options: tuple[tuple[str, object], ...]
    #: Inductor options that are topology, not identity (compile threads).
    topology_options: tuple[tuple[str, object], ...]
    #: The policy's name in its settings declaration.
    policy_id: str = "tcg-compile-policy-v1"
    #: Further code options by device family (``cpu``, ``cuda``); they enter the declaration.
    device_options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    #: How attention is lowered: ``None`` (inductor's choice), ``"math"`` (decomposed into
    #: matmuls and a softmax, never the flash/efficient attention externs) or ``"flex"``
    #: (on CUDA, SDPA as flex attention, one fused Triton kernel, with the math
    #: decomposition for what flex attention cannot take; elsewhere ``"math"``); in the
    #: declaration.
    attention: str | None = None
    #: At which sizes the compile takes its size hints for a dynamic input dimension
    #: (what autotuning times its candidates at): ``None``, the export's example;
    #: ``"range-top/8x"``, the top of the dimension's declared range, at most eight times
    #: the example's size (the example's where the range is unbounded); or
    #: ``"range-ends/8x"``, that top, each template's candidate chosen for the least worst
    #: slowdown over the range's bottom (at least 2) and that top (probe compiles time
    #: them at both, see ``_tuning``); in the declaration.
    tuning: str | None = None

    def inductor_options(self, device: str = "cpu") -> dict[str, object]:
        """Every inductor option passed to a compile for ``device`` (``cpu``/``cuda``; a fresh copy)."""
        return {
            **dict(self.code_options),
            **dict(dict(self.device_options).get(device, ())),
            **dict(self.topology_options),
        }

    def settings_declaration(self) -> dict[str, object]:
        """The identity-relevant options, folded into the toolchain's ``settings_declaration``.

        The default policy's is ``{"policy", "inductor"}`` exactly as before variants
        existed (its keys are unchanged); a variant adds its per-device options and its
        attention lowering.
        """
        declaration: dict[str, object] = {"policy": self.policy_id, "inductor": dict(self.code_options)}
        if self.device_options:
            declaration["inductor_by_device"] = {d: dict(o) for d, o in self.device_options}
        if self.attention is not None:
            declaration["attention"] = self.attention
        if self.tuning is not None:
            declaration["tuning"] = self.tuning
        return declaration

    def attention_on(self, device: str) -> str | None:
        """The attention lowering of a compile for ``device`` (``cpu``/``cuda``)."""
        if self.attention == "flex" and device != "cuda":
            return "math"
        return self.attention

    @property
    def package_constants_in_so(self) -> bool:
        """The metadata stamp: whether the package embeds constants (always ``False``)."""
        return bool(dict(self.code_options)["aot_inductor.package_constants_in_so"])

    @property
    def constant_folding_fenced(self) -> bool:
        """The metadata stamp: no weight value can be folded or inlined into code."""
        options = dict(self.code_options)
        return (
            options["freezing"] is False
            and options["always_keep_tensor_constants"] is True
            and options["joint_graph_constant_folding"] is False
            and options["aot_inductor.package_constants_in_so"] is False
        )


#: The tuning rule of :attr:`CompilePolicy.tuning` that takes the top of each declared range.
TUNING_RANGE_TOP = "range-top/8x"
#: The tuning rule that compiles at the top of each declared range with, per template, the
#: candidate least slow at the worse of the range's two ends (``_tuning``).
TUNING_RANGE_ENDS = "range-ends/8x"
_TUNING_RULES = (TUNING_RANGE_TOP, TUNING_RANGE_ENDS)
#: How far above the example's size the tuning rules go.
_TUNING_REACH = 8
#: The smallest bottom a probe takes: a hint of 1 could let inductor specialise on it.
_TUNING_FLOOR = 2

#: The sole compile policy. See docs/compile-policy.md for the reason behind each option.
POLICY = CompilePolicy(
    code_options=(
        ("aot_inductor.package", True),
        ("aot_inductor.package_constants_in_so", False),
        ("aot_inductor.use_runtime_constant_folding", False),
        ("always_keep_tensor_constants", True),
        ("freezing", False),
        ("joint_graph_constant_folding", False),
    ),
    topology_options=(("compile_threads", 1),),
)

#: The libtorch-free variant (issue 34, docs/keys.md "Variants"): the default's code options
#: plus ``link_libtorch=False`` and kernel choices that keep the code inside the package
#: (Triton GEMM and convolution templates on CUDA; on the CPU one thread, so that no
#: OpenMP runtime is imported, and no weight prepacking), and attention as flex attention on
#: CUDA (decomposed on the CPU, and where flex attention cannot take a call). A mint of
#: this variant is refused unless the ``.so`` imports only shim set v1
#: (``compile.variant_refused``).
SHIM_V1_POLICY = CompilePolicy(
    code_options=(
        *POLICY.code_options,
        ("aot_inductor.link_libtorch", False),
        ("max_autotune", True),
    ),
    topology_options=POLICY.topology_options,
    policy_id="tcg-compile-policy-shim-v1",
    device_options=(
        (
            "cpu",
            (
                ("cpp.threads", 1),
                # torch 2.15's C++ GEMM template applies only to prepacked constant weights,
                # which it packs into a new, weight-derived constant at compile time: code-only
                # binding by fqn forbids that, so GEMMs stay aten externs and are refused.
                ("cpp.weight_prepack", False),
                ("max_autotune_conv_backends", "TRITON"),
                ("max_autotune_gemm_backends", "CPP"),
            ),
        ),
        (
            "cuda",
            (
                ("max_autotune_conv_backends", "TRITON"),
                ("max_autotune_gemm_backends", "TRITON"),
            ),
        ),
    ),
    attention="flex",
    tuning=TUNING_RANGE_ENDS,
)

for _policy in (POLICY, SHIM_V1_POLICY):
    if _policy.package_constants_in_so or not _policy.constant_folding_fenced:  # pragma: no cover
        raise ImportError("every compile policy must be code-only and constant-folding fenced")


def policy_of(variant: str) -> CompilePolicy:
    """The compile policy of ``variant`` (``"default"`` or ``"shim-v1"``).

    Anything else is ``DeclarationError`` ``declaration.variant_unknown``.
    """
    if variant == DEFAULT_VARIANT:
        return POLICY  # looked up now: tests replace the module's POLICY
    if variant == SHIM_V1:
        return SHIM_V1_POLICY
    raise DeclarationError(
        f"unknown graph variant {variant!r}; the variants are {', '.join(map(repr, VARIANTS))}",
        "declaration.variant_unknown",
    )


# --------------------------------------------------------------------------- inputs and context


def _program(value: object) -> ExportedProgram:
    """The ExportedProgram of ``value`` (a program or a ``GraphClassSpec``)."""
    from torch.export import ExportedProgram

    program = getattr(value, "program", value) if not isinstance(value, ExportedProgram) else value
    if not isinstance(program, ExportedProgram):
        raise CompileError(
            f"compile needs a torch.export.ExportedProgram, got {type(value).__module__}.{type(value).__qualname__}",
            "compile.program_invalid",
        )
    return program


def _compile_inputs(program: ExportedProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` rebuilt from the user-input placeholders' ``meta["val"]`` and the in-spec."""
    from torch.utils._pytree import tree_unflatten

    from .declaration import user_input_nodes

    values = []
    for node in user_input_nodes(program, CompileError, "compile.program_invalid"):
        if "val" not in node.meta:
            raise CompileError(
                f"user input placeholder {node.name!r} has no recorded value (meta['val'])",
                "compile.program_invalid",
            )
        values.append(node.meta["val"])
    in_spec = program.call_spec.in_spec
    if in_spec is None or in_spec.num_leaves != len(values):
        raise CompileError(
            f"program in-spec does not match its {len(values)} user inputs",
            "compile.program_invalid",
        )
    tree = tree_unflatten(values, in_spec)
    if not (isinstance(tree, tuple) and len(tree) == 2):
        raise CompileError("program in-spec is not (args, kwargs)", "compile.program_invalid")
    args, kwargs = tree
    return tuple(args), dict(kwargs)


def _row_major_inputs(mode: Any, module: Any) -> bool:
    """Make every tensor input of ``module`` (``program.module()``) row-major for the
    compile; returns whether any placeholder's value changed.

    Compiled code reads an input with the strides of the value its placeholder
    records (inductor compiles an exported module from its placeholders' values),
    and neither the key nor the call ingress names strides: a graph compiled from a
    channels-last example would read channels-last memory from every caller, and the
    native path passes C-contiguous arrays. So every input is compiled row-major (an
    example that already is keeps the same code). Strides are compared as
    expressions, never evaluated: no shape guard is added."""
    import torch

    changed = False
    with mode:
        for node in module.graph.nodes:
            value = node.meta.get("val") if node.op == "placeholder" else None
            if not isinstance(value, torch.Tensor):
                continue
            row = value.clone(memory_format=torch.contiguous_format)
            if [str(s) for s in row.stride()] != [str(s) for s in value.stride()]:
                node.meta["val"] = row
                changed = True
    return changed


def _compile_context(program: ExportedProgram) -> tuple[Any, Any]:
    """The unique ``(FakeTensorMode, ShapeEnv)`` of the graph's recorded values (§11 rule 5)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    modes: dict[int, Any] = {}
    envs: dict[int, Any] = {}

    def note_sym(value: Any) -> None:
        env = getattr(getattr(value, "node", None), "shape_env", None)
        if env is not None:
            envs[id(env)] = env

    for node in program.graph_module.graph.nodes:
        for key in ("val", "example_value"):
            if key not in node.meta:
                continue
            for leaf in tree_leaves(node.meta[key]):
                if isinstance(leaf, FakeTensor):
                    modes[id(leaf.fake_mode)] = leaf.fake_mode
                    if leaf.fake_mode.shape_env is not None:
                        envs[id(leaf.fake_mode.shape_env)] = leaf.fake_mode.shape_env
                    for dim in leaf.shape:
                        if isinstance(dim, torch.SymInt):
                            note_sym(dim)
                elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    note_sym(leaf)
    if len(modes) != 1:
        raise CompileError(f"compile context needs exactly one FakeTensorMode, found {len(modes)}", "compile.context")
    if len(envs) != 1:
        raise CompileError(f"compile context needs exactly one ShapeEnv, found {len(envs)}", "compile.context")
    return next(iter(modes.values())), next(iter(envs.values()))


def _backed_hints(env: Any) -> dict[Any, Any]:
    """The shape environment's hint of each backed symbol (``symbol -> sympy.Integer``): the
    dictionary itself, which inductor's size hints read (``backed_var_to_val``, named
    ``var_to_val`` before torch 2.15)."""
    hints = getattr(env, "backed_var_to_val", None)
    if not isinstance(hints, dict):
        hints = vars(env).get("var_to_val")
    if not isinstance(hints, dict):
        raise CompileError("the graph's shape environment has no hints of its symbols", "compile.context")
    return hints


def _dynamic_ranges(program: ExportedProgram, env: Any) -> Iterator[tuple[Any, int, Any, Any]]:
    """``(symbol, example, lower, upper)`` of each dynamic dimension with an integral hint."""
    if not program.range_constraints:
        return
    hints = _backed_hints(env)
    for symbol, bounds in program.range_constraints.items():
        example = hints.get(symbol)
        # sympy's Integer is an Integral; its infinities are not.
        if isinstance(example, numbers.Integral):
            yield symbol, int(example), getattr(bounds, "lower", None), getattr(bounds, "upper", None)


def _known_rule(rule: str | None) -> None:
    if rule is not None and rule not in _TUNING_RULES:
        raise CompileError(f"unknown tuning rule {rule!r}", "compile.program_invalid")


def tuning_hints(program: ExportedProgram, env: Any, rule: str | None) -> dict[Any, int]:
    """The size hints ``rule`` (:attr:`CompilePolicy.tuning`) compiles ``program`` at, for
    each dynamic dimension whose hint it moves: ``symbol -> size``.

    Under ``"range-top/8x"`` and ``"range-ends/8x"`` a dimension declared with a finite
    top is compiled at that top, but never more than eight times the example's size
    (autotuning times candidates at the hint, with inputs of that size), nor below the
    example's. An unbounded dimension keeps the example's size."""
    _known_rule(rule)
    if rule is None:
        return {}
    moved: dict[Any, int] = {}
    for symbol, example, _lower, top in _dynamic_ranges(program, env):
        if not isinstance(top, numbers.Integral):
            continue
        hint = max(example, min(int(top), _TUNING_REACH * example))
        if hint != example:
            moved[symbol] = hint
    return moved


def probe_hints(program: ExportedProgram, env: Any, rule: str | None) -> dict[Any, int] | None:
    """The size hints of the bottom's probe compile, which ``rule`` times candidates at
    before the compile (``"range-ends/8x"``; the top's probe takes :func:`tuning_hints`):
    each dynamic dimension at the bottom of its declared range, but at least 2 and at
    most the example's size (``symbol -> size`` for those it moves).
    ``None`` where there is no probe: another rule, or no dimension whose bottom differs
    from the size the compile takes (:func:`tuning_hints`)."""
    _known_rule(rule)
    if rule != TUNING_RANGE_ENDS:
        return None
    top = tuning_hints(program, env, rule)
    moved: dict[Any, int] = {}
    spread = False
    for symbol, example, lower, _upper in _dynamic_ranges(program, env):
        bottom = int(lower) if isinstance(lower, numbers.Integral) else _TUNING_FLOOR
        bottom = min(example, max(_TUNING_FLOOR, bottom))
        if bottom != example:
            moved[symbol] = bottom
        spread = spread or bottom != top.get(symbol, example)
    return moved if spread else None


@contextlib.contextmanager
def _hinted(env: Any, moved: Mapping[Any, int]) -> Iterator[None]:
    """The shape environment with ``moved``'s hints for the duration of a compile, as
    ``torch._dynamo.mark_dynamic(..., hint_override=)`` sets them (the backed hint itself,
    and the override record that inductor's cache key includes); restored after."""
    import sympy  # type: ignore[import-untyped]

    if not moved:
        yield
        return
    hints = _backed_hints(env)
    overrides = getattr(env, "var_to_hint_override", None)
    if not isinstance(overrides, dict):
        overrides = {}  # a torch without the record: nothing to keep it in
    saved, saved_overrides = {symbol: hints[symbol] for symbol in moved}, dict(overrides)
    try:
        for symbol, hint in moved.items():
            hints[symbol] = sympy.Integer(hint)
            overrides[symbol] = hint
        yield
    finally:
        hints.update(saved)
        overrides.clear()
        overrides.update(saved_overrides)


def _target_options(runtime: RuntimeCompatibility, requirement: Mapping[str, str]) -> dict[str, object]:
    """Options that follow the runtime and the clamp; they are host/target facts, not policy."""
    import torch._inductor.config as config

    options: dict[str, object] = {}
    if requirement["cpp_march"] != "native":
        options.update(clamp_options(config, requirement))
    if runtime.target != "cpu":
        # Exactly the target architecture: sm_90a compiles architecture-specific code.
        options["cuda.arch"] = runtime.target.removeprefix("sm_")
        options["aot_inductor.emit_multi_arch_kernel"] = False
    return options


# --------------------------------------------------------------------------- compile and package


def compile_package(
    spec_program: object,
    package_name: str,
    runtime: RuntimeCompatibility,
    workdir: str | os.PathLike[str],
    *,
    variant: str = DEFAULT_VARIANT,
) -> Path:
    """Compile ``spec_program`` under ``variant``'s policy into ``workdir/model.pt2``.

    ``spec_program`` is a ``torch.export.ExportedProgram`` or a
    ``GraphClassSpec``. The package is code-only and has exactly one entry,
    ``package_name`` (the graph class's display name). ``variant`` is
    ``"default"`` (:data:`POLICY`) or ``"shim-v1"`` (:data:`SHIM_V1_POLICY`;
    whether its imports fit shim set v1 is judged by the mint, not here, except that
    an op the variant's template backends have no kernel for is ``compile.variant_refused``
    here, naming the op). Failures raise ``CompileError`` with codes
    ``compile.program_invalid``, ``compile.host_policy``, ``compile.context``,
    ``compile.failed``, ``compile.variant_refused``, ``compile.result_invalid`` or
    ``compile.package_failed``.
    """
    policy = policy_of(variant)
    program = _program(spec_program)
    if not isinstance(package_name, str) or not package_name or package_name != package_name.strip():
        raise CompileError(
            f"package entry name must be a non-empty trimmed string, got {package_name!r}",
            "compile.package_failed",
        )
    if not isinstance(runtime, RuntimeCompatibility):
        raise CompileError(
            f"runtime must be a RuntimeCompatibility, got {type(runtime).__qualname__}",
            "compile.program_invalid",
        )
    requirement = impose_clamp(CompileError, "compile.host_policy")
    args, kwargs = _compile_inputs(program)
    mode, env = _compile_context(program)
    device = "cpu" if runtime.target == "cpu" else "cuda"
    options = {**policy.inductor_options(device), **_target_options(runtime, requirement)}

    import torch._inductor
    from torch._guards import TracingContext, tracing

    lowering = policy.attention_on(device)
    moved = tuning_hints(program, env, policy.tuning)
    probed = probe_hints(program, env, policy.tuning)
    if moved:
        LOGGER.debug("compile tuned at %s", {str(k): v for k, v in moved.items()})
    if probed is not None:
        LOGGER.debug("candidates probed at %s", {str(k): v for k, v in probed.items()} or "the example")
        # Both passes lower afresh: a cached graph would skip the probe's timing, and the
        # compile's cache key does not see the narrowing.
        options["fx_graph_cache"] = False

    def attention() -> contextlib.AbstractContextManager[Any]:
        """The attention backends of one compile attempt (a fresh context each: sdpa_kernel's
        is single-use)."""
        if lowering not in ("math", "flex"):
            return contextlib.nullcontext()
        # Re-traced under the math backend, scaled_dot_product_attention decomposes into
        # matmuls and a softmax instead of calling a flash/efficient attention extern
        # (under "flex", the calls flex attention cannot take).
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    _settle_vector_isa()
    previous_env = mode.shape_env
    try:
        mode.shape_env = env
        flex, row_major = lowering == "flex", True

        def prepared() -> tuple[Any, bool, int]:
            # A fresh module for each compile: a failed compile may have changed the last one.
            module = program.module(check_guards=False)
            changed = _row_major_inputs(mode, module) if row_major else False
            rewritten = rewrite_to_flex(module) if flex else 0
            return module, changed, rewritten

        def compile_at(module: Any, hints: Mapping[Any, int]) -> Any:
            with tracing(TracingContext(mode)), attention(), _hinted(env, hints):
                return torch._inductor.aot_compile(module, args, kwargs, options=options)

        while True:
            module, changed, rewritten = prepared()
            try:
                narrowing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
                if probed is not None:
                    tables = []
                    for hints in (probed, moved):  # the bottom, then the top
                        with _tuning.kept_env(env):
                            tables.append(_probe(compile_at, prepared()[0], hints))
                    narrowing = _tuning.narrowed(tables)
                with narrowing as tally:
                    files = compile_at(module, moved)
                if tally is not None:
                    LOGGER.debug(
                        "compile narrowed %d autotuning calls to the probes' least-regret candidates "
                        "(%d of %d candidates kept; worst slowdown at a range end %.3fx); %d calls kept all",
                        tally.narrowed,
                        tally.kept,
                        tally.offered,
                        tally.worst,
                        tally.whole,
                    )
                break
            except Exception as exc:
                if rewritten and not _no_kernel_outside_attention(exc):
                    # Flex attention failed to lower (a shape or mask its kernel does
                    # not take): the whole graph again with attention decomposed. Not
                    # when the failure names another op without a kernel: the
                    # decomposed compile would fail on it too (a refusal, below).
                    LOGGER.debug(
                        "compile with flex attention failed (%s: %s); compiling with attention decomposed",
                        type(exc).__name__,
                        exc,
                    )
                    flex = False
                elif changed:
                    # The row-major compile failed (an op inductor cannot lower for that
                    # layout; none is known): compiled for the example's layout, which
                    # load() then lays inputs out in (the native path refuses the graph,
                    # typed).
                    LOGGER.debug(
                        "compile with row-major inputs failed (%s: %s); compiling for the example's layout",
                        type(exc).__name__,
                        exc,
                    )
                    row_major = False
                else:
                    raise
    except CompileError:
        raise
    except Exception as exc:
        if variant != "default":
            from .variant import no_kernel_ops, refusal

            ops = no_kernel_ops(exc)
            if ops is not None:
                raise refusal(package_name, variant, ops) from exc
        raise CompileError(f"AOTInductor compile failed: {type(exc).__name__}: {exc}", "compile.failed") from exc
    finally:
        mode.shape_env = previous_env
    if not isinstance(files, list) or not files:
        raise CompileError(
            f"AOTInductor returned {type(files).__qualname__}, not a non-empty list of files",
            "compile.result_invalid",
        )
    for item in files:
        if isinstance(item, str) and not os.path.isfile(item):
            raise CompileError(f"AOTInductor result names a missing file: {item}", "compile.result_invalid")
    return _package(files, package_name, Path(workdir))


def _probe(compile_at: Any, module: Any, hints: Mapping[Any, int]) -> _tuning.ChoiceTable:
    """The candidates' timings of ``module`` compiled at ``hints``, up to the scheduler
    (``_tuning.probe``). A failure of the probe is the compile's own (raised)."""
    with _tuning.probe() as table:
        try:
            compile_at(module, hints)
        except Exception as exc:
            if not _tuning.is_probe_done(exc):
                raise
    LOGGER.debug("probe timed %d autotuning calls", len(table.timings))
    return table


def _no_kernel_outside_attention(exc: BaseException) -> bool:
    """Whether ``exc`` is inductor's ``NoValidChoicesError`` naming only ops other than
    flex attention: a compile with attention decomposed would meet the same ops."""
    from .variant import UNNAMED_NO_KERNEL_OP, no_kernel_ops

    ops = no_kernel_ops(exc)
    if not ops or UNNAMED_NO_KERNEL_OP in ops:
        return False
    return not any("flex_attention" in op for op in ops)


def _settle_vector_isa() -> None:
    """Run inductor's check of the host's vector ISAs under the default options.

    The check compiles a probe library into inductor's on-disk cache (keyed by the
    probe's code and ISA flags only) and loads it in a child; a machine remembers the
    result through that file. Run inside a ``link_libtorch=False`` compile (the
    ``shim-v1`` variant) it builds a probe that cannot load, so the check fails there,
    and every later compile on the machine, of any variant, finds the same file and
    emits scalar CPU code. Run here first, the check builds and records a loadable
    probe, and this process keeps its answer (inductor caches it per process).
    """
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()


def _package(files: list[Any], package_name: str, workdir: Path) -> Path:
    from torch._inductor.package.package import package_aoti

    target = workdir / "model.pt2"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        result = package_aoti(os.fspath(target), {package_name: files})
    except Exception as exc:
        raise CompileError(
            f"AOTInductor packaging failed: {type(exc).__name__}: {exc}", "compile.package_failed"
        ) from exc
    if not isinstance(result, (str, os.PathLike)) or Path(result) != target or not target.is_file():
        raise CompileError(f"AOTInductor packaging wrote {result!r}, expected {target}", "compile.package_failed")
    entries = _package_entries(target)
    if entries != [package_name]:
        raise CompileError(
            f"package must hold exactly one entry {package_name!r}, found {entries!r}",
            "compile.package_failed",
        )
    return target


def _package_entries(path: Path) -> list[str]:
    """The AOTInductor entry names in a ``.pt2`` zip (``<root>/data/aotinductor/<name>/…``)."""
    marker = "/data/aotinductor/"
    entries: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            _, found, rest = name.partition(marker)
            if found and "/" in rest:
                entries.add(rest.rsplit("/", 1)[0])
    return sorted(entries)


# --------------------------------------------------------------------------- literal payload


def literal_tensors(program: object, rows: Iterable[Mapping[str, Any] | tuple[str, str]]) -> dict[str, Any]:
    """The exported value of every literal row of the wrapper table, by fqn (SPEC-v1 §11 rule 8).

    ``rows`` are the package's literal constant rows: mappings with ``fqn``
    (and optionally ``name``) or ``(fqn, name)`` pairs. Each value is looked up
    in ``program.constants`` under its fqn, falling back to the row's name, and
    returned detached, on CPU and contiguous. A literal whose exported name the
    compiler erased (it shows up as a generated name such as
    ``_tensor_constant0``) is refused with ``admission.literal_unbound``.
    """
    import torch

    exported = _program(program)
    constants = exported.constants
    out: dict[str, Any] = {}
    for row in rows:
        if isinstance(row, Mapping):
            fqn, name = str(row["fqn"]), str(row.get("name") or row["fqn"])
        else:
            fqn, name = str(row[0]), str(row[1])
        value = constants.get(fqn)
        if value is None:
            value = constants.get(name)
        if not isinstance(value, torch.Tensor):
            if fqn in exported.state_dict:
                # Inductor records a parameter or buffer whose fqn starts with a digit
                # (the layers of a top-level nn.Sequential) with ConstantType::Unknown,
                # which SPEC-v1 §8.3 reads as a literal: it cannot be bound by name.
                raise AdmissionError(
                    f"the compiler recorded '{fqn}', a parameter or buffer of the program, as a literal "
                    "constant (AOTInductor does so for names that start with a digit, as the layers of a "
                    "top-level nn.Sequential have); export a module that holds it under a name, for "
                    "example self.layers = nn.Sequential(...)",
                    "admission.literal_unbound",
                )
            raise AdmissionError(
                f"declared literal constant '{fqn}' has no exported value; register durable tensors as buffers",
                "admission.literal_unbound",
            )
        try:
            out[fqn] = value.detach().cpu().contiguous()
        except Exception as exc:
            raise AdmissionError(
                f"literal constant '{fqn}' cannot be serialised: {type(exc).__name__}: {exc}",
                "admission.literal_serialize",
            ) from exc
    return out
