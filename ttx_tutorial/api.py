"""``causal_product``: one entry point for every implementation of the causal dot product."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _device, ops, references
from ._validation import KERNEL_DTYPES, KERNEL_INDEX_LIMIT, REFERENCE_DTYPES, check_inputs
from .kernels import chunked, recurrent, scan


@dataclass(frozen=True)
class Method:
    """One implementation: the function that runs it and what it accepts."""

    name: str
    # (q, k, v, initial_state) -> (o, final_state), and cu_seqlens= for packed sequences. For the
    # Triton methods, the kernel file's entry point for inputs this module has checked (the file's
    # public function would check them again), which also takes normalized= (``_checked_product``).
    function: Callable
    is_triton: bool
    summary: str

    @property
    def dtypes(self):
        return KERNEL_DTYPES if self.is_triton else REFERENCE_DTYPES

    @property
    def max_head_dim(self):
        return MAX_HEAD_DIM if self.is_triton else None


#: The largest head dimension (D and E) the Triton kernels support.
MAX_HEAD_DIM = 256

_METHOD_LIST = (
    Method("loop", references.loop, False,
           "PyTorch: the recurrence literally, one token per Python step"),
    Method("cumsum", references.cumsum, False,
           "PyTorch: every state S_t materialised by torch.cumsum, O(T*D*E) memory"),
    Method("quadratic", references.quadratic, False,
           "PyTorch: the masked form ((Q K^T) * M) V, O(T^2)"),
    Method("recurrent", recurrent._run_validated, True,
           "Triton: one program per (batch, head, value block) walks T with its state in registers"),
    Method("chunked", chunked._run_validated, True,
           "Triton: chunks of C tokens on tensor-core tiles, the state carried from chunk to chunk"),
    Method("scan", scan._run_validated, True,
           "Triton: per-segment states combined by a parallel prefix sum, then every segment at once"),
)

_REGISTRY = {m.name: m for m in _METHOD_LIST}

#: Every method name ``causal_product`` accepts.
METHODS = tuple(_REGISTRY)


#: ``causal_product``'s default: picks "chunked", "scan" or "recurrent" for the inputs (see :func:`choose_method`).
AUTO = "auto"

#: Below this many (batch, head, value block) programs per multiprocessor, "chunked"
#: leaves the GPU idle and "scan" (parallel over segments of the sequence too) wins. Not 1: scan
#: reads k and v twice and pays for its states, so it needs the idle share to be large. Measured
#: on an H200 (132 SMs, benchmarks/NOTES.md and the recorded data): at (2, 16, 16384, 128), 64
#: programs or 0.48 a multiprocessor, both take the same forward time and scan's
#: forward+backward is 1.12x faster (bfloat16). Under TF32 with keys 128 wide chunked walks its
#: transposed loop on blocks narrowed to fill the GPU, which ran faster than scan there
#: (``_chunked_value_block``; tests/test_auto.py's ``_HIGH_TRANSPOSED_H100``).
_SCAN_BELOW_PROGRAMS_PER_SM = 0.5
#: ... provided the sequence is long enough to be split into segments worth the extra passes.
_SCAN_FROM_LENGTH = 8192
#: float32 products at full precision: the split into bfloat16 parts (chunked's "highest") and
#: 3xTF32 (scan's, and chunked's on tiles and calls where the split gives way; see the kernel files).
_FULL_PRECISION_PRODUCTS = ("bf16x3_manual", "tf32x3")
#: Under 3xTF32: the widest head for which the tensor-core kernels beat "recurrent". Measured on
#: an H200: at D = 64 chunked's forward is the fastest and scan's 4-warp tiles the fastest
#: forward+backward; at D = 128 their tiles spill and recurrent, whose per-token products need no
#: tensor cores, is faster at every shape. Under the split, chunked is 2.4x faster than recurrent
#: there (1.42 against 3.43 ms forward at (8, 16, 4096, 128)).
_TF32X3_WIDEST_TENSOR_CORE_HEAD = 64
#: ... and up to that width, the shortest sequence at which scan's float32 forward+backward lead
#: was measured (T = 4096; under the split too: 1.017 against chunked's 1.134 ms at (8, 16, 4096,
#: 64)); below it calls are short, bound by the host, and chunked's single launch each way costs
#: less.
_TF32X3_SCAN_FROM_LENGTH = 4096


@functools.lru_cache(maxsize=256)  # a pure rule, asked at every "auto" call on a GPU
def _chunked_value_block(D: int, E: int, dtype: torch.dtype, float32_precision: str | None,
                         heads: int | None = None, multiprocessors: int | None = None,
                         normalized: bool = False) -> int:
    """The value columns of one "chunked" program, by the kernel file's own rule before it narrows
    blocks to fill an idle GPU (which is what this count decides about), except where chunked
    walks its transposed TF32 loop (``chunked._transposed``; not the forward of the normalised
    attention, ``normalized``): there the narrowed blocks, with the longer chunks they take, ran
    faster than scan (1.7x forward at (2, 16, 16384, 128) on an H100), so they are counted after
    narrowing for ``heads`` (B * H) on ``multiprocessors``."""
    precision = float32_precision or "tf32x3"
    if chunked._transposed(dtype, precision, chunked._block(D), normalize=normalized):
        return chunked.default_config(D, E, dtype, heads=heads, multiprocessors=multiprocessors,
                                      precision=precision, transposed=True)["BLOCK_E"]
    return chunked.default_config(D, E, dtype, precision=precision)["BLOCK_E"]


def choose_method(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                  gradients: bool | None = None, normalized: bool = False) -> str:
    """The method ``method="auto"`` runs for these inputs: "chunked" unless the GPU would idle
    (then "scan"), with float32's products at full precision as the kernel files take them.

    "chunked" runs one program per (batch, head, block of value columns) and walks the whole
    sequence; it is the fastest when those programs fill the GPU. With few long sequences (e.g.
    B * H = 8 at T = 65536) most multiprocessors would wait, and "scan" spreads every sequence
    over segments (programs counted with chunked's value blocks before it narrows them for few
    heads; under TF32, float32 with ``torch.get_float32_matmul_precision()`` "high" or "medium",
    from D = 65 to 128, where chunked walks its transposed loop, counted after that narrowing).
    float32 under "highest" runs chunked's products as a split into bfloat16 parts (three
    bfloat16 products) and scan's as 3xTF32 (three TF32 products, at half the rate; the kernel
    files' ``FLOAT32_PRECISIONS``): then chunked is the faster of the two wherever the programs
    fill the GPU, forward+backward too, and past D = 64 also where they do not (scan's 3xTF32
    tiles spill there). Where both take the same products, up to D = 64 and from T = 4096 on, a
    call that autograd will differentiate runs scan (its forward+backward 1.11x faster than
    chunked's at (8, 16, 4096, 64) on an H200 under the split, 1.07x under 3xTF32), a forward
    alone chunked. Where chunked takes 3xTF32 too, past
    D = 64 chunked's and scan's tiles spill and "recurrent", whose per-token products need no
    tensor cores, is faster (1.6x forward and 1.7x forward+backward at (8, 16, 4096, 128)).
    ``gradients``: whether a backward will follow; None reads it from autograd (grad mode on
    and q or v requiring a gradient). Under the interpreter the choice is always "chunked".
    Packed sequences (``cu_seqlens``) count as N sequences of their mean length, without reading
    the offsets: both kernels give each sequence its own programs (chunked) or segments (scan),
    and scan also builds its segment table, a few more small launches. ``normalized``: the call
    is the normalised attention in chunked's own kernels, whose forward never walks the
    transposed loop, so its programs count before narrowing.
    """
    if _device.INTERPRETED or q.device.type != "cuda":
        return "chunked"
    B, H, T, D, E = _counted_shape(q, v, cu_seqlens)
    if gradients is None:
        gradients = _gradients_follow(q, v)
    multiprocessors, _ = chunked._device_limits(q.device)
    precision = scan_precision = None
    if q.dtype == torch.float32:
        precision, scan_precision = chunked.float32_precision(), scan.float32_precision()
    return _rule(B, H, T, D, E, q.dtype, multiprocessors, precision, gradients, scan_precision, normalized)


def _counted_shape(q, v, cu_seqlens=None) -> tuple[int, int, int, int, int]:
    """(B, H, T, D, E) as the rule counts a call: packed sequences as N sequences of their mean
    length (the offsets' count, not their values: no read back)."""
    B, H, T, D = q.shape
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
        T //= B
    return B, H, T, D, v.shape[-1]


def _gradients_follow(*tensors) -> bool:
    """Whether autograd will ask for a backward through these tensors (None entries skipped)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


@functools.lru_cache(maxsize=256)  # a pure rule, asked at every "auto" call on a GPU
def _rule(B: int, H: int, T: int, D: int, E: int, dtype: torch.dtype, multiprocessors: int,
          float32_precision: str | None = "tf32x3", gradients: bool = False,
          scan_float32_precision: str | None = None, normalized: bool = False) -> str:
    """``choose_method``'s choice for a GPU with ``multiprocessors`` multiprocessors, without one;
    ``float32_precision`` is the products' for float32 inputs (``chunked.float32_precision()``),
    ``scan_float32_precision`` scan's (``scan.float32_precision()``; None: the same),
    ``gradients`` whether a backward follows, ``normalized`` whether chunked would run the
    normalised attention's forward. tests/test_auto.py checks it against the recorded benchmark
    and the float32 sweeps."""
    if dtype == torch.float32 and float32_precision in _FULL_PRECISION_PRODUCTS:
        scan_precision = float32_precision if scan_float32_precision is None else scan_float32_precision
        if float32_precision == "tf32x3" and D > _TF32X3_WIDEST_TENSOR_CORE_HEAD:
            return "recurrent"
        if scan_precision != float32_precision:
            # chunked's split into bfloat16 parts against scan's 3xTF32: scan's products cost
            # twice chunked's, and past D = 64 its 3xTF32 tiles spill.
            if D > _TF32X3_WIDEST_TENSOR_CORE_HEAD:
                return "chunked"
        elif gradients and T >= _TF32X3_SCAN_FROM_LENGTH and D <= _TF32X3_WIDEST_TENSOR_CORE_HEAD:
            return "scan"
    value_block = _chunked_value_block(D, E, dtype, float32_precision, B * H, multiprocessors, normalized)
    programs = B * H * -(-E // value_block)
    if programs < _SCAN_BELOW_PROGRAMS_PER_SM * multiprocessors and T >= _SCAN_FROM_LENGTH:
        return "scan"
    return "chunked"


def method_info(name: str) -> Method:
    """The :class:`Method` record for ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {METHODS} or {AUTO!r}")
    return _REGISTRY[name]


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str = AUTO, *,
                   cu_seqlens: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None, return_state: bool = False,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal linear attention: o_t = S_t^T q_t with S_t = S_{t-1} + k_t v_t^T.

    Args:
        q, k: (B, H, T, D) tensors; v: (B, H, T, E), all of one dtype on one device.
        method: one of :data:`METHODS`, or "auto" (the default): the fastest Triton kernel for
            these shapes, see :func:`choose_method`.
        cu_seqlens: optional (N + 1,) int32/int64 offsets of N sequences packed along T, as fla and
            flash-attention take them: q, k are then (1, H, total_T, D), sequence n is tokens
            cu_seqlens[n] to cu_seqlens[n + 1] - 1, no state crosses a boundary, and the states
            are (N, H, D, E), one per sequence. Checked on a GPU with one read back to the host per
            offsets tensor (and again after an in-place change PyTorch records: new offsets written
            through ``.data`` or a DLPack view are not seen, so give them a new tensor); on the
            CPU at every call.
        initial_state: optional (B, H, D, E) tensor S_0 (zeros when None), (N, H, D, E) with
            cu_seqlens; used in float32.
        return_state: also return S_T, the state after the last token, as (B, H, D, E) float32
            ((N, H, D, E) with cu_seqlens; float64 for float64 inputs to the references).

    Returns:
        o of shape (B, H, T, E) in the dtype of the inputs, or ``(o, S_T)`` with ``return_state``.

    Views with a negative bit (``x.conj().imag``) are materialised before a kernel reads them.
    The Triton methods are differentiable once: a gradient of their gradient (``create_graph=True``)
    raises an error rather than silently missing the second-order term. Under Triton's CPU
    interpreter, calls from several threads take turns, one kernel launch at a time.
    """
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be True or False, got {return_state!r}")
    o, final_state = _checked_product(q, k, v, method, cu_seqlens, initial_state, normalized=False)
    return (o, final_state) if return_state else o


def _checked_product(q, k, v, method, cu_seqlens, initial_state, *, normalized):
    """``causal_product``'s (o, S_T). ``normalized``: v ends with a column of ones, by whose
    product the caller divides the others (``causal_linear_attention``): the Triton methods then
    keep float32's products at 3xTF32, forward and backward (the kernel files'
    ``float32_precision``)."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, one of {METHODS} or {AUTO!r}; got {type(method).__name__}")
    compiling = torch.compiler.is_compiling()
    if method == AUTO:
        # Every Triton method accepts the same inputs: one check serves whichever is chosen.
        check_inputs(q, k, v, initial_state, method=method, dtypes=KERNEL_DTYPES,
                     max_head_dim=MAX_HEAD_DIM, expected_device=_device.DEVICE.type,
                     index_limit=KERNEL_INDEX_LIMIT, cu_seqlens=cu_seqlens)
        # Under torch.compile the operator chooses at run time: the device query would break the graph.
        info = method_info("chunked" if compiling else
                           choose_method(q, v, cu_seqlens, gradients=_gradients_follow(q, k, v, initial_state)))
    else:
        info = method_info(method)
        expected_device = _device.DEVICE.type if info.is_triton else None
        check_inputs(q, k, v, initial_state, method=method, dtypes=info.dtypes,
                     max_head_dim=info.max_head_dim, expected_device=expected_device,
                     index_limit=KERNEL_INDEX_LIMIT if info.is_triton else None, cu_seqlens=cu_seqlens)
    if initial_state is not None and q.dtype != torch.float64:
        initial_state = initial_state.float()
    cast = ops.autocast_dtype(q)
    if cast is not None:  # as PyTorch's attention does under autocast
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    if compiling and info.is_triton:  # one graph node, see ttx_tutorial.ops
        return ops.causal_product_op(q, k, v, initial_state, method, cu_seqlens, normalized)
    implementation = info.function
    if cu_seqlens is not None:
        implementation = functools.partial(implementation, cu_seqlens=cu_seqlens)
    if normalized and info.is_triton:
        implementation = functools.partial(implementation, normalized=True)
    # is_cuda and get_device() are plain attribute reads, where q.device builds an object per call.
    if q.is_cuda and q.get_device() != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # launch on the tensors' GPU, not the current one
            return implementation(q, k, v, initial_state)
    return implementation(q, k, v, initial_state)
