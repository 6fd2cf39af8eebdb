"""The feature maps of linear attention, phi(q) and phi(k) in one launch each way.

"Transformers are RNNs" (Katharopoulos et al., 2020) run attention on positive features of the
queries and keys. This file computes the two named maps elementwise, in float32, rounded once
to the input dtype::

    "elu"   phi(x) = elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise   (positive)
    "relu"  phi(x) = max(x, 0)                                        (NaN stays NaN)

``feature_map_kernel`` reads a tile of q and the same tile of k and writes both features: one
pass over the memory of q and k where PyTorch's ``F.elu(x) + 1`` makes four (two operations on
each tensor). ``feature_map_backward_kernel`` turns the gradients of the features into those of
q and k, dx = dphi * phi'(x), with phi' read off the feature itself, which the attention keeps
for its own backward anyway: min(phi, 1) for "elu" (exp(x) <= 1 where x <= 0, x + 1 > 1
beyond), 1 where phi > 0 for "relu". So q and k need not be saved.

Shapes: q, k (B, H, T, D), the same shape, any strides; the features are laid out as their
inputs (``torch.empty_like``), the gradients as the features. One program maps a tile of
``BLOCK_T`` tokens by all ``BLOCK_D`` >= D columns of one (batch, head), so 1 <= D <= 256
(``MAX_HEAD_DIM``, the other kernel files' limit, within which every launch is compiled for
sm_80 and sm_90); offsets are 64-bit. dtypes float32, float16, bfloat16. Differentiable once (a gradient of the gradient is refused).
Without a GPU: set TRITON_INTERPRET=1 before importing this file, since ``@triton.jit`` chooses
Triton's CPU interpreter at import; the wrappers refuse an interpreter switched on or off afterwards.
Tested: Triton 3.9's CPU interpreter; every launch compiled for sm_80 and sm_90 with Triton 3.9
(``tests/test_compile_targets.py``); the test suite on an H200 with Triton 3.6.
Caveats: the rounded feature gives phi' for "elu": where exp(x) rounds to 1 (x within half an
ulp of 0) the derivative is taken as 1. A NaN input gives a NaN feature and passes its
gradient on unchanged, as PyTorch's ``elu_backward`` and ``threshold_backward`` do.
"""

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.to(DTYPE), rounded to nearest even as on a GPU. The interpreter truncates float32 to
    bfloat16, so under it round the bit pattern first (half an ulp, ties to even, drop 16 bits)."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def feature_map_kernel(
    q_ptr, k_ptr,              # inputs (B, H, T, D)
    phi_q_ptr, phi_k_ptr,      # outputs (B, H, T, D), the input dtype
    H, T, D,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_pqb, stride_pqh, stride_pqt, stride_pqd,
    stride_pkb, stride_pkh, stride_pkt, stride_pkd,
    FEATURE_MAP: tl.constexpr,  # "elu" or "relu"
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,      # >= D
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (see _rounded)
):
    """phi of one tile of q and of the same tile of k."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    b_q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                  mask=mask, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                  mask=mask, other=0.0).to(tl.float32)
    # Written out for both tiles rather than in a helper: under the interpreter every call of a
    # @triton.jit helper re-patches triton.language, most of a small launch's time.
    if FEATURE_MAP == "elu":  # exp(x) itself, not (exp(x) - 1) + 1, which cancels near 0
        b_q = tl.where(b_q > 0, b_q + 1.0, tl.exp(b_q))
        b_k = tl.where(b_k > 0, b_k + 1.0, tl.exp(b_k))
    else:  # relu; x < 0 is false for NaN, which passes through as torch.relu's does
        b_q = tl.where(b_q < 0, 0.0, b_q)
        b_k = tl.where(b_k < 0, 0.0, b_k)
    tl.store(phi_q_ptr + b * stride_pqb + h * stride_pqh + offs_t[:, None] * stride_pqt
             + offs_d[None, :] * stride_pqd, _rounded(b_q, phi_q_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(phi_k_ptr + b * stride_pkb + h * stride_pkh + offs_t[:, None] * stride_pkt
             + offs_d[None, :] * stride_pkd, _rounded(b_k, phi_k_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def feature_map_backward_kernel(
    grad_phi_q_ptr, grad_phi_k_ptr,  # gradients of the features (B, H, T, D)
    phi_q_ptr, phi_k_ptr,            # the features feature_map_kernel wrote
    dq_ptr, dk_ptr,                  # outputs (B, H, T, D), strides of the features
    H, T, D,
    stride_gqb, stride_gqh, stride_gqt, stride_gqd,
    stride_gkb, stride_gkh, stride_gkt, stride_gkd,
    stride_pqb, stride_pqh, stride_pqt, stride_pqd,
    stride_pkb, stride_pkh, stride_pkt, stride_pkd,
    FEATURE_MAP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """dq = dphi(q) * phi'(q) and dk likewise for one tile, phi' from the features."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    feature_q = b * stride_pqb + h * stride_pqh + offs_t[:, None] * stride_pqt + offs_d[None, :] * stride_pqd
    feature_k = b * stride_pkb + h * stride_pkh + offs_t[:, None] * stride_pkt + offs_d[None, :] * stride_pkd
    b_gq = tl.load(grad_phi_q_ptr + b * stride_gqb + h * stride_gqh + offs_t[:, None] * stride_gqt
                   + offs_d[None, :] * stride_gqd, mask=mask, other=0.0).to(tl.float32)
    b_gk = tl.load(grad_phi_k_ptr + b * stride_gkb + h * stride_gkh + offs_t[:, None] * stride_gkt
                   + offs_d[None, :] * stride_gkd, mask=mask, other=0.0).to(tl.float32)
    b_phi_q = tl.load(phi_q_ptr + feature_q, mask=mask, other=0.0).to(tl.float32)
    b_phi_k = tl.load(phi_k_ptr + feature_k, mask=mask, other=0.0).to(tl.float32)
    # Comparisons false for a NaN feature pass the gradient on unchanged, as PyTorch's backward
    # of elu and relu do; selected rather than multiplied (0 * an infinite gradient is NaN).
    if FEATURE_MAP == "elu":  # phi' = min(phi, 1)
        b_gq = tl.where(b_phi_q < 1.0, b_gq * b_phi_q, b_gq)
        b_gk = tl.where(b_phi_k < 1.0, b_gk * b_phi_k, b_gk)
    else:  # relu: phi' = 0 where phi <= 0, else 1
        b_gq = tl.where(b_phi_q <= 0, 0.0, b_gq)
        b_gk = tl.where(b_phi_k <= 0, 0.0, b_gk)
    tl.store(dq_ptr + feature_q, _rounded(b_gq, dq_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(dk_ptr + feature_k, _rounded(b_gk, dk_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# --------------------------------------------------------------------------- host side

#: The maps this file computes ("identity" needs no kernel: the inputs are their features).
FEATURE_MAPS = ("elu", "relu")
#: The largest D the kernels take: a tile holds a whole row of D columns.
MAX_HEAD_DIM = 256
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of one input a program maps: 2048 (16 a thread of 4 warps) keeps a GPU's many
# programs streaming; the interpreter pays per program, so it takes larger tiles.
_TILE_ELEMENTS = 2048
_INTERPRETED_TILE_ELEMENTS = 65536
_NUM_WARPS = 4


@functools.lru_cache(maxsize=256)
def _launch_plan(B, H, T, D, interpreted):
    """(grid, BLOCK_T, BLOCK_D) for one shape."""
    block_d = triton.next_power_of_2(D)
    tile = _INTERPRETED_TILE_ELEMENTS if interpreted else _TILE_ELEMENTS
    block_t = max(1, min(tile // block_d, triton.next_power_of_2(T)))
    return (triton.cdiv(T, block_t), B * H), block_t, block_d


def _launch(q, k, feature_map):
    """(phi(q), phi(k)), laid out as q and k."""
    B, H, T, D = q.shape
    phi_q, phi_k = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return phi_q, phi_k
    interpreted = triton.knobs.runtime.interpret
    grid, block_t, block_d = _launch_plan(B, H, T, D, interpreted)
    with _launch_guard():
        feature_map_kernel[grid](
            q, k, phi_q, phi_k, H, T, D, *q.stride(), *k.stride(), *phi_q.stride(), *phi_k.stride(),
            FEATURE_MAP=feature_map, BLOCK_T=block_t, BLOCK_D=block_d, INTERPRETED=interpreted,
            num_warps=_NUM_WARPS)
    return phi_q, phi_k


def _launch_backward(grad_phi_q, grad_phi_k, phi_q, phi_k, feature_map):
    """(dq, dk), laid out as the features."""
    B, H, T, D = phi_q.shape
    dq, dk = torch.empty_like(phi_q), torch.empty_like(phi_k)
    if phi_q.numel() == 0:
        return dq, dk
    interpreted = triton.knobs.runtime.interpret
    grid, block_t, block_d = _launch_plan(B, H, T, D, interpreted)
    with _launch_guard():
        feature_map_backward_kernel[grid](
            grad_phi_q, grad_phi_k, phi_q, phi_k, dq, dk, H, T, D, *grad_phi_q.stride(), *grad_phi_k.stride(),
            *phi_q.stride(), *phi_k.stride(), FEATURE_MAP=feature_map, BLOCK_T=block_t, BLOCK_D=block_d,
            INTERPRETED=interpreted, num_warps=_NUM_WARPS)
    return dq, dk


def _laid_out_like(grad, x):
    """``grad`` with the strides of ``x``: the backward kernel writes dq where it reads phi(q)."""
    return grad if grad.stride() == x.stride() else torch.empty_like(x).copy_(grad)


#: Why a backward recorded for a gradient of the gradient (create_graph=True) is refused: the
#: backward kernels are not differentiable themselves, so that gradient would silently miss terms.
SECOND_ORDER_REFUSAL = ("a gradient of these gradients (create_graph=True) is not supported: the backward "
                        "kernels are not differentiable themselves")


class _FeatureMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, feature_map):
        phi_q, phi_k = _launch(q, k, feature_map)
        ctx.save_for_backward(phi_q, phi_k)
        ctx.feature_map = feature_map
        return phi_q, phi_k

    @staticmethod
    def backward(ctx, grad_phi_q, grad_phi_k):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        phi_q, phi_k = ctx.saved_tensors
        dq, dk = _launch_backward(_laid_out_like(grad_phi_q, phi_q), _laid_out_like(grad_phi_k, phi_k),
                                  phi_q, phi_k, ctx.feature_map)
        return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None


def _check_dense(name, x):
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor; pad it first")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
                        "convert it with .to_dense()")


def check_inputs(q, k, feature_map):
    """A TypeError or ValueError naming the argument and the limit for anything the kernels cannot
    take: feature_map one of FEATURE_MAPS; q and k dense tensors of one shape (B, H, T, D) with
    1 <= D <= MAX_HEAD_DIM, one dtype of float32/float16/bfloat16, on the GPU (the CPU under
    TRITON_INTERPRET=1)."""
    if not isinstance(feature_map, str) or feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check_dense(name, x)
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions (B, H, T, D), got shape {tuple(q.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, T, D), got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
    if q.dtype not in _INPUT_DTYPES:
        raise TypeError(f"the feature-map kernels support dtypes float32, float16, bfloat16; q and k are {q.dtype}")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"the feature-map kernels take 1 <= D <= {MAX_HEAD_DIM} (a tile holds a whole row), "
                         f"got D={q.shape[-1]}")
    expected_device = "cpu" if triton.knobs.runtime.interpret else "cuda"
    # @triton.jit built a GPU kernel or an interpreter function at import; a stand-in for the
    # kernel (a test's launch recorder) is neither and passes.
    if isinstance(feature_map_kernel, triton.runtime.JITFunction if triton.knobs.runtime.interpret else InterpretedFunction):
        raise RuntimeError(
            "Triton's interpreter was switched " + ("on" if triton.knobs.runtime.interpret else "off") +
            " after this file was imported, and @triton.jit chose at import: set TRITON_INTERPRET=1 "
            "(for CPU tensors) or leave it unset (for a GPU) before importing this file"
        )
    if k.device != q.device:
        raise ValueError(f"k must be on the same device as q ({q.device}), got {k.device}")
    if q.device.type != expected_device:
        where = "Triton's CPU interpreter" if expected_device == "cpu" else "the GPU"
        move = f"Move them with .to({expected_device!r})"
        if expected_device == "cuda" and not torch.cuda.is_available():
            move = ("This machine has no GPU: set TRITON_INTERPRET=1 before importing this file, and "
                    "Triton's interpreter runs it on CPU tensors")
        raise ValueError(f"the feature-map kernels run on {where} in this session, so q and k must be on "
                         f"{expected_device!r}; they are on {q.device}. {move}")


def feature_maps(q, k, feature_map="elu"):
    """(phi(q), phi(k)) for a map of FEATURE_MAPS, in one launch (see the module docstring).
    q, k: (B, H, T, D) of one dtype of float32/float16/bfloat16. Differentiable in q and k."""
    check_inputs(q, k, feature_map)
    return _run_validated(q, k, feature_map)


def _run_validated(q, k, feature_map):
    """``feature_maps`` for inputs already through ``check_inputs``."""
    q, k = q.resolve_neg(), k.resolve_neg()  # the kernels read raw storage (see chunked._resolved)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _FeatureMap.apply(q, k, feature_map)
    return _launch(q, k, feature_map)


_INTERPRETER_LOCK_NAME = "serial_launch_lock"


def _launch_guard():
    """Triton's interpreter swaps triton.language's functions for its own while a kernel runs, so
    two threads interpreting at once break each other's launches. Under the interpreter every
    launch holds one process-wide lock, kept on Triton's interpreter module so that every kernel
    file shares it; on a GPU launches go ahead unserialised."""
    if not triton.knobs.runtime.interpret:
        return contextlib.nullcontext()
    from triton.runtime import interpreter
    shared = vars(interpreter)
    lock = shared.get(_INTERPRETER_LOCK_NAME)
    if lock is None:
        lock = shared.setdefault(_INTERPRETER_LOCK_NAME, threading.RLock())
    return _interpreted(lock)


@contextlib.contextmanager
def _interpreted(lock):
    """``lock`` held, and NumPy's warnings of inf and NaN arithmetic off: the interpreter computes
    with NumPy, which warns where a GPU's IEEE arithmetic is silent (non-finite values are inputs
    the kernels handle), and a caller's warnings-as-errors would stop the launch. The interpreter's
    own NumPy (its module's ``np``): this file imports only torch and triton."""
    from triton.runtime import interpreter

    with lock, interpreter.np.errstate(all="ignore"):
        yield
