"""Ask Triton's GPU compiler about a kernel, on any machine, GPU or not.

``triton.compile`` can build a kernel for a named NVIDIA architecture without a GPU: the
front end, the MLIR passes, LLVM and ``ptxas`` all ship with Triton. That answers questions
the CPU interpreter cannot, because the interpreter runs every ``tl.dot`` in NumPy and
accepts any shape, while the GPU compiler refuses some:

* does this kernel compile for sm_80 / sm_90 with these block sizes, and if not, what
  does the compiler say?  (:func:`compile_for_target`, :func:`compile_launch`)
* which ``tl.dot`` shapes does the installed Triton accept?  The limits changed between
  Triton versions, so we ask instead of hard-coding them.  (:func:`dot_shape_accepted`,
  :func:`dot_shape_table`)
* does the compiled code use tensor cores, and does its shared memory fit one block?
  (:meth:`CompileResult.uses_tensor_cores`, :meth:`CompileResult.fits_shared_memory`)

Works with a real ``JITFunction`` (GPU mode) and under ``TRITON_INTERPRET=1``, where
``@triton.jit`` yields an ``InterpretedFunction`` (see "under the interpreter" below). In CPU
mode it may be imported at any time: it puts back what the interpreter leaves rebound in
``triton.language`` for the length of each compilation.
Tested with triton 3.9 (CPU); written for triton 3.6 (the GPU machine) too.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import types
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.errors import TritonError
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import _device  # noqa: F401  (sets TRITON_INTERPRET before the probe kernel below is decorated)

#: PTX opcodes that run on tensor cores: ``mma.sync`` (Volta to Hopper, warp-level tiles such
#: as m16n8k16) and ``wgmma.mma_async`` (Hopper, warp-group tiles m64nNk16).
TENSOR_CORE_OPCODES = ("mma.sync", "wgmma.mma_async")


@dataclass(frozen=True)
class TargetFacts:
    """What one NVIDIA architecture offers a kernel; figures from the CUDA programming guide."""

    name: str
    capability: int
    #: the most shared memory one block may use (opt-in maximum, bytes); Triton refuses to
    #: launch a kernel whose ``shared`` metadata exceeds it.
    max_shared_bytes_per_block: int
    #: the tensor-core opcodes the compiler can emit for this architecture.
    tensor_core_opcodes: tuple[str, ...]

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


TARGETS = {
    facts.name: facts
    for facts in (
        TargetFacts("sm_80", 80, 163 * 1024, ("mma.sync",)),                     # A100
        TargetFacts("sm_86", 86, 99 * 1024, ("mma.sync",)),                      # RTX 30xx, A10
        TargetFacts("sm_89", 89, 99 * 1024, ("mma.sync",)),                      # RTX 40xx, L4, L40
        TargetFacts("sm_90", 90, 227 * 1024, ("mma.sync", "wgmma.mma_async")),   # H100, H200
    )
}

_TARGETS_BY_CAPABILITY = {facts.capability: facts for facts in TARGETS.values()}


def target_facts(target="sm_90") -> TargetFacts:
    """The :class:`TargetFacts` for ``"sm_80"``, ``"sm_90"``, ... or a CUDA ``GPUTarget``."""
    if isinstance(target, GPUTarget):
        if target.backend != "cuda" or target.arch not in _TARGETS_BY_CAPABILITY:
            raise ValueError(f"no facts for {target}; known CUDA capabilities: "
                             f"{sorted(_TARGETS_BY_CAPABILITY)}")
        return _TARGETS_BY_CAPABILITY[target.arch]
    if not isinstance(target, str):
        raise TypeError(f"target must be a name such as 'sm_90' or a triton GPUTarget, "
                        f"got {type(target).__name__}")
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {tuple(TARGETS)}")
    return TARGETS[target]


# --------------------------------------------------------------------------- reading PTX

_PTX_PREDICATE = re.compile(r"^@!?%\w+\s+")  # a guard such as "@%p1 " before the opcode


def tensor_core_lines(ptx: str) -> list[str]:
    """The PTX lines whose instruction is a tensor-core opcode (:data:`TENSOR_CORE_OPCODES`)."""
    if not isinstance(ptx, str):
        raise TypeError(f"ptx must be a string, got {type(ptx).__name__}")
    lines = []
    for line in ptx.splitlines():
        instruction = _PTX_PREDICATE.sub("", line.strip())
        if instruction.startswith(TENSOR_CORE_OPCODES):
            lines.append(line.strip())
    return lines


def uses_tensor_cores(ptx: str) -> bool:
    """True when the PTX contains at least one tensor-core instruction."""
    return bool(tensor_core_lines(ptx))


def tensor_core_instructions(ptx: str) -> list[str]:
    """The distinct tensor-core opcodes with their shape and types, without the registers,
    e.g. ``['mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32']``."""
    opcodes = {_PTX_PREDICATE.sub("", line).split()[0] for line in tensor_core_lines(ptx)}
    return sorted(opcodes)


# --------------------------------------------------------------------------- compiling

@dataclass(frozen=True)
class CompileResult:
    """The outcome of compiling one kernel for one target. Refusals are results, not errors."""

    kernel_name: str
    target: str
    ok: bool
    num_warps: int
    num_stages: int
    #: when refused: the compiler's own words (the first meaningful lines), e.g.
    #: ``"Input shapes should have M >= 1, N >= 1 and K >= 16"``.
    message: str | None = None
    #: when refused: the whole error text, with the kernel source and a caret when Triton gives them.
    full_message: str | None = None
    #: when refused: the exception class, e.g. ``"CompilationError"``.
    error_type: str | None = None
    ptx: str | None = None
    #: every stage Triton kept (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ``"cubin"``), when compiled.
    asm: dict | None = None
    #: shared memory one block needs, in bytes (Triton's ``metadata.shared``).
    shared_bytes: int | None = None

    @property
    def facts(self) -> TargetFacts:
        return TARGETS[self.target]

    def _require_compiled(self, what: str):
        if not self.ok:
            raise ValueError(f"{self.kernel_name} was refused for {self.target}, so it has no {what}: "
                             f"{self.message}")

    def fits_shared_memory(self) -> bool:
        """True when ``shared_bytes`` is within the target's per-block limit."""
        self._require_compiled("shared-memory figure")
        return self.shared_bytes <= self.facts.max_shared_bytes_per_block

    def uses_tensor_cores(self) -> bool:
        self._require_compiled("PTX")
        return uses_tensor_cores(self.ptx)

    def tensor_core_instructions(self) -> list[str]:
        self._require_compiled("PTX")
        return tensor_core_instructions(self.ptx)

    def summary(self) -> str:
        """One line for reports and assertion messages."""
        where = f"{self.kernel_name} for {self.target} (num_warps={self.num_warps}, num_stages={self.num_stages})"
        if not self.ok:
            return f"{where}: refused ({self.error_type}): {self.message}"
        opcodes = ", ".join(self.tensor_core_instructions()) or "none"
        return (f"{where}: compiled; shared memory {self.shared_bytes} of "
                f"{self.facts.max_shared_bytes_per_block} bytes; tensor-core instructions: {opcodes}")


# --------------------------------------------------------------------------- under the interpreter
#
# With TRITON_INTERPRET=1 every @triton.jit function is an InterpretedFunction: the user's
# kernels and helpers, and also triton.language's own functions written in Triton (tl.zeros,
# tl.sum, tl.cdiv, ...). The GPU compiler only calls JITFunctions, so for the length of one
# compilation each InterpretedFunction it can reach (in the kernel's globals, its helpers'
# globals and triton.language) is replaced by a JITFunction of the same Python function.
#
# The interpreter also rebinds parts of triton.language (tl.core.mul, tensor.__bool__, ...)
# while it runs. A launch restores what it rebound, but a @triton.jit helper called from an
# interpreted kernel rebinds the triton.language module its own globals name (tl.sum's is
# triton.language.core) and never restores it (seen with triton 3.9): that breaks any later
# compilation. So for the same length of time triton.language is put back as it was before any
# kernel ran. Imported before any kernel ran, this module keeps a copy; imported later, it
# rebuilds that copy: each rebinding of a builtin keeps the original as its ``member`` default,
# and the other names it rebinds (range, static_assert, multiple_of, ...) are re-exported by
# ``triton.language`` itself, whose own rebindings the launch did restore.

_MISSING = object()


def _language_objects() -> list:
    """triton.language's modules and the classes they define: everything the interpreter rebinds."""
    objects = []
    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            objects.append(module)
            objects.extend(value for value in vars(module).values()
                           if isinstance(value, type) and value.__module__ == name)
    return objects


def _is_interpreter_rebinding(value) -> bool:
    if isinstance(value, functools.partial):  # tl.multiple_of and its kind
        value = value.func
    return isinstance(value, types.FunctionType) and value.__module__ == InterpretedFunction.__module__


def _defined_in_language(value) -> bool:
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and (module == "triton.language" or module.startswith("triton.language."))


def _pristine_language() -> tuple[list, list[str]]:
    """triton.language's modules and classes with their names as before any interpreted kernel ran,
    and the names whose original could not be found (then no compilation is possible)."""
    snapshot = [(obj, dict(vars(obj))) for obj in _language_objects()]
    module_names = [names for obj, names in snapshot if isinstance(obj, types.ModuleType)]
    lost = []
    for obj, names in snapshot:
        for name, value in names.items():
            # tl.static_print becomes the builtin print; the other rebindings are the interpreter's functions.
            is_print = value is print and isinstance(obj, types.ModuleType)
            copied = vars(sys.modules[InterpretedFunction.__module__]).get(name) is value
            if copied or not (_is_interpreter_rebinding(value) or is_print):
                continue  # the interpreter also copies its own globals into a helper's; they do no harm
            original = (getattr(value, "__kwdefaults__", None) or {}).get("member")
            if original is None:
                original = next((other[name] for other in module_names
                                 if _defined_in_language(other.get(name))), None)
            if original is not None:
                names[name] = original
            elif not is_print:
                lost.append(f"{getattr(obj, '__name__', obj)}.{name}")
    return snapshot, lost


_PRISTINE_LANGUAGE, _LOST_LANGUAGE_NAMES = _pristine_language()


def _set_attr(obj, name, value):
    if value is _MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, value)


def _set_item(mapping, name, value):
    if value is _MISSING:
        del mapping[name]
    else:
        mapping[name] = value


class _TemporaryEdits:
    """Changes to modules, classes and globals dicts, undone in reverse order."""

    def __init__(self):
        self._undo = []

    def set_attr(self, obj, name, value):
        """Set, or with _MISSING delete, an attribute of a module or a class."""
        self._undo.append((_set_attr, obj, name, vars(obj).get(name, _MISSING)))
        _set_attr(obj, name, value)

    def set_item(self, mapping, name, value):
        self._undo.append((_set_item, mapping, name, mapping.get(name, _MISSING)))
        _set_item(mapping, name, value)

    def undo(self):
        while self._undo:
            setter, target, name, old = self._undo.pop()
            setter(target, name, old)


def _restore_pristine_language(edits: _TemporaryEdits):
    if _LOST_LANGUAGE_NAMES:
        raise RuntimeError(
            "the Triton interpreter had rebound triton.language when ttx_tutorial.course.compiler "
            f"was imported, and the originals of {', '.join(_LOST_LANGUAGE_NAMES)} could not be "
            "found, so it cannot compile kernels in this process. Import "
            "ttx_tutorial.course.compiler before running any interpreted kernel.")
    for obj, pristine in _PRISTINE_LANGUAGE:
        current = dict(vars(obj))
        for name, value in pristine.items():
            if current.get(name, _MISSING) is not value:
                edits.set_attr(obj, name, value)
        if isinstance(obj, type):  # names the interpreter added to a class; modules may gain submodules
            for name in current.keys() - pristine.keys():
                edits.set_attr(obj, name, _MISSING)


_JIT_TWINS: dict = {}


def _jit_twin(interpreted: InterpretedFunction) -> JITFunction:
    """A JITFunction of the same Python function, with the options @triton.jit was given."""
    if interpreted not in _JIT_TWINS:
        _JIT_TWINS[interpreted] = JITFunction(interpreted.fn, **interpreted.kwargs)
    return _JIT_TWINS[interpreted]


def _replace_interpreted_functions(kernel: InterpretedFunction, edits: _TemporaryEdits):
    pending = [kernel.fn.__globals__]
    pending += [vars(obj) for obj, _ in _PRISTINE_LANGUAGE if isinstance(obj, types.ModuleType)]
    seen = set()
    while pending:
        namespace = pending.pop()
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for name, value in list(namespace.items()):
            if isinstance(value, InterpretedFunction):
                edits.set_item(namespace, name, _jit_twin(value))
                pending.append(value.fn.__globals__)


@contextlib.contextmanager
def _compilable(kernel):
    """Yield a JITFunction for ``kernel`` that the GPU compiler can lower, in either mode."""
    if isinstance(kernel, JITFunction):
        yield kernel
        return
    if not isinstance(kernel, InterpretedFunction):
        raise TypeError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")
    edits = _TemporaryEdits()
    try:
        _restore_pristine_language(edits)
        _replace_interpreted_functions(kernel, edits)
        yield _jit_twin(kernel)
    finally:
        edits.undo()


# Exceptions through which Triton says no: CompilationError (the front end; it wraps whatever a
# tl.* function raised, such as tl.dot's shape assertion), RuntimeError (a failed MLIR pass),
# PTXASError, and the ValueError and AssertionError of some option checks. Others propagate.
_REFUSALS = (TritonError, RuntimeError, ValueError, AssertionError)

_SCALAR_TYPES = frozenset({
    "i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64",
    "fp8e4nv", "fp8e5", "fp8e4b15", "fp16", "bf16", "fp32", "fp64",
})
_MESSAGE_LINES = 4


def _is_valid_type(type_name) -> bool:
    if not isinstance(type_name, str):
        return False
    if type_name == "constexpr":
        return True
    return type_name.removeprefix("*") in _SCALAR_TYPES


def _check_signature(jit_fn: JITFunction, signature, constexprs):
    if not isinstance(signature, dict):
        raise TypeError(f"signature must be a dict {{argument: type}}, got {type(signature).__name__}")
    if constexprs is not None and not isinstance(constexprs, dict):
        raise TypeError(f"constexprs must be a dict {{NAME: value}} or None, got {type(constexprs).__name__}")
    constexprs = constexprs or {}
    arguments = list(jit_fn.arg_names)
    missing = [a for a in arguments if a not in signature]
    unknown = [a for a in signature if a not in arguments]
    if missing or unknown:
        raise ValueError(f"signature of {jit_fn.__name__} must name exactly its arguments {arguments}; "
                         f"missing {missing}, unknown {unknown}")
    bad_types = {a: t for a, t in signature.items() if not _is_valid_type(t)}
    if bad_types:
        raise ValueError(f"unknown types {bad_types}: use 'constexpr', a scalar type such as 'i32' or "
                         f"'fp32', or a pointer such as '*bf16'")
    for param in jit_fn.params:
        if param.is_constexpr and signature[param.name] != "constexpr":
            raise ValueError(f"{param.name} is annotated tl.constexpr, so its signature entry must be "
                             f"'constexpr', not {signature[param.name]!r}")
    without_value = [a for a, t in signature.items() if t == "constexpr" and a not in constexprs]
    if without_value:
        raise ValueError(f"constexpr arguments need a value in constexprs: {without_value}")
    not_constexpr = [a for a in constexprs if signature.get(a) != "constexpr"]
    if not_constexpr:
        raise ValueError(f"constexprs {not_constexpr} must be marked 'constexpr' in the signature")


def _check_launch_options(num_warps, num_stages):
    if isinstance(num_warps, bool) or not isinstance(num_warps, int):
        raise TypeError(f"num_warps must be an int, got {type(num_warps).__name__}")
    if num_warps < 1 or num_warps > 32 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be an int, got {type(num_stages).__name__}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")


def _innermost(error: BaseException) -> BaseException:
    """Triton wraps the real complaint (e.g. tl.dot's AssertionError) in CompilationErrors,
    once per @triton.jit call level; the innermost cause holds the compiler's own words."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _refusal_message(error: BaseException) -> str:
    cause = _innermost(error)
    text = getattr(cause, "error_message", None) or str(cause) or type(cause).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "\n".join(lines[:_MESSAGE_LINES])


def compile_for_target(kernel, signature, constexprs=None, *, target="sm_90", num_warps=4,
                       num_stages=3) -> CompileResult:
    """Compile ``kernel`` for an NVIDIA architecture, with or without a GPU present.

    Args:
        kernel: a ``@triton.jit`` function (JITFunction, or InterpretedFunction in CPU mode).
        signature: ``{argument: type}`` for every argument, e.g. ``{"x_ptr": "*fp32",
            "n": "i32", "BLOCK": "constexpr"}``.
        constexprs: ``{NAME: value}`` for each ``"constexpr"`` argument.
        target: ``"sm_80"``, ``"sm_86"``, ``"sm_89"``, ``"sm_90"`` or a CUDA ``GPUTarget``.
        num_warps, num_stages: the launch options the kernel would be compiled with.

    Returns a :class:`CompileResult`; a refusal by the compiler is reported in it, not raised.
    Mistakes in the arguments (unknown target, a signature that does not match the kernel)
    raise ``TypeError`` or ``ValueError``. Triton caches compilations on disk
    (``TRITON_CACHE_DIR``), so asking again is cheap.
    """
    facts = target_facts(target)
    _check_launch_options(num_warps, num_stages)
    with _compilable(kernel) as jit_fn:
        _check_signature(jit_fn, signature, constexprs)
        source = ASTSource(jit_fn, signature=dict(signature), constexprs=dict(constexprs or {}))
        return _compiled(source, facts, {"num_warps": num_warps, "num_stages": num_stages}, jit_fn.__name__)


def _compiled(source, facts: TargetFacts, options: dict, kernel_name: str) -> CompileResult:
    """``triton.compile`` of ``source`` for ``facts``' GPU; a refusal is reported in the result."""
    common = dict(kernel_name=kernel_name, target=facts.name, num_warps=options["num_warps"],
                  num_stages=options["num_stages"])
    try:
        compiled = triton.compile(source, target=facts.gpu_target, options=options)
    except _REFUSALS as error:
        return CompileResult(ok=False, message=_refusal_message(error), full_message=str(error),
                             error_type=type(error).__name__, **common)
    return CompileResult(ok=True, ptx=compiled.asm["ptx"], asm=dict(compiled.asm),
                         shared_bytes=int(compiled.metadata.shared), **common)


@dataclass(frozen=True)
class LaunchBinding:
    """How Triton's launcher binds one launch's arguments for a target: what decides its binary."""

    kernel_name: str
    target: str
    #: ``{argument: type}``; an integer argument equal to 1 is specialised to ``"constexpr"``.
    signature: dict
    #: ``{argument: value}`` of the declared constexprs and of the specialised integers.
    constexprs: dict
    #: the pointer and integer arguments marked divisible by 16 (vectorised loads need them).
    aligned: tuple
    #: the integer arguments the launcher turned into constants (they were equal to 1).
    specialised: tuple
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        """Equal for two launches exactly when they compile to the same binary."""
        return repr((self.kernel_name, self.target, sorted(self.signature.items()),
                     sorted(self.constexprs.items()), self.aligned, self.num_warps, self.num_stages))


def _launch_binding(jit_fn: JITFunction, facts: TargetFacts, args, kwargs):
    """(binding, ASTSource, options) of ``jit_fn[grid](*args, **kwargs)`` on ``facts``' GPU, from
    Triton's own launcher, exactly as in a launch on such a GPU."""
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as error:  # the launcher's internals move between Triton versions
        raise RuntimeError(f"binding a launch needs Triton's launcher internals (tested with triton 3.9); "
                           f"triton {triton.__version__} lacks them: {error}") from error
    backend = make_backend(facts.gpu_target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization, options)
    names = list(signature)
    declared = {param.name for param in jit_fn.params if param.is_constexpr}
    binding = LaunchBinding(
        kernel_name=jit_fn.__name__, target=facts.name, signature=dict(signature),
        constexprs={names[path[0]]: value for path, value in constexprs.items()},
        aligned=tuple(names[path[0]] for path, hints in attrs.items() if ["tt.divisibility", 16] in hints),
        specialised=tuple(name for name, kind in signature.items() if kind == "constexpr" and name not in declared),
        num_warps=options.num_warps, num_stages=options.num_stages)
    return binding, ASTSource(jit_fn, signature, constexprs, attrs), options


def bind_launch(kernel, *args, target="sm_90", **kwargs) -> LaunchBinding:
    """How the launch ``kernel[grid](*args, **kwargs)`` is bound for ``target`` (nothing compiled)."""
    facts = target_facts(target)
    with _compilable(kernel) as jit_fn:
        return _launch_binding(jit_fn, facts, args, kwargs)[0]


def compile_launch(kernel, *args, target="sm_90", **kwargs) -> CompileResult:
    """Compile ``kernel`` as the launch ``kernel[grid](*args, **kwargs)`` would build it on
    ``target``: the real arguments (tensors, integers, constexprs, ``num_warps``, ``num_stages``)
    are bound by Triton's launcher, so the argument types, the integers specialised to constants
    and the alignment hints are those of a GPU run. Tensors may live on the CPU; nothing runs."""
    facts = target_facts(target)
    with _compilable(kernel) as jit_fn:
        _, source, options = _launch_binding(jit_fn, facts, args, kwargs)
        return _compiled(source, facts, options.__dict__, jit_fn.__name__)


# --------------------------------------------------------------------------- tl.dot shapes

#: The operand dtypes the tutorial's kernels feed to tl.dot.
DOT_DTYPES = ("fp32", "fp16", "bf16")
_TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@triton.jit
def _dot_probe_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr):
    # One [M, K] x [K, N] product and nothing else, so a refusal can only come from tl.dot.
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, K)
    offs_n = tl.arange(0, N)
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :])
    c = tl.dot(a, b, input_precision=INPUT_PRECISION)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], c)


def _dot_dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_TRITON:
            raise ValueError(f"dtype must be one of {list(_TORCH_TO_TRITON)}, got {dtype}")
        return _TORCH_TO_TRITON[dtype]
    if dtype not in DOT_DTYPES:
        raise ValueError(f"dtype must be one of {DOT_DTYPES} (or the torch dtypes), got {dtype!r}")
    return dtype


def _check_block_size(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two (Triton block shapes are), got {value}")


def dot_shape_accepted(M, K, N, dtype="fp32", *, target="sm_90", input_precision=None,
                       num_warps=4) -> CompileResult:
    """Compile a kernel made of one ``tl.dot`` of an [M, K] by a [K, N] block of ``dtype``
    (``"fp32"``, ``"fp16"``, ``"bf16"`` or a torch dtype) and report what the compiler says.
    ``input_precision``: ``None`` (Triton's default, ``"tf32"`` for fp32 on NVIDIA), ``"tf32"``,
    ``"tf32x3"`` or ``"ieee"``; it only affects fp32 operands."""
    for name, value in (("M", M), ("K", K), ("N", N)):
        _check_block_size(name, value)
    dtype_name = _dot_dtype_name(dtype)
    pointer = "*" + dtype_name
    signature = {"a_ptr": pointer, "b_ptr": pointer, "c_ptr": "*fp32", "M": "constexpr", "K": "constexpr",
                 "N": "constexpr", "INPUT_PRECISION": "constexpr"}
    constexprs = {"M": M, "K": K, "N": N, "INPUT_PRECISION": input_precision}
    return compile_for_target(_dot_probe_kernel, signature, constexprs, target=target, num_warps=num_warps)


def dot_shape_table(shapes, dtypes=DOT_DTYPES, *, target="sm_90") -> dict:
    """``{(M, K, N): {dtype: CompileResult}}`` for every shape and dtype, asked of the compiler."""
    shapes = [tuple(shape) for shape in shapes]
    if any(len(shape) != 3 for shape in shapes):
        raise ValueError(f"each shape must be (M, K, N), got {shapes}")
    dtype_names = [_dot_dtype_name(dtype) for dtype in dtypes]
    return {shape: {name: dot_shape_accepted(*shape, name, target=target) for name in dtype_names}
            for shape in shapes}


def format_dot_shape_table(table: dict) -> str:
    """A text table of :func:`dot_shape_table`'s answer: one row per shape, "yes"/"no" per dtype."""
    if not table:
        return "(no shapes)"
    dtype_names = list(next(iter(table.values())))
    header = ["(M, K, N)"] + dtype_names
    rows = [[str(shape)] + ["yes" if results[name].ok else "no" for name in dtype_names]
            for shape, results in table.items()]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [header] + rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
