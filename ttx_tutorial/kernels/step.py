"""One token of causal linear attention in one launch: the generation step of an RNN-style decoder.

Computes the recurrence of Katharopoulos et al., "Transformers are RNNs" (ICML 2020), advanced
by one token, with the feature map phi applied inside the kernel::

    S <- S + phi(k) v^T   (D x E)        z <- z + phi(k)   (D)
    o  = phi(q)^T S / (phi(q)^T z + eps)   (normalize; eps added once, to the finished denominator)
    o  = phi(q)^T S                        (not normalize)

One program owns one (batch, head) pair and one block of value columns; it walks D in blocks of
``BLOCK_D`` rows, adds the outer product to its rows of the state in place and sums their
contributions to o in float32. No ``tl.dot``: one query row would waste the tensor cores. z is
shared by every value block: each program reads the old z and computes the denominator itself
(D products), and the head's last program to finish, counted by an integer atomic, writes the
new z, once every other one has read the old (nothing else orders programs within a launch);
where one program covers all of E it writes z itself, without the count: the rule gives a head
that fits one tile (D x E, each padded to a power of two, at most 4096, e.g. 64 x 64) a single
program, so the count serves only wider heads. The loop over blocks of D rows is unrolled
(their count is a constexpr), so that the compiler does not software-pipeline what is mostly a
single iteration (as a loop it was slower on an H200, benchmarks/NOTES.md). The counters, one
int32 per head, belong to the state: zeros at rest, reset by that last program, kept on the
state tensor (pass the same tensor token after token: a new view would make new ones).
Shapes: q, k (B, H, D); v (B, H, E); any strides. state (B, H, D, E + 1) float32 with z as the
last column when normalising, (B, H, D, E) otherwise, contiguous (it is written in place). o
(B, H, E), new, in the dtype of q. 1 <= D, E <= 256; offsets are 64-bit. q, k, v: float32,
float16 or bfloat16. Feature maps (``FEATURE_MAP``, a constexpr): "elu" (x + 1 for x > 0, else
exp(x)), "relu", "identity", in float32; a caller's own map is applied first, then "identity".
Scope: inference only (no backward: ``step_update`` refuses inputs that autograd would need a
gradient for; training runs the whole sequence through a causal product). The contract's
``<family>_causal_product``, ``_run_validated``, autograd Function and ``config`` do not apply,
and the file asks the driver nothing.
Without a GPU: set TRITON_INTERPRET=1 before importing this file, since ``@triton.jit`` chooses
Triton's CPU interpreter at import; the wrappers refuse an interpreter switched on or off afterwards.
Tested: Triton 3.9's CPU interpreter; every launch compiled for sm_80 and sm_90 with Triton 3.9
(``tests/test_compile_targets.py``); the test suite on an H200 with Triton 3.6 (threads racing on
one state, CUDA-graph replay).
Caveats: the host's work for a call (checks, allocation, Triton's launcher) exceeds the GPU's:
full checks run once per signature of the arguments, and only what can change between calls of
one signature (the state's contiguity, autograd) every time; on the GPU the compiled kernel of a
launch seen before is launched directly, without Triton's JIT path (``_KEPT_LAUNCHES``; NVIDIA
GPUs only); capture the step in a CUDA graph to remove the host. Threads holding copies of a
state element must all read it before any writes it (a barrier). Under the interpreter each call of a library ``@triton.jit`` function
(``tl.sum``) re-patches triton.language, a large part of a CPU-mode step.
"""

from __future__ import annotations

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
def step_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B, H, D), (B, H, D), (B, H, E), (B, H, E) contiguous
    state_ptr,  # (B, H, D, E + NORMALIZE) float32, contiguous; updated in place
    arrivals_ptr,  # (B * H,) int32, zeros: the head's programs that have read z (NORMALIZE only)
    H, D, E,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kd,
    stride_vb, stride_vh, stride_ve,
    eps,  # added to phi(q)^T z; unused unless NORMALIZE
    FEATURE_MAP: tl.constexpr,  # "elu", "relu" or "identity"
    NORMALIZE: tl.constexpr,  # z is the state's last column
    BLOCK_D: tl.constexpr,  # state rows per iteration (power of two); at least D when NORMALIZE
    BLOCK_E: tl.constexpr,  # value columns per program (power of two)
    D_BLOCKS: tl.constexpr,  # iterations of the row loop, cdiv(D, BLOCK_D); the loop is unrolled
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (see _rounded)
):
    """Adds phi(k) v^T (and phi(k) to z) to one head's state in place; writes o for its value block."""
    # One flat grid, value block fastest (as in the causal-product kernels).
    num_e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    pid_e = tl.program_id(0) % num_e_blocks
    pid_bh = (tl.program_id(0) // num_e_blocks).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    state_cols = E
    if NORMALIZE:
        state_cols = E + 1

    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    b_v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_e.to(tl.int64) * stride_ve,
                  mask=mask_e, other=0.0).to(tl.float32)
    state_head_ptr = state_ptr + pid_bh * D * state_cols
    # tl.full, not tl.zeros: see "Fragile" on the interpreter.
    b_numerator = tl.full([BLOCK_E], 0.0, tl.float32)
    b_denominator = tl.full([BLOCK_D], 0.0, tl.float32)  # summed over D after the loop
    b_z = tl.full([BLOCK_D], 0.0, tl.float32)  # the new z; one iteration covers D when normalising
    for d_block in tl.static_range(D_BLOCKS):
        offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        offs_d64 = offs_d.to(tl.int64)
        b_q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d64 * stride_qd, mask=mask_d, other=0.0)
        b_k = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_d64 * stride_kd, mask=mask_d, other=0.0)
        b_q = b_q.to(tl.float32)
        b_k = b_k.to(tl.float32)
        # phi, written here rather than in a helper (see "Fragile" on the interpreter).
        if FEATURE_MAP == "elu":  # elu(x) + 1, without the cancellation of (exp(x) - 1) + 1
            b_q = tl.where(b_q > 0, b_q + 1.0, tl.exp(b_q))
            b_k = tl.where(b_k > 0, b_k + 1.0, tl.exp(b_k))
        elif FEATURE_MAP == "relu":
            b_q = tl.maximum(b_q, 0.0)
            b_k = tl.maximum(b_k, 0.0)
        # Padded rows (d >= D) load as 0, which elu + 1 maps to 1: zeroing phi(k) there keeps
        # those rows of the tile zero (their state loads as 0), so phi(q) needs no mask.
        b_k = tl.where(mask_d, b_k, 0.0)
        state_row_ptr = state_head_ptr + offs_d64 * state_cols
        mask_s = mask_d[:, None] & mask_e[None, :]
        s_tile_ptr = state_row_ptr[:, None] + offs_e[None, :]
        b_s = tl.load(s_tile_ptr, mask=mask_s, other=0.0) + b_k[:, None] * b_v[None, :]
        if NORMALIZE:  # the old z: no program writes it before every one has read it (below)
            b_z = tl.load(state_row_ptr + E, mask=mask_d, other=0.0) + b_k
            b_denominator += b_z * b_q
        # Several threads may hold copies of a tile element: every thread must have read the old
        # state before any writes the new one, or a late reader adds k twice.
        tl.debug_barrier()
        tl.store(s_tile_ptr, b_s, mask=mask_s)
        b_numerator += tl.sum(b_s * b_q[:, None], axis=0)
    b_o = b_numerator
    if NORMALIZE:
        b_o = b_numerator / (tl.sum(b_denominator, axis=0) + eps)
    tl.store(o_ptr + pid_bh * E + offs_e, _rounded(b_o, o_ptr.dtype.element_ty, INTERPRETED), mask=mask_e)
    if NORMALIZE:
        offs_d = tl.arange(0, BLOCK_D)
        z_ptr = state_head_ptr + offs_d.to(tl.int64) * state_cols + E
        # The denominator above used every thread's z, so every read of the old z is done.
        tl.debug_barrier()
        if num_e_blocks == 1:  # the head's only program: it writes z itself, no count to keep
            tl.store(z_ptr, b_z, mask=offs_d < D)
        else:
            # The barrier orders this program's reads before the count, whose acquire-release
            # order puts the other programs' reads before the last program's write; that
            # program resets the count.
            arrived = tl.atomic_add(arrivals_ptr + pid_bh, 1, sem="acq_rel")
            if arrived == num_e_blocks - 1:
                tl.store(z_ptr, b_z, mask=offs_d < D)
                tl.atomic_xchg(arrivals_ptr + pid_bh, 0, sem="relaxed")


# --------------------------------------------------------------------------- host side

#: Feature maps the kernel computes itself.
FEATURE_MAPS = ("elu", "relu", "identity")
#: The largest head dimension (D and E) the kernel takes.
MAX_HEAD_DIM = 256
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# State elements a program holds per iteration at most: 32 float32 registers a thread with 4 warps.
_TILE_ELEMENTS = 4096
_NUM_WARPS = 4
# State elements a thread holds when a whole head is one program (8 warps for a 64 x 64 head).
_ELEMENTS_PER_THREAD = 16


def default_config(D: int, E: int, normalize: bool) -> dict:
    """Block sizes and warps. The state is the whole of the step's memory traffic, and a step is
    short enough that latency sets its time. When normalising, a head whose state fits one tile
    (at most 4096 elements) gets one program: no count of arrivals (see the module docstring),
    16 elements a thread (8 warps at D = E = 64): faster as a CUDA-graph replay on an H200 than
    16-column programs with their count (``benchmarks/launch_cost.py``; figures in
    benchmarks/NOTES.md). Wider heads take 16 value columns a program, each computing the
    denominator itself; without normalize, at most 32.
    BLOCK_D: the rows of D, as a power of two of at least 16, at most a tile of 4096 elements (so
    at most 256: all of D in one iteration when normalising, as the kernel requires)."""
    largest_d = max(16, triton.next_power_of_2(D))
    largest_e = max(16, triton.next_power_of_2(E))
    if normalize and largest_d * largest_e <= _TILE_ELEMENTS:
        warps = max(1, min(8, largest_d * largest_e // (_ELEMENTS_PER_THREAD * 32)))
        return {"BLOCK_D": largest_d, "BLOCK_E": largest_e, "num_warps": warps}
    block_e = 16 if normalize else min(32, largest_e)
    block_d = min(_TILE_ELEMENTS // block_e, largest_d)
    return {"BLOCK_D": block_d, "BLOCK_E": block_e, "num_warps": _NUM_WARPS}


@functools.lru_cache(maxsize=256)
def _launch_plan(B: int, H: int, D: int, E: int, normalize: bool) -> tuple:
    """(grid, BLOCK_D, BLOCK_E, D_BLOCKS, num_warps) for one shape: computed once, a tuple so
    that the cached value cannot be modified."""
    cfg = default_config(D, E, normalize)
    grid = (B * H * triton.cdiv(E, cfg["BLOCK_E"]),)
    return grid, cfg["BLOCK_D"], cfg["BLOCK_E"], triton.cdiv(D, cfg["BLOCK_D"]), cfg["num_warps"]


_ARRIVALS_ATTRIBUTE = "_step_arrival_counters"


def _arrivals(state, heads):
    """The int32 counters, one per head, of ``state``'s launches (see the module docstring). Kept
    on the state tensor itself, so that they live exactly as long as it does: a CUDA graph that
    updates the state holds their address too, and steps of different states may run at once on
    several streams."""
    counters = getattr(state, _ARRIVALS_ATTRIBUTE, None)
    if counters is None or counters.numel() != heads:
        counters = torch.zeros(heads, dtype=torch.int32, device=state.device)
        # Made during a CUDA-graph capture, a tensor holds its zeros only when the graph replays:
        # such counters stay the graph's own, and a later eager call makes its own.
        if not (state.is_cuda and torch.cuda.is_current_stream_capturing()):
            setattr(state, _ARRIVALS_ATTRIBUTE, counters)
    return counters


def _launch(q, k, v, state, feature_map, normalize, eps):
    """One launch: updates ``state`` in place and returns o (B, H, E) in the dtype of q."""
    B, H, D = q.shape
    E = v.shape[-1]
    grid, block_d, block_e, d_blocks, num_warps = _launch_plan(B, H, D, E, normalize)
    o = torch.empty((B, H, E), dtype=q.dtype, device=q.device)
    if B * H == 0:
        return o
    # Without normalize, or with one program a head, the kernel never touches the counters: the
    # state stands in for them.
    arrivals = _arrivals(state, B * H) if normalize and grid[0] > B * H else state
    q_strides, k_strides, v_strides = q.stride(), k.stride(), v.stride()
    arguments = (q, k, v, o, state, arrivals, H, D, E, *q_strides, *k_strides, *v_strides, eps)
    interpreted = triton.knobs.runtime.interpret
    constants = (feature_map, normalize, block_d, block_e, d_blocks, interpreted)
    key = None
    if q.is_cuda and not interpreted and _KEEPS_LAUNCHES and not step_kernel.pre_run_hooks:
        compilation = triton.knobs.compilation
        key = (torch.cuda.current_device(), q.shape, E, q.dtype, k.dtype, v.dtype, q_strides, k_strides,
               v_strides, arrivals is state, constants, q.data_ptr() % 16, k.data_ptr() % 16,
               v.data_ptr() % 16, o.data_ptr() % 16, state.data_ptr() % 16, arrivals.data_ptr() % 16,
               triton.knobs.runtime.debug, compilation.instrumentation_mode,
               getattr(compilation, "fpsan_homomorphic_casts", None))
        launch = _KEPT_LAUNCHES.get(key)
        if launch is not None:
            launch(*arguments, *constants)
            return o
    with _launch_guard():
        kernel = step_kernel[grid](*arguments, FEATURE_MAP=feature_map, NORMALIZE=normalize, BLOCK_D=block_d,
                                   BLOCK_E=block_e, D_BLOCKS=d_blocks, INTERPRETED=interpreted,
                                   num_warps=num_warps)
    # Kept unless this is the JIT path's own case, or a future of an asynchronous compile.
    if key is not None and isinstance(kernel, triton.compiler.CompiledKernel):
        if len(_KEPT_LAUNCHES) >= _MAX_KEPT_LAUNCHES:
            _KEPT_LAUNCHES.clear()
        _KEPT_LAUNCHES[key] = kernel[(grid[0], 1, 1)]
    return o


# The GPU's launches, kept per key. Triton's JIT path binds and specialises every argument and
# looks the compiled kernel up at each call, which costs the host about as much as the launch
# itself (benchmarks/launch_cost.py, rows "jit" and "compiled"); a generation loop makes the same
# call token after token. The first call of a key goes through the JIT path, which returns the
# compiled kernel; later calls launch that kernel directly. A key holds everything Triton
# specialises an NVIDIA launch on (the current device; the tensors' dtypes and their addresses
# modulo 16 bytes; the integer arguments' values; the debug and instrumentation settings) and
# every constexpr, so the kept kernel is the one the JIT path would pick. AMD GPUs keep the JIT
# path: Triton also specialises their pointers on the size of the memory behind them. So does a
# kernel given pre-run hooks (``add_pre_run_hook``), which only the JIT path calls.
_KEPT_LAUNCHES: dict = {}
_MAX_KEPT_LAUNCHES = 256
_KEEPS_LAUNCHES = torch.version.hip is None


# Input checks, with the same wording as the causal-product kernel files.

def _check_dense(name, x):
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor; pad it first")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
                        "convert it with .to_dense()")


def check_inputs(q, k, v, state, *, feature_map="elu", normalize=True, eps=1e-6):
    """A TypeError or ValueError naming the argument and the limit for any input the kernel cannot
    take: q, k (B, H, D) and v (B, H, E) dense, of one dtype of float32/float16/bfloat16, on the
    GPU (the CPU under TRITON_INTERPRET=1), 1 <= D, E <= MAX_HEAD_DIM; state a contiguous float32
    (B, H, D, E + 1) tensor when normalising, (B, H, D, E) otherwise, on their device;
    feature_map one of FEATURE_MAPS; normalize a bool; eps a finite float >= 0. A RuntimeError
    when autograd would need a gradient (the step is inference only)."""
    if not isinstance(feature_map, str) or feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS} (apply others before the step and "
                         f"pass 'identity'), got {feature_map!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        kind = type(eps).__qualname__
        kind = kind if type(eps).__module__ == "builtins" else f"{type(eps).__module__}.{kind}"
        raise TypeError(f"eps must be a Python float, got {kind}; convert it with float(eps)")
    if not (eps >= 0 and eps != float("inf")):  # also false for NaN
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    for name, x in (("q", q), ("k", k), ("v", v), ("state", state)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check_dense(name, x)
    for name, x, hint in (("q", q, "(B, H, D)"), ("k", k, "(B, H, D)"), ("v", v, "(B, H, E)")):
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions {hint} for one token, got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, D), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must share B and H with q: v is {tuple(v.shape)} (B, H, E), q is {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                        "convert them first, e.g. k.to(q.dtype)")
    if q.dtype not in _INPUT_DTYPES:
        raise TypeError(f"the step kernel supports dtypes float32, float16, bfloat16; q, k, v are {q.dtype}")
    expected_device = "cpu" if triton.knobs.runtime.interpret else "cuda"
    # @triton.jit built a GPU kernel or an interpreter function at import; a stand-in for the
    # kernel (a test's launch recorder) is neither and passes.
    if isinstance(step_kernel, triton.runtime.JITFunction if triton.knobs.runtime.interpret else InterpretedFunction):
        raise RuntimeError(
            "Triton's interpreter was switched " + ("on" if triton.knobs.runtime.interpret else "off") +
            " after this file was imported, and @triton.jit chose at import: set TRITON_INTERPRET=1 "
            "(for CPU tensors) or leave it unset (for a GPU) before importing this file"
        )
    for name, x in (("q", q), ("k", k), ("v", v), ("state", state)):
        if x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")
    if q.device.type != expected_device:
        where = "Triton's CPU interpreter" if expected_device == "cpu" else "the GPU"
        move = f"Move them with .to({expected_device!r})"
        if expected_device == "cuda" and not torch.cuda.is_available():
            move = ("This machine has no GPU: set TRITON_INTERPRET=1 before importing this file, and "
                    "Triton's interpreter runs it on CPU tensors")
        raise ValueError(f"the step kernel runs on {where} in this session, so q, k, v and state must be on "
                         f"{expected_device!r}; they are on {q.device}. {move}")
    D, E = q.shape[-1], v.shape[-1]
    if D < 1 or E < 1:
        raise ValueError(f"D and E must be at least 1, got D={D} (q, k) and E={E} (v)")
    if D > MAX_HEAD_DIM or E > MAX_HEAD_DIM:
        raise ValueError(f"the step kernel supports D and E up to {MAX_HEAD_DIM}; got D={D} (q, k) and E={E} (v)")
    expected = (*q.shape[:2], D, E + 1) if normalize else (*q.shape[:2], D, E)
    layout = "(B, H, D, E + 1) with z as its last column" if normalize else "(B, H, D, E)"
    if tuple(state.shape) != expected:
        raise ValueError(f"state must have shape {layout} = {expected} (normalize={normalize}), "
                         f"got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be float32, got {state.dtype}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: it is updated in place; make it once with "
                         ".contiguous() and keep passing that tensor")
    _check_no_gradient(q, k, v, state)


def _check_no_gradient(q, k, v, state):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or state.requires_grad):
        raise RuntimeError(
            "the generation step is inference only (it updates the state in place and has no backward), "
            "but an input requires grad: call it under torch.no_grad() or torch.inference_mode(), and "
            "train on whole sequences with a causal product (a kernel file's *_normalized_attention, or "
            "ttx_tutorial.causal_linear_attention)")


_INTERPRETER_LOCK_NAME = "serial_launch_lock"


def _launch_guard():
    """Triton's interpreter swaps triton.language's functions for its own while a kernel runs, so
    two threads interpreting at once break each other's launches. Under the interpreter every
    launch therefore holds one process-wide lock, kept on Triton's interpreter module so that every
    kernel file (and any copy of one) shares it; on a GPU launches go ahead unserialised."""
    if not triton.knobs.runtime.interpret:
        return contextlib.nullcontext()
    from triton.runtime import interpreter
    shared = vars(interpreter)
    lock = shared.get(_INTERPRETER_LOCK_NAME)  # made once: a lock per call would cost more than the lookup
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


# Signatures of arguments that check_inputs accepted. A generation loop passes the same shapes
# token after token, and the full checks cost several times the rest of the host's work.
_ACCEPTED: set = set()
_MAX_ACCEPTED = 1024


def _check_inputs_cached(q, k, v, state, feature_map, normalize, eps):
    """``check_inputs``, run in full only for a signature (shapes, dtypes, devices, options) not
    accepted before; what can differ between calls of one signature is checked every time."""
    signature = None
    # Written out, not a loop: this runs at every token. Nested tensors have no plain shape.
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and type(state) is torch.Tensor
            and not (q.is_nested or k.is_nested or v.is_nested or state.is_nested)):
        signature = (q.shape, k.shape, v.shape, state.shape, q.dtype, k.dtype, v.dtype, state.dtype,
                     q.layout, k.layout, v.layout, state.layout, q.device, k.device, v.device,
                     state.device, feature_map, normalize, type(normalize), eps, type(eps))  # 1 == True
        if signature in _ACCEPTED and state.is_contiguous():
            _check_no_gradient(q, k, v, state)
            return
    check_inputs(q, k, v, state, feature_map=feature_map, normalize=normalize, eps=eps)
    if signature is not None:
        if len(_ACCEPTED) >= _MAX_ACCEPTED:
            _ACCEPTED.clear()
        _ACCEPTED.add(signature)


def step_update(q, k, v, state, *, feature_map="elu", normalize=True, eps=1e-6):
    """One token: adds phi(k) [v, 1]^T (phi(k) v^T without ``normalize``) to ``state`` in place and
    returns o (B, H, E) in the dtype of q: phi(q)^T S / (phi(q)^T z + eps), or phi(q)^T S.
    q, k: (B, H, D); v: (B, H, E); state: see ``check_inputs``. Inference only."""
    _check_inputs_cached(q, k, v, state, feature_map, normalize, eps)
    return _launch(q, k, v, state, feature_map, normalize, float(eps))
