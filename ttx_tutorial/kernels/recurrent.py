"""The O(n) recurrent kernel: one program walks the sequence with its slice of the state in registers.

Algorithm
    Algorithm 1 of Katharopoulos et al., "Transformers are RNNs" (ICML 2020)::

        S_t = S_{t-1} + k_t v_t^T        (S_0 = initial state, zeros by default)
        o_t = S_t^T q_t

    One program owns one (batch, head) pair and one block of ``BLOCK_E`` value columns, holds
    ``S[:, e0:e0 + BLOCK_E]`` ([BLOCK_D, BLOCK_E], float32) in registers and walks t = 0 .. T-1
    (T-1 .. 0 when ``reverse`` is 1). Each token costs one outer product,
    ``k_t[:, None] * v_t[None, :]``, and one matrix-vector product,
    ``tl.sum(S * q_t[:, None], axis=0)``. There is no ``tl.dot``: a product with one row wastes
    the tensor cores, and tiny ``tl.dot`` blocks are what the Triton compiler once miscompiled
    and now refuses. Time O(T * D * E) per head, memory O(D * E) per program: linear in T.

Backward (the same kernel, four launches in all)
    Let dO be the gradient of o, G that of the final state (zeros when unused) and
    P_t = G + sum_{s >= t} q_s dO_s^T, the gradient reaching S_t. Then::

        dq_t = S_t dO_t      forward walk of (q=dO, k=v,  v=k)  from S_0^T
        dk_t = P_t v_t       reverse walk of (q=v,  k=dO, v=q)  from G^T
        dv_t = P_t^T k_t     reverse walk of (q=k,  k=q,  v=dO) from G, whose final state P_1 is dS_0

    The roles of D and E swap in the first two launches (their states are E x D), which get
    transposed views of S_0 and G without a copy. The direction and the two state flags
    are runtime integers, not constexprs: one compiled kernel per tile configuration serves all
    four launches, so CI compiles a quarter as many variants (Triton still specialises an
    integer argument equal to 1 when it launches).

Shapes and precision
    q, k: (B, H, T, D); v: (B, H, T, E); initial and final state (B, H, D, E) float32; any
    strides. T >= 0; 1 <= D, E <= 256 (blocks are powers of two, tails masked). Inputs float32,
    float16 or bfloat16; products and the state in float32; o in the input dtype.

Tuning (``config``)
    ``BLOCK_E`` (value columns per program), ``num_warps``, ``UNROLL`` (tokens per loop
    iteration) and ``num_stages`` (the software pipeline: the loads of ``num_stages - 1``
    iterations ahead are in flight while one iteration computes). ``default_config`` explains the
    rule; ``TUNING_CANDIDATES`` are the alternatives a benchmark should also try.

Tested
    Correctness under the Triton 3.9 interpreter (CPU); compiled for sm_90 without a GPU with
    Triton 3.6 and 3.9 (same layouts, every per-token load an asynchronous copy). GPU timings:
    ``benchmarks/gpu_check.py``.

Fragile
    * Speed depends on the register layout Triton chooses for the state. q_t and k_t are loaded
      as [BLOCK_D, BLOCK_E] tiles broadcast along E (every column reads the same addresses), so
      that the compiler's coalescing gives each thread a run of contiguous D elements: the sum
      over D is then mostly within a thread and needs few warp shuffles. v_t is loaded the same
      way and *before* k_t and q_t; with the other order Triton 3.6 and 3.9 both let v's layout
      win, and the sum over D spreads over all 32 lanes.
      ``tests/test_recurrent.py::test_default_bf16_launch_pipelines_every_load`` checks the
      compiled layout and loads; run it after a Triton upgrade.
    * The initial-state load takes part in that choice too: a state stored E-major (the usual
      (B, H, D, E) contiguous tensor) makes Triton 3.6 and 3.9 lay the whole loop out E-major.
      The wrapper therefore hands the kernel a D-major state (the transposed views of the
      backward already are; otherwise it copies D * E floats per head).
    * The per-token loads are pipelined (``cp.async`` on sm_80+) only when each thread copies
      at least 4 bytes; the v tile with BLOCK_E = 1 in 16-bit precision is too narrow, so the
      default rule keeps BLOCK_E >= 2.
    * The broadcast tiles pass through shared memory: 3 * BLOCK_D * BLOCK_E * itemsize bytes per
      token, times UNROLL * (num_stages - 1). The default rule stays under 48 KiB; a config from
      elsewhere can exceed the card's limit, and Triton then raises OutOfResources.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def recurrent_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B, H, T, D), (B, H, T, D), (B, H, T, E), (B, H, T, E)
    s0_ptr,  # initial state (B, H, D, E), float32; read only if has_initial_state
    sT_ptr,  # final state (B, H, D, E), float32, contiguous; written only if store_final_state
    T, H, D, E,
    reverse,  # 1: walk t = T-1 .. 0, so that the state sums the tokens s >= t
    has_initial_state, store_final_state,  # 0 or 1
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    BLOCK_D: tl.constexpr,  # power of two >= D: the whole key dimension
    BLOCK_E: tl.constexpr,  # value columns handled by this program
    UNROLL: tl.constexpr,  # tokens per loop iteration
    NUM_STAGES: tl.constexpr,  # software-pipeline depth of the token loop
):
    # The value block varies fastest across programs, so the programs sharing one head's q and k
    # run side by side and find those rows in cache.
    pid_e = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # 64-bit: b * stride_qb can exceed 2**31 on large batches
    h = (pid_bh % H).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    # Broadcast tiles [BLOCK_D, BLOCK_E]: every column of the q and k tiles points at the same
    # d, every row of the v tile at the same e (see "Fragile" in the module docstring for why).
    d_tile = tl.broadcast_to(offs_d[:, None], (BLOCK_D, BLOCK_E))
    e_tile = tl.broadcast_to(offs_e[None, :], (BLOCK_D, BLOCK_E))
    q_tile_ptr = q_ptr + b * stride_qb + h * stride_qh + d_tile * stride_qd
    k_tile_ptr = k_ptr + b * stride_kb + h * stride_kh + d_tile * stride_kd
    v_tile_ptr = v_ptr + b * stride_vb + h * stride_vh + e_tile * stride_ve
    o_row_ptr = o_ptr + b * stride_ob + h * stride_oh + offs_e * stride_oe
    # Rows d >= D of the state stay zero because k is masked to 0 there; columns e >= E because v is.
    mask_qk_tile = d_tile < D
    mask_v_tile = e_tile < E
    mask_state = mask_d[:, None] & mask_e[None, :]

    b_state = tl.zeros([BLOCK_D, BLOCK_E], dtype=tl.float32)
    if has_initial_state:
        s0_tile_ptr = (s0_ptr + b * stride_s0b + h * stride_s0h
                       + offs_d[:, None] * stride_s0d + offs_e[None, :] * stride_s0e)
        b_state += tl.load(s0_tile_ptr, mask=mask_state, other=0.0)

    # Step i of the walk reads token t = first + direction * i.
    first = reverse * (T - 1)
    direction = 1 - 2 * reverse
    for step0 in tl.range(0, T, UNROLL, num_stages=NUM_STAGES):
        # Unrolled: the UNROLL tokens' loads do not depend on the state, so they can all be in
        # flight together; only the state update chains from token to token.
        for j in tl.static_range(UNROLL):
            step = step0 + j
            t = first + direction * step
            # The last iteration may run past the sequence. The guard is built as a tile, not a
            # scalar: Triton 3.9's interpreter mistypes `tile_mask & scalar_bool` (int32, refused).
            in_seq = tl.full([BLOCK_D, BLOCK_E], step, tl.int32) < T
            in_seq_e = tl.full([BLOCK_E], step, tl.int32) < T
            # v first: the order decides the register layout (see "Fragile" above).
            b_v = tl.load(v_tile_ptr + t * stride_vt, mask=mask_v_tile & in_seq, other=0.0).to(tl.float32)
            b_k = tl.load(k_tile_ptr + t * stride_kt, mask=mask_qk_tile & in_seq, other=0.0).to(tl.float32)
            b_q = tl.load(q_tile_ptr + t * stride_qt, mask=mask_qk_tile & in_seq, other=0.0).to(tl.float32)
            b_state += b_k * b_v  # S_t = S_{t-1} + k_t v_t^T: an outer product, no reduction
            b_o = tl.sum(b_state * b_q, axis=0)  # o_t = S_t^T q_t: a sum over D
            tl.store(o_row_ptr + t * stride_ot, b_o.to(o_ptr.dtype.element_ty), mask=mask_e & in_seq_e)

    if store_final_state:
        sT_tile_ptr = sT_ptr + pid_bh.to(tl.int64) * D * E + offs_d[:, None] * E + offs_e[None, :]
        tl.store(sT_tile_ptr, b_state, mask=mask_state)


#: Keys a ``config`` dict may set.
CONFIG_KEYS = ("BLOCK_E", "num_warps", "UNROLL", "num_stages")

#: Shared memory the default rule allows for the pipelined tiles of one program.
_SHARED_MEMORY_BUDGET = 48 * 1024

#: Alternatives to the default rule worth timing on a new GPU (D = 64 in mind); see the docstring.
TUNING_CANDIDATES = (
    {"BLOCK_E": 2, "num_warps": 1, "UNROLL": 8, "num_stages": 3},   # few heads, deeper pipeline
    {"BLOCK_E": 4, "num_warps": 1, "UNROLL": 8, "num_stages": 3},
    {"BLOCK_E": 8, "num_warps": 1, "UNROLL": 4, "num_stages": 3},   # many heads, fewer programs
    {"BLOCK_E": 16, "num_warps": 2, "UNROLL": 4, "num_stages": 2},
)

#: SMs of an H100/H200: the rule's assumption when there is no GPU to ask (launches recorded or
#: compiled on a machine without one).
_NOMINAL_MULTIPROCESSORS = 132

_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _block_d(D: int) -> int:
    # At least 16: below that a warp has more lanes than elements, and tiny blocks are where the
    # compiler has historically struggled.
    return max(16, triton.next_power_of_2(D))


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _NOMINAL_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(B: int, H: int, D: int, E: int, dtype: torch.dtype, multiprocessors: int | None) -> dict:
    """The wrapper's rule for BLOCK_E, num_warps, UNROLL and num_stages.

    ``multiprocessors``: the GPU's SM count, or None under the interpreter.

    * BLOCK_E = 4 keeps 8 state elements per thread for D = 64 (BLOCK_D * BLOCK_E / 32): the
      per-token work is a few instructions per thread and the sum over D needs 3 shuffles.
      When B * H * E / 4 programs cannot give every SM four warps (long sequences, few heads),
      BLOCK_E drops to 2: twice the programs, each almost as fast. Never below 2, even for
      E = 1 (see the module docstring). The interpreter runs programs one after another, so
      there the rule takes large blocks instead: fewer, larger programs finish sooner.
    * One warp per program: the sum over D then never crosses warps (no shared memory, no
      barriers), and many small programs hide each other's latency.
    * UNROLL = 4 tokens per iteration, num_stages = 3: the loads of the next 8 tokens are in
      flight while 4 are computed; both shrink until the pipelined tiles fit the budget. Deeper
      pipelines are in ``TUNING_CANDIDATES``; they also take longer to compile.
    """
    block_d = _block_d(D)
    largest_e = triton.next_power_of_2(E)
    if multiprocessors is None:
        block_e = min(largest_e, max(1, 2048 // block_d))  # at most 64 state floats per thread
    else:
        block_e = 4 if largest_e >= 4 else 2  # E < 4: a masked column is cheaper than a narrow tile
        if block_e > 2 and B * H * triton.cdiv(E, block_e) < 4 * multiprocessors:
            block_e = 2
    unroll, num_stages = 4, 3
    bytes_per_token = 3 * block_d * block_e * dtype.itemsize
    while unroll * (num_stages - 1) * bytes_per_token > _SHARED_MEMORY_BUDGET and unroll > 1:
        if num_stages > 2:
            num_stages -= 1
        else:
            unroll //= 2
    return {"BLOCK_E": block_e, "num_warps": 1, "UNROLL": unroll, "num_stages": num_stages}


def _resolve_config(q, v, config):
    B, H, _, D = q.shape
    E = v.shape[-1]
    # The interpreter rule is for speed under TRITON_INTERPRET=1; ask Triton, not the device, so
    # that launches recorded with the interpreter switched off are the ones a GPU would make.
    multiprocessors = None if triton.knobs.runtime.interpret else _multiprocessor_count(q.device)
    chosen = default_config(B, H, D, E, q.dtype, multiprocessors)
    if config is not None:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {CONFIG_KEYS}")
        chosen.update(config)
    block_e = chosen["BLOCK_E"]
    if block_e < 1 or block_e & (block_e - 1):
        raise ValueError(f"BLOCK_E must be a power of two, got {block_e}")
    return chosen


def _launch(q, k, v, initial_state, *, reverse, store_final_state, config):
    """One walk over the sequence. Returns (o, final_state or None)."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    cfg = _resolve_config(q, v, config)
    o = torch.empty((B, H, T, E), dtype=q.dtype, device=q.device)
    final_state = (torch.empty((B, H, D, E), dtype=torch.float32, device=q.device)
                   if store_final_state else None)
    if B * H == 0:
        return o, final_state
    if initial_state is not None and initial_state.stride(-2) != 1:
        # D-major order for the starting state (a copy of D * E floats per head): loaded in
        # E-major order it would impose its layout on the whole loop (see "Fragile").
        initial_state = initial_state.mT.contiguous().mT
    # The kernel never touches a state pointer whose flag is 0, but it needs a float32 tensor.
    unused = torch.empty(0, dtype=torch.float32, device=q.device)
    s0 = initial_state if initial_state is not None else unused
    grid = (triton.cdiv(E, cfg["BLOCK_E"]), B * H)
    recurrent_kernel[grid](
        q, k, v, o, s0, final_state if store_final_state else unused,
        T, H, D, E, int(reverse), int(initial_state is not None), int(store_final_state),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        # Without a state, still D-major strides: the compiled loop must not depend on the flag.
        *(initial_state.stride() if initial_state is not None else (0, 0, 1, 0)),
        BLOCK_D=_block_d(D), BLOCK_E=cfg["BLOCK_E"], UNROLL=cfg["UNROLL"], NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, final_state


class _RecurrentCausalProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, initial_state, config):
        o, final_state = _launch(q, k, v, initial_state, reverse=False, store_final_state=True,
                                 config=config)
        ctx.save_for_backward(q, k, v, initial_state)
        ctx.config = config
        return o, final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, initial_state = ctx.saved_tensors
        if grad_o is None:  # only the final state was used
            grad_o = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
        need_q, need_k, need_v, need_s0, _ = ctx.needs_input_grad
        # S_0^T and G^T are views (.mT); _launch copies only G, to D-major order, for the dv walk.
        s0_t = initial_state.mT if initial_state is not None else None
        g = grad_final_state
        g_t = g.mT if g is not None else None
        dq = dk = dv = ds0 = None
        if need_q:  # dq_t = S_t dO_t
            dq, _ = _launch(grad_o, v, k, s0_t, reverse=False, store_final_state=False, config=ctx.config)
        if need_k:  # dk_t = P_t v_t
            dk, _ = _launch(v, grad_o, q, g_t, reverse=True, store_final_state=False, config=ctx.config)
        if need_v or need_s0:  # dv_t = P_t^T k_t, and P_1 = dS_0
            dv, ds0 = _launch(k, q, grad_o, g, reverse=True, store_final_state=need_s0, config=ctx.config)
        return dq, dk, (dv if need_v else None), ds0, None


def recurrent_causal_product(q, k, v, initial_state=None, *, config=None):
    """q, k: (B, H, T, D); v: (B, H, T, E); one dtype of float32/float16/bfloat16, one device.
    initial_state: None or (B, H, D, E) float32.  Returns (o, final_state): o (B, H, T, E) in the
    input dtype, final_state (B, H, D, E) float32.  Differentiable in q, k, v and initial_state.
    config: optional dict overriding the block sizes / num_warps the wrapper would choose
    (benchmarks sweep it); None means the wrapper's own rule."""
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)  # a no-op (and no copy) when already float32
    return _RecurrentCausalProduct.apply(q, k, v, initial_state, config)


def _signature(dtype: torch.dtype) -> dict:
    tensor = "*" + _TRITON_DTYPES[dtype]
    signature = {"q_ptr": tensor, "k_ptr": tensor, "v_ptr": tensor, "o_ptr": tensor,
                 "s0_ptr": "*fp32", "sT_ptr": "*fp32"}
    scalars = ["T", "H", "D", "E", "reverse", "has_initial_state", "store_final_state"]
    scalars += [f"stride_{x}{axis}" for x in "qk" for axis in "bhtd"]
    scalars += [f"stride_{x}{axis}" for x in "vo" for axis in "bhte"]
    scalars += [f"stride_s0{axis}" for axis in "bhde"]
    signature.update({name: "i32" for name in scalars})
    signature.update({name: "constexpr" for name in ("BLOCK_D", "BLOCK_E", "UNROLL", "NUM_STAGES")})
    return signature


def launch_variants():
    """Every kernel launch the wrappers can make: a list of dicts
    {"kernel": jit_fn, "signature": {arg: "*bf16" | "i32" | "fp32" | "constexpr", ...},
     "constexprs": {NAME: value}, "num_warps": int, "num_stages": int}
    covering each dtype and each config the wrapper's rule can choose. CI compiles them all for
    sm_80 and sm_90 without a GPU."""
    variants = []
    for dtype in _TRITON_DTYPES:
        # On a GPU the rule's choice depends only on BLOCK_D and on whether the grid fills the
        # card (BLOCK_E 4 or 2). The candidates are timed at D = 64 and 128.
        configs = [(block_d, default_config(1, heads, block_d, 64, dtype, _NOMINAL_MULTIPROCESSORS))
                   for block_d in (16, 32, 64, 128, 256) for heads in (1, 4096)]
        configs += [(block_d, dict(candidate)) for block_d in (64, 128) for candidate in TUNING_CANDIDATES]
        for index, (block_d, cfg) in enumerate(configs):
            if (block_d, cfg) in configs[:index]:
                continue
            variants.append({
                "kernel": recurrent_kernel,
                "signature": _signature(dtype),
                "constexprs": {"BLOCK_D": block_d, "BLOCK_E": cfg["BLOCK_E"], "UNROLL": cfg["UNROLL"],
                               "NUM_STAGES": cfg["num_stages"]},
                "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"],
            })
    return variants
