"""Recurrent causal dot product: one program walks the sequence with its slice of the state in registers.

Algorithm 1 of Katharopoulos et al., "Transformers are RNNs" (ICML 2020):
S_t = S_{t-1} + k_t v_t^T (S_0 = initial state, zeros by default), o_t = S_t^T q_t. One program
owns one (batch, head) and BLOCK_E value columns of S, in float32 registers, and walks t = 0 ..
T-1 (T-1 .. 0 when ``reverse`` is 1). No ``tl.dot``: a product with one row wastes the tensor
cores. Time O(T * D * E) per head, memory O(D * E) per program. Two walks (``config["WALK"]``):
  "tokens" (``recurrent_tokens_kernel``): one token per step, an outer product
      ``k_t[:, None] * v_t[None, :]`` and a sum over D; the fastest walk when the GPU is full.
  "blocks" (``recurrent_blocks_kernel``): BLOCK_T tokens per step, their states a prefix sum
      S_{i0-1} + tl.cumsum(k v^T) over a [BLOCK_T, BLOCK_D, BLOCK_E] tile. About twice the
      additions, but the steps of a block do not wait for each other, and D may be split over
      programs (float32 partial outputs, added on the host): for few (batch, head) pairs.
``default_config`` picks the walk; both give the same results up to rounding.
Backward: the same kernels, three launches. With dO the gradient of o and G that of S_T,
dq = forward walk of (dO, v, k) from S_0^T; dk = reverse walk of (v, dO, q) from G^T;
dv = reverse walk of (k, q, dO) from G, whose final state is dS_0. The direction and the state
flags are runtime integers, so one compiled kernel per tile configuration serves all four.
``NORMALIZE`` (``recurrent_normalized_attention``): out_t = o_t / (q_t . z_t + eps), z_t = z_0 +
sum_{s<=t} k_s in float32 beside S (states of E + 1 columns, z last); the blocks walk then holds
all of D. Its backward runs the three walks on g_t = dO_t / (q_t . z_t + eps), and with
``NORMALIZER_GRADIENT`` the dq and dk walks add the denominator's terms, r_t = -(g_t . out_t):
r_t z_t to dq_t, dz_s = G_z + sum_{t>=s} r_t q_t to dk_s (z and dz carried as a state row).

Shapes: q, k (B, H, T, D); v, o (B, H, T, E); states (B, H, D, E) float32; any strides; T >= 0;
1 <= D, E <= 256 (blocks are powers of two, tails masked). Offsets inside one (batch, head)
slice are int32: its last element must sit at an offset below 2**31. Inputs float32, float16 or bfloat16;
products and the state in float32; o in the input dtype. Packed (``IS_VARLEN``, ``cu_seqlens``
of N + 1 offsets): q, k, v, o hold N sequences along T of a batch of one, program row b walks
sequence b, tokens [cu_seqlens[b], cu_seqlens[b + 1]), and the states are (N, H, D, E).
Without a GPU: set TRITON_INTERPRET=1 before importing this file, since ``@triton.jit`` chooses
Triton's CPU interpreter at import; the wrappers refuse an interpreter switched on or off afterwards.
Tested: Triton 3.9's CPU interpreter; every launch compiled for sm_80 and sm_90 with Triton 3.6
and 3.9; the test suite on an H200 with Triton 3.6 (the packed launches, ``IS_VARLEN``, and the
normaliser, ``NORMALIZE`` and ``NORMALIZER_GRADIENT``, included); ``HALVES`` = 2 by this file's,
the packed sequences' and the operator's tests on an H100 with Triton 3.6.
Caveats: speed depends on the register layout Triton picks. The tokens walk holds the state as
[BLOCK_D, GROUPS, COLS] (GROUPS * COLS = BLOCK_E): k_t and q_t load as [BLOCK_D, GROUPS, 1]
tiles, each thread a 16-byte run of d, so COLS columns share one load and the sum over D is
mostly in-thread. A float32 row of 128 keys takes all 32 lanes that way; ``HALVES`` = 2 holds
the state as two [BLOCK_D / 2, GROUPS, COLS] tiles instead (rows d and d + BLOCK_D / 2 side by
side), whose k tiles leave lanes to the groups. GROUPS must equal the lanes the k tile leaves
(``_groups`` of BLOCK_D / HALVES rows), and any
[BLOCK_D, BLOCK_E] load can impose its layout on the loop: the initial state is therefore added
row by row. v is loaded as one [UNROLL, GROUPS, COLS] block so that Triton's pipeliner copies it
asynchronously. The blocks walk is fast only while its cumsum axis stays in each thread; larger
tiles spill. tests/test_recurrent.py checks the compiled layouts: run it after a Triton upgrade.
A config whose pipelined tiles exceed the GPU's shared memory fails at launch.
"""

from __future__ import annotations

import contextlib
import functools
import math
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
def _token(b_state, q_col_ptr, k_col_ptr, b_v, o_row_ptr, mask_col, mask_row, INTERPRETED: tl.constexpr):
    """One step of the walk: S += k v^T, o = S^T q (b_v: this token's [1, GROUPS, COLS] row)."""
    b_k = tl.load(k_col_ptr, mask=mask_col, other=0.0).to(tl.float32)  # [ROWS, GROUPS, 1], ROWS = BLOCK_D / HALVES
    b_q = tl.load(q_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_state += b_k * b_v  # S_t = S_{t-1} + k_t v_t^T: an outer product, no reduction
    # o_t = S_t^T q_t: a sum over D; keep_dims keeps the state's layout for the store.
    b_o = tl.sum(b_state * b_q, axis=0, keep_dims=True)
    tl.store(o_row_ptr, _rounded(b_o, o_row_ptr.dtype.element_ty, INTERPRETED), mask=mask_row)
    return b_state


@triton.jit
def _halves_token(b_state, b_state_hi, q_col_ptr, k_col_ptr, half_q, half_k, b_v, o_row_ptr, mask_col, mask_col_hi,
                  mask_row, INTERPRETED: tl.constexpr):
    """_token with the state's key rows in two tiles (HALVES = 2): rows d and d + BLOCK_D / 2 at
    the same place of each, k and q's second halves half_k and half_q elements further on. The
    products of both tiles are added before the sum over D, so the lanes reduce once."""
    b_k = tl.load(k_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_k_hi = tl.load(k_col_ptr + half_k, mask=mask_col_hi, other=0.0).to(tl.float32)
    b_q = tl.load(q_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_q_hi = tl.load(q_col_ptr + half_q, mask=mask_col_hi, other=0.0).to(tl.float32)
    b_state += b_k * b_v
    b_state_hi += b_k_hi * b_v
    b_o = tl.sum(b_state * b_q + b_state_hi * b_q_hi, axis=0, keep_dims=True)
    tl.store(o_row_ptr, _rounded(b_o, o_row_ptr.dtype.element_ty, INTERPRETED), mask=mask_row)
    return b_state, b_state_hi


@triton.jit
def _normalized_token(b_state, b_z, q_col_ptr, k_col_ptr, b_v, o_row_ptr, mask_col, mask_row, eps,
                      INTERPRETED: tl.constexpr):
    """_token with the normaliser: z += k, o = S^T q / (q . z + eps); returns (S, z, d + eps).
    z is a [ROWS, GROUPS, 1] tile in k's layout (every group holds the same z), and d + eps
    a [1, GROUPS, 1] row, all groups equal."""
    b_k = tl.load(k_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_q = tl.load(q_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_state += b_k * b_v
    b_z += b_k
    b_denominator = tl.sum(b_z * b_q, axis=0, keep_dims=True) + eps
    b_o = tl.sum(b_state * b_q, axis=0, keep_dims=True) / b_denominator
    tl.store(o_row_ptr, _rounded(b_o, o_row_ptr.dtype.element_ty, INTERPRETED), mask=mask_row)
    return b_state, b_z, b_denominator


@triton.jit
def _gradient_token(b_state, b_row_sum, q_col_ptr, k_col_ptr, b_v, o_row_ptr, r, mask_col, mask_row,
                    NORMALIZER_GRADIENT: tl.constexpr, INTERPRETED: tl.constexpr):
    """_token plus the denominator's term of a normalised backward walk, r = r_t this token's
    denominator gradient: the dq walk (1) sums the v rows (k_t: z_t) and adds r_t z_t; the dk walk
    (2) sums r_t times the v rows (q_t: dz_t) and adds dz_t."""
    b_k = tl.load(k_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_q = tl.load(q_col_ptr, mask=mask_col, other=0.0).to(tl.float32)
    b_state += b_k * b_v
    b_o = tl.sum(b_state * b_q, axis=0, keep_dims=True)
    if NORMALIZER_GRADIENT == 1:
        b_row_sum += b_v
        b_o += r * b_row_sum
    else:
        b_row_sum += r * b_v
        b_o += b_row_sum
    tl.store(o_row_ptr, _rounded(b_o, o_row_ptr.dtype.element_ty, INTERPRETED), mask=mask_row)
    return b_state, b_row_sum


@triton.jit
def recurrent_tokens_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B, H, T, D), (B, H, T, D), (B, H, T, E), (B, H, T, E)
    initial_state_ptr,  # (B, H, D, E), float32 (see NORMALIZE and NORMALIZER_GRADIENT); read only if has_initial_state
    final_state_ptr,  # (B, H, D, E) (as the initial state), float32, contiguous; written only if store_final_state
    cu_seqlens_ptr,  # IS_VARLEN: (B + 1,) token offsets of the sequences packed in one row
    T, H, D, E,
    reverse,  # 1: walk t = T-1 .. 0, so that the state sums the tokens s >= t
    has_initial_state, store_final_state,  # 0 or 1
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    # Last, so that the plain kernels' parameters keep their places (ptxas allocates registers
    # differently when they move, though nothing else changes).
    normalizer_ptr,  # (B, H, T) float32, contiguous: NORMALIZE writes d_t + eps, NORMALIZER_GRADIENT reads r_t
    eps,  # NORMALIZE: added once to each denominator
    BLOCK_D: tl.constexpr,  # power of two >= D: the whole key dimension
    BLOCK_E: tl.constexpr,  # value columns handled by this program
    COLS: tl.constexpr,  # value columns per thread (divides BLOCK_E)
    # 1, or 2: the state's key rows as two tiles of BLOCK_D / 2 rows, whose k and q tiles leave
    # more lanes to the groups (plain walks only: NORMALIZE and NORMALIZER_GRADIENT need 1)
    HALVES: tl.constexpr,
    UNROLL: tl.constexpr,  # tokens per loop iteration
    NUM_STAGES: tl.constexpr,  # software-pipeline depth of the token loop
    IS_VARLEN: tl.constexpr,  # q, k, v, o hold B sequences packed along T of one batch row
    NORMALIZE: tl.constexpr,  # divide o_t by d_t + eps, d_t = q_t . z_t, z_t = z_0 + sum_{s<=t} k_s
    # 0, or a walk of the normalised backward (see the header), whose states have one row more,
    # row D (z_0, or G's z column): 1, dq, adds r_t z_t; 2, dk, adds G_z + sum of r_s q_s (s >= t)
    NORMALIZER_GRADIENT: tl.constexpr,
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (see _rounded)
):
    """The tokens walk: one program per (batch, head, BLOCK_E value columns), one token a step."""
    # One flat grid, the value block varying fastest: the programs sharing one head's q and k run
    # side by side and find those rows in cache, and B * H is not capped at 65535 as grid axis 1 is.
    num_e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    pid_e = tl.program_id(0) % num_e_blocks
    pid_bh = tl.program_id(0) // num_e_blocks
    b = (pid_bh // H).to(tl.int64)  # 64-bit: b * stride_qb can exceed 2**31 on large batches
    h = (pid_bh % H).to(tl.int64)
    GROUPS: tl.constexpr = BLOCK_E // COLS
    ROWS: tl.constexpr = BLOCK_D // HALVES  # key rows of one state tile
    tl.static_assert(HALVES == 1 or (HALVES == 2 and not NORMALIZE and NORMALIZER_GRADIENT == 0))
    # Packed: b numbers the sequence (its states are row b), which is tokens [bos, eos) of row 0.
    input_b = b
    if IS_VARLEN:
        input_b = 0
        bos = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        if NORMALIZE or NORMALIZER_GRADIENT != 0:  # T is still the packed row's length here
            normalizer_ptr += h * T + bos
        T = (tl.load(cu_seqlens_ptr + b + 1) - bos).to(tl.int32)
        q_ptr += bos * stride_qt
        k_ptr += bos * stride_kt
        v_ptr += bos * stride_vt
        o_ptr += bos * stride_ot
    elif NORMALIZE or NORMALIZER_GRADIENT != 0:
        normalizer_ptr += (b * H + h) * T

    # State [ROWS, GROUPS, COLS] (and a second tile for rows ROWS.. with HALVES = 2); value
    # column offs_e[g, c] (see the header's caveats).
    offs_d = tl.arange(0, ROWS)
    offs_e = pid_e * BLOCK_E + tl.arange(0, GROUPS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    mask_d = offs_d < D
    mask_e = offs_e < E
    # Rows d >= D of the state stay zero because k is masked to 0 there; columns e >= E because v is.
    mask_row = mask_e[None, :, :]

    b_state = tl.zeros([ROWS, GROUPS, COLS], dtype=tl.float32)
    if HALVES == 2:
        b_state_hi = tl.zeros([ROWS, GROUPS, COLS], dtype=tl.float32)
    if has_initial_state:
        # Row by row, so that this load does not impose its layout on the loop.
        s0_row_ptr = initial_state_ptr + b * stride_s0b + h * stride_s0h + offs_e[None, :, :] * stride_s0e
        for d in range(0, D):
            b_row = tl.load(s0_row_ptr + d * stride_s0d, mask=mask_row, other=0.0)
            b_state += tl.where(offs_d[:, None, None] == d, b_row, 0.0)
            if HALVES == 2:
                b_state_hi += tl.where(offs_d[:, None, None] + ROWS == d, b_row, 0.0)

    # Step i of the walk reads token first + direction * i; the pointers move by one step a token.
    # tl.cast, not .to(): with T = 1 and reverse = 1 Triton passes both as constants, and the
    # product is then a Python int.
    first = tl.cast(reverse * (T - 1), tl.int64)
    direction = 1 - 2 * reverse
    d_tile = tl.broadcast_to(offs_d[:, None, None], (ROWS, GROUPS, 1))
    offs_u = tl.arange(0, UNROLL)
    if NORMALIZE:
        # z as k (see _normalized_token). d_t + eps belongs to no value block: the first block
        # stores it, from the first element of its row, once per iteration (a store per token
        # holds the registers of its pointers and masks, UNROLL times: 60 more at D = 64; a
        # [UNROLL, GROUPS, 1] block instead of the rows' shape, 17 more at D = 128).
        b_z = tl.zeros([ROWS, GROUPS, 1], dtype=tl.float32)
        if has_initial_state:
            z0_row_ptr = initial_state_ptr + b * stride_s0b + h * stride_s0h + E * stride_s0e
            for d in range(0, D):  # row by row, as the state
                b_z += tl.where(offs_d[:, None, None] == d, tl.load(z0_row_ptr + d * stride_s0d), 0.0)
        offs_row = (tl.arange(0, GROUPS)[:, None] * COLS + tl.arange(0, COLS)[None, :])[None, :, :]
        mask_denominator = offs_row + pid_e == 0  # element 0 of value block 0
        normalizer_ptr += first
        denominator_block_ptr = normalizer_ptr + (direction * offs_u)[:, None, None] + offs_row * 0
    if NORMALIZER_GRADIENT != 0:
        b_row_sum = tl.zeros([1, GROUPS, COLS], dtype=tl.float32)  # z_t or dz_t, in v's row layout
        if has_initial_state:
            b_row_sum += tl.load(initial_state_ptr + b * stride_s0b + h * stride_s0h + D * stride_s0d
                                 + offs_e[None, :, :] * stride_s0e, mask=mask_row, other=0.0)
        normalizer_ptr += first
    q_col_ptr = q_ptr + input_b * stride_qb + h * stride_qh + first * stride_qt + d_tile * stride_qd
    k_col_ptr = k_ptr + input_b * stride_kb + h * stride_kh + first * stride_kt + d_tile * stride_kd
    v_row_ptr = v_ptr + input_b * stride_vb + h * stride_vh + first * stride_vt + offs_e[None, :, :] * stride_ve
    o_row_ptr = o_ptr + input_b * stride_ob + h * stride_oh + first * stride_ot + offs_e[None, :, :] * stride_oe
    mask_col = d_tile < D
    mask_col_hi = d_tile + ROWS < D  # HALVES = 2: the second tile's rows
    half_q = ROWS * stride_qd
    half_k = ROWS * stride_kd
    step_q = direction * stride_qt
    step_k = direction * stride_kt
    step_v = direction * stride_vt
    step_o = direction * stride_ot
    # Whole iterations need no sequence mask; the last T % UNROLL tokens run one by one below.
    T_full = T - T % UNROLL
    for _ in tl.range(0, T_full, UNROLL, num_stages=NUM_STAGES):
        # The UNROLL tokens' v rows as one block, large enough to be copied asynchronously.
        b_v_block = tl.load(v_row_ptr + offs_u[:, None, None] * step_v, mask=mask_row, other=0.0).to(tl.float32)
        # Unrolled: the loads do not depend on the state, so they can all be in flight together;
        # only the state update chains from token to token.
        if NORMALIZE:
            b_denominator_block = tl.zeros([UNROLL, GROUPS, COLS], dtype=tl.float32)
        for j in tl.static_range(UNROLL):
            b_v = tl.sum(tl.where(offs_u[:, None, None] == j, b_v_block, 0.0), axis=0, keep_dims=True)
            if NORMALIZE:
                b_state, b_z, b_denominator = _normalized_token(b_state, b_z, q_col_ptr + j * step_q,
                                                                k_col_ptr + j * step_k, b_v, o_row_ptr + j * step_o,
                                                                mask_col, mask_row, eps, INTERPRETED)
                b_denominator_block = tl.where(offs_u[:, None, None] == j, b_denominator, b_denominator_block)
            elif NORMALIZER_GRADIENT != 0:
                b_state, b_row_sum = _gradient_token(b_state, b_row_sum, q_col_ptr + j * step_q, k_col_ptr + j * step_k,
                                                     b_v, o_row_ptr + j * step_o, tl.load(normalizer_ptr + j * direction),
                                                     mask_col, mask_row, NORMALIZER_GRADIENT, INTERPRETED)
            elif HALVES == 2:
                b_state, b_state_hi = _halves_token(b_state, b_state_hi, q_col_ptr + j * step_q, k_col_ptr + j * step_k,
                                                    half_q, half_k, b_v, o_row_ptr + j * step_o, mask_col,
                                                    mask_col_hi, mask_row, INTERPRETED)
            else:
                b_state = _token(b_state, q_col_ptr + j * step_q, k_col_ptr + j * step_k, b_v,
                                 o_row_ptr + j * step_o, mask_col, mask_row, INTERPRETED)
        q_col_ptr += UNROLL * step_q
        k_col_ptr += UNROLL * step_k
        v_row_ptr += UNROLL * step_v
        o_row_ptr += UNROLL * step_o
        if NORMALIZE:
            tl.store(denominator_block_ptr, b_denominator_block, mask=mask_denominator)
            denominator_block_ptr += UNROLL * direction
            normalizer_ptr += UNROLL * direction
        if NORMALIZER_GRADIENT != 0:
            normalizer_ptr += UNROLL * direction
    for _ in range(T_full, T):
        b_v = tl.load(v_row_ptr, mask=mask_row, other=0.0).to(tl.float32)
        if NORMALIZE:
            b_state, b_z, b_denominator = _normalized_token(b_state, b_z, q_col_ptr, k_col_ptr, b_v, o_row_ptr,
                                                            mask_col, mask_row, eps, INTERPRETED)
            tl.store(normalizer_ptr + offs_row * 0, b_denominator, mask=mask_denominator)
            normalizer_ptr += direction
        elif NORMALIZER_GRADIENT != 0:
            b_state, b_row_sum = _gradient_token(b_state, b_row_sum, q_col_ptr, k_col_ptr, b_v, o_row_ptr,
                                                 tl.load(normalizer_ptr), mask_col, mask_row, NORMALIZER_GRADIENT,
                                                 INTERPRETED)
            normalizer_ptr += direction
        elif HALVES == 2:
            b_state, b_state_hi = _halves_token(b_state, b_state_hi, q_col_ptr, k_col_ptr, half_q, half_k, b_v,
                                                o_row_ptr, mask_col, mask_col_hi, mask_row, INTERPRETED)
        else:
            b_state = _token(b_state, q_col_ptr, k_col_ptr, b_v, o_row_ptr, mask_col, mask_row, INTERPRETED)
        q_col_ptr += step_q
        k_col_ptr += step_k
        v_row_ptr += step_v
        o_row_ptr += step_o

    if store_final_state:
        width = E  # of a state row: E + 1 when z is its last column
        state_rows = D  # D + 1 when z or dz is the last row
        if NORMALIZE:
            width = E + 1
        if NORMALIZER_GRADIENT != 0:
            state_rows = D + 1
        final_tile_ptr = (final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + offs_d[:, None, None] * width
                          + offs_e[None, :, :])
        tl.store(final_tile_ptr, b_state, mask=mask_d[:, None, None] & mask_row)
        if HALVES == 2:
            tl.store(final_tile_ptr + ROWS * width, b_state_hi, mask=(offs_d[:, None, None] + ROWS < D) & mask_row)
        if NORMALIZER_GRADIENT != 0:
            tl.store(final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + D * width + offs_e[None, :, :], b_row_sum,
                     mask=mask_row)
        if NORMALIZE:
            # From element 0 of the first block's rows, like d_t + eps.
            tl.store(final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + offs_d[:, None, None] * width + E
                     + offs_row * 0, tl.broadcast_to(b_z, (ROWS, GROUPS, COLS)),
                     mask=mask_d[:, None, None] & mask_denominator)


@triton.jit
def recurrent_blocks_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (B, H, T, D), (B, H, T, D), (B, H, T, E); o: see stride_o_split
    initial_state_ptr,  # (B, H, D, E), float32 (see NORMALIZE and NORMALIZER_GRADIENT); read only if has_initial_state
    final_state_ptr,  # (B, H, D, E) (as the initial state), float32, contiguous; written only if store_final_state
    cu_seqlens_ptr,  # IS_VARLEN: (B + 1,) token offsets of the sequences packed in one row
    T, H, D, E,
    reverse,  # 1: walk t = T-1 .. 0, so that the state sums the tokens s >= t
    has_initial_state, store_final_state,  # 0 or 1
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    stride_o_split,  # with several key blocks, o is float32 (key blocks, B, H, T, E): block j's part at j * this
    normalizer_ptr, eps,  # as in recurrent_tokens_kernel
    BLOCK_D: tl.constexpr,  # key rows of the state per program (power of two)
    BLOCK_E: tl.constexpr,  # value columns per program
    BLOCK_T: tl.constexpr,  # steps of the walk handled at once
    NUM_STAGES: tl.constexpr,  # software-pipeline depth of the block loop
    IS_VARLEN: tl.constexpr,  # as in recurrent_tokens_kernel
    NORMALIZE: tl.constexpr,  # as in recurrent_tokens_kernel; needs the whole key dimension (BLOCK_D >= D)
    NORMALIZER_GRADIENT: tl.constexpr,  # as in recurrent_tokens_kernel
    INTERPRETED: tl.constexpr,  # as in recurrent_tokens_kernel
):
    """The same walk, BLOCK_T steps at a time: the states of a block come from one tl.cumsum."""
    # One flat grid: value block fastest, then key block, then (batch, head).
    num_e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    num_d_blocks = (D + BLOCK_D - 1) // BLOCK_D
    pid_e = tl.program_id(0) % num_e_blocks
    pid_d = tl.program_id(0) // num_e_blocks % num_d_blocks
    pid_bh = tl.program_id(0) // (num_e_blocks * num_d_blocks)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    input_b = b  # packed sequences: as in recurrent_tokens_kernel
    if IS_VARLEN:
        input_b = 0
        bos = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        if NORMALIZE or NORMALIZER_GRADIENT != 0:
            normalizer_ptr += h * T + bos
        T = (tl.load(cu_seqlens_ptr + b + 1) - bos).to(tl.int32)
        q_ptr += bos * stride_qt
        k_ptr += bos * stride_kt
        v_ptr += bos * stride_vt
        o_ptr += bos * stride_ot
    elif NORMALIZE or NORMALIZER_GRADIENT != 0:
        normalizer_ptr += (b * H + h) * T

    offs_i = tl.arange(0, BLOCK_T)  # step i0 + i of the walk is row i of a block
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E

    # This program's slice of the state, S[d0:d0 + BLOCK_D, e0:e0 + BLOCK_E], in float32.
    b_state = tl.zeros([BLOCK_D, BLOCK_E], dtype=tl.float32)
    if has_initial_state:
        # Row by row, so that this load does not impose its layout on the loop.
        s0_row_ptr = initial_state_ptr + b * stride_s0b + h * stride_s0h + offs_e[None, :] * stride_s0e
        for d in range(pid_d * BLOCK_D, tl.minimum(D, (pid_d + 1) * BLOCK_D)):
            b_row = tl.load(s0_row_ptr + d * stride_s0d, mask=mask_e[None, :], other=0.0)
            b_state += tl.where(offs_d[:, None] == d, b_row, 0.0)
    if NORMALIZE:  # z: the sum of the keys so far (this program holds every key row)
        b_z = tl.zeros([BLOCK_D], dtype=tl.float32)
        if has_initial_state:
            b_z = tl.load(initial_state_ptr + b * stride_s0b + h * stride_s0h + offs_d * stride_s0d + E * stride_s0e,
                          mask=mask_d, other=0.0)
    if NORMALIZER_GRADIENT != 0:  # z_t or dz_t (see recurrent_tokens_kernel); key block 0 adds its term
        b_row_sum = tl.zeros([BLOCK_E], dtype=tl.float32)
        if has_initial_state:
            b_row_sum += tl.load(initial_state_ptr + b * stride_s0b + h * stride_s0h + D * stride_s0d
                                 + offs_e * stride_s0e, mask=mask_e, other=0.0)

    # Step i reads token first + direction * i (tl.cast: see recurrent_tokens_kernel). The offsets
    # within a block are 32-bit: 64-bit ones for every element would double the registers of
    # the pointer tiles, and the block loop then spills.
    first = tl.cast(reverse * (T - 1), tl.int64)
    direction = 1 - 2 * reverse
    rows = (direction * offs_i)[:, None]
    q_block_ptr = (q_ptr + input_b * stride_qb + h * stride_qh + first * stride_qt) + rows * stride_qt + offs_d[None, :] * stride_qd
    k_block_ptr = (k_ptr + input_b * stride_kb + h * stride_kh + first * stride_kt) + rows * stride_kt + offs_d[None, :] * stride_kd
    v_block_ptr = (v_ptr + input_b * stride_vb + h * stride_vh + first * stride_vt) + rows * stride_vt + offs_e[None, :] * stride_ve
    o_block_ptr = ((o_ptr + pid_d.to(tl.int64) * stride_o_split + input_b * stride_ob + h * stride_oh + first * stride_ot)
                   + rows * stride_ot + offs_e[None, :] * stride_oe)
    if NORMALIZE:
        denominator_block_ptr = normalizer_ptr + first + direction * offs_i
        stored_tokens = tl.where(pid_e == 0, T, 0)  # d_t + eps and z belong to no value block
    if NORMALIZER_GRADIENT != 0:
        r_block_ptr = normalizer_ptr + first + direction * offs_i
    for i0 in tl.range(0, T, BLOCK_T, num_stages=NUM_STAGES):
        mask_i = i0 + offs_i < T  # rows past the end load zeros: they add nothing to the state
        b_k = tl.load(k_block_ptr, mask=mask_i[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        b_q = tl.load(q_block_ptr, mask=mask_i[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v_block_ptr, mask=mask_i[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
        # [BLOCK_T, BLOCK_D, BLOCK_E]: the outer product k_t v_t^T of every step, and their
        # running sum, which is S_t - S_{i0 - 1}: a prefix sum over the block's steps.
        b_kv = b_k[:, :, None] * b_v[:, None, :]
        b_states = b_state[None, :, :] + tl.cumsum(b_kv, axis=0)
        # o_t = S_t^T q_t for every step at once: the sums over D are independent of each other.
        b_o = tl.sum(b_states * b_q[:, :, None], axis=1)
        if NORMALIZE:
            # d_t + eps = q_t . z_t + eps, z_t a prefix sum of the block's keys; the first value block stores it.
            b_denominator = tl.sum((b_z[None, :] + tl.cumsum(b_k, axis=0)) * b_q, axis=1) + eps
            b_o = b_o / b_denominator[:, None]
            tl.store(denominator_block_ptr, b_denominator, mask=i0 + offs_i < stored_tokens)
            b_z += tl.sum(b_k, axis=0)
            denominator_block_ptr += direction * BLOCK_T
        if NORMALIZER_GRADIENT != 0:
            b_r = tl.load(r_block_ptr, mask=mask_i, other=0.0)
            if NORMALIZER_GRADIENT == 1:  # z_t = the row sum so far plus the block's v rows up to t
                b_row_sums = b_row_sum[None, :] + tl.cumsum(b_v, axis=0)
                b_term = b_r[:, None] * b_row_sums
                b_row_sum += tl.sum(b_v, axis=0)
            else:  # dz_t likewise, of r_t v_t
                b_rv = b_r[:, None] * b_v
                b_term = b_row_sum[None, :] + tl.cumsum(b_rv, axis=0)
                b_row_sum += tl.sum(b_rv, axis=0)
            b_o += tl.where(pid_d == 0, b_term, 0.0)
            r_block_ptr += direction * BLOCK_T
        tl.store(o_block_ptr, _rounded(b_o, o_block_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_i[:, None] & mask_e[None, :])
        b_state += tl.sum(b_kv, axis=0)
        q_block_ptr += direction * BLOCK_T * stride_qt
        k_block_ptr += direction * BLOCK_T * stride_kt
        v_block_ptr += direction * BLOCK_T * stride_vt
        o_block_ptr += direction * BLOCK_T * stride_ot

    if store_final_state:
        width = E  # of a state row: E + 1 when z is its last column
        state_rows = D  # D + 1 when z or dz is the last row
        if NORMALIZE:
            width = E + 1
        if NORMALIZER_GRADIENT != 0:
            state_rows = D + 1
        final_tile_ptr = (final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + offs_d[:, None] * width
                          + offs_e[None, :])
        tl.store(final_tile_ptr, b_state, mask=mask_d[:, None] & mask_e[None, :])
        if NORMALIZE:
            tl.store(final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + offs_d * width + E, b_z,
                     mask=offs_d < tl.where(pid_e == 0, D, 0))
        if NORMALIZER_GRADIENT != 0:
            tl.store(final_state_ptr + pid_bh.to(tl.int64) * state_rows * width + D * width + offs_e, b_row_sum,
                     mask=offs_e < tl.where(pid_d == 0, E, 0))


#: The two walks: "tokens" (recurrent_tokens_kernel, one token per step) and "blocks"
#: (recurrent_blocks_kernel, BLOCK_T tokens per step), and the ``config`` keys each one reads.
WALK_KEYS = {
    "tokens": ("BLOCK_E", "COLS", "HALVES", "UNROLL", "num_warps", "num_stages"),
    "blocks": ("BLOCK_D", "BLOCK_E", "BLOCK_T", "num_warps", "num_stages"),
}

#: Keys a ``config`` may set: "WALK" picks the walk (without it, the rule's walk if it reads
#: every key given, else the walk that does); the others belong to one walk each.
CONFIG_KEYS = ("WALK", *dict.fromkeys(WALK_KEYS["tokens"] + WALK_KEYS["blocks"]))

#: Shared memory the default rule allows for the pipelined tiles of one program.
_SHARED_MEMORY_BUDGET = 48 * 1024

#: Alternatives to the default rule worth timing on a new GPU (D = 64 and 128 in mind).
TUNING_CANDIDATES = (
    {"WALK": "tokens", "BLOCK_E": 8, "COLS": 2, "HALVES": 1, "num_warps": 1, "UNROLL": 8, "num_stages": 3},  # many heads, D=64 rule
    {"WALK": "tokens", "BLOCK_E": 8, "COLS": 2, "HALVES": 1, "num_warps": 1, "UNROLL": 8, "num_stages": 2},  # half the smem
    {"WALK": "tokens", "BLOCK_E": 16, "COLS": 4, "HALVES": 1, "num_warps": 1, "UNROLL": 4, "num_stages": 3},  # fewest instructions
    {"WALK": "tokens", "BLOCK_E": 4, "COLS": 1, "HALVES": 1, "num_warps": 1, "UNROLL": 16, "num_stages": 3},  # few heads
    {"WALK": "tokens", "BLOCK_E": 8, "COLS": 4, "HALVES": 1, "num_warps": 1, "UNROLL": 8, "num_stages": 3},  # bf16 D=128 rule
    {"WALK": "tokens", "BLOCK_E": 16, "COLS": 8, "HALVES": 2, "num_warps": 1, "UNROLL": 4, "num_stages": 3},  # fp32 D=128 rule
    {"WALK": "tokens", "BLOCK_E": 16, "COLS": 8, "HALVES": 2, "num_warps": 1, "UNROLL": 8, "num_stages": 2},  # 8 tokens a step
    {"WALK": "tokens", "BLOCK_E": 8, "COLS": 4, "HALVES": 2, "num_warps": 1, "UNROLL": 4, "num_stages": 3},  # the same, few heads
    {"WALK": "blocks", "BLOCK_D": 32, "BLOCK_E": 4, "BLOCK_T": 32, "num_warps": 1, "num_stages": 3},  # few heads rule
    {"WALK": "blocks", "BLOCK_D": 16, "BLOCK_E": 8, "BLOCK_T": 32, "num_warps": 1, "num_stages": 3},  # 4 key blocks
    {"WALK": "blocks", "BLOCK_D": 32, "BLOCK_E": 4, "BLOCK_T": 16, "num_warps": 1, "num_stages": 3},
    {"WALK": "blocks", "BLOCK_D": 64, "BLOCK_E": 4, "BLOCK_T": 16, "num_warps": 1, "num_stages": 3},  # D = 64 unsplit
)

#: (multiprocessors, shared memory per block) of an H100/H200, assumed where no GPU answers
#: (launches recorded or compiled on a machine without one).
_NOMINAL_LIMITS = (132, 232448)


def check_config(config):
    """A TypeError or ValueError naming the key and its limit for a config the kernels cannot run:
    WALK "tokens" or "blocks" (and then only that walk's keys), the block sizes (BLOCK_E, COLS,
    UNROLL, BLOCK_D, BLOCK_T) powers of two, HALVES 1 or 2, num_warps a power of two up to 32,
    num_stages at least 1."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {CONFIG_KEYS}")
    if "WALK" in config:
        walk = config["WALK"]
        if not isinstance(walk, str) or walk not in WALK_KEYS:
            raise ValueError(f"WALK must be one of {tuple(WALK_KEYS)}, got {walk!r}")
        stray = set(config) - {"WALK", *WALK_KEYS[walk]}
        if stray:
            raise ValueError(f"config keys {sorted(stray)} do not apply to WALK={walk!r}, which reads "
                             f"{WALK_KEYS[walk]}")
    for name, value in config.items():
        if name in ("WALK", "num_warps", "num_stages"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value!r}")
    if config.get("HALVES", 1) not in (1, 2):
        raise ValueError(f"HALVES must be 1 or 2 (the state's key rows in one tile or two), got {config['HALVES']!r}")
    warps, stages = config.get("num_warps", 1), config.get("num_stages", 1)
    if not isinstance(warps, int) or isinstance(warps, bool) or not 1 <= warps <= 32 or warps & (warps - 1):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {warps!r}")
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"num_stages must be an int of at least 1, got {stages!r}")


@functools.lru_cache(maxsize=None)  # asked at every launch; triton.next_power_of_2 costs a microsecond
def _block_d(D: int) -> int:
    # At least 16: below that a warp has more lanes than elements.
    return max(16, triton.next_power_of_2(D))


def _groups(block_d: int, itemsize: int, num_warps: int = 1) -> int:
    """Lanes the coalesced [BLOCK_D, GROUPS, 1] k tile leaves for the groups: each thread takes a
    16-byte run of d, the other lanes of the warps go to the groups."""
    per_thread = 16 // itemsize
    return max(1, 32 * num_warps * per_thread // block_d)


def _shared_memory_bytes(block_d: int, cfg: dict, itemsize: int) -> int:
    """Shared memory of the tokens walk's pipelined loads: the k and q tiles and the v row of each token."""
    groups = cfg["BLOCK_E"] // cfg["COLS"]
    per_token = (2 * block_d * groups + cfg["BLOCK_E"]) * itemsize
    return cfg["UNROLL"] * (cfg["num_stages"] - 1) * per_token


def _blocks_config(D: int) -> dict:
    """The blocks walk's rule: 32 key rows and 4 value columns a program (two programs share
    D = 64 and add their partial outputs), 32 steps a block, one warp, 3 stages."""
    return {"WALK": "blocks", "BLOCK_D": min(32, _block_d(D)), "BLOCK_E": 4, "BLOCK_T": 32, "num_warps": 1,
            "num_stages": 3}


def _normalized_blocks_config(D: int, dtype: torch.dtype) -> dict:
    """The blocks walk's rule when it normalises: the denominator sums over the whole key
    dimension, so one program holds all of it, with 8 steps a block (16 spill at D = 64: the
    keys' prefix sum for the denominator needs registers of its own) and 16 bytes of v a step
    (the pipeliner leaves a v block of 8 x 4 16-bit values to a plain load)."""
    return {**_blocks_config(D), "BLOCK_D": _block_d(D), "BLOCK_E": 16 // dtype.itemsize, "BLOCK_T": 8}


@functools.lru_cache(maxsize=None)  # asked once per device, not at every launch
def _device_limits(device):
    """(multiprocessors, opt-in shared memory per block) of a GPU; an H100/H200's elsewhere."""
    if device.type != "cuda":
        return _NOMINAL_LIMITS
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin


def default_config(B: int, H: int, D: int, E: int, dtype: torch.dtype, multiprocessors: int | None,
                   plain: bool = True) -> dict:
    """The wrapper's rule: which walk, and its block sizes, num_warps and num_stages.

    ``multiprocessors``: the GPU's count, or None under the interpreter. ``plain``: False for the
    walks of the normalised attention (NORMALIZE, NORMALIZER_GRADIENT), which keep one state tile.

    * Many (batch, head) pairs, or D > 64: the tokens walk (``_tokens_config``), one warp per
      program (the sum over D never crosses warps; many small programs hide each other's
      latency). GROUPS = the lanes the k tile leaves (``_groups``), BLOCK_E = 8 at least (one
      column per group), UNROLL = 8 and 3 stages, shrunk until the pipelined tiles fit the budget.
      float32 with BLOCK_D = 128, plain walks: the state's key rows in two tiles (HALVES = 2).
      One 128-row float32 k tile takes all 32 lanes (4 floats each), so GROUPS = 1 and every
      column's sum over D costs 5 shuffle rounds; two 64-row tiles take 16 lanes each, so two
      groups share the warp, and each thread adds its two tiles' products before one reduction
      over 16 lanes (4 rounds). UNROLL 4 and 3 stages; BLOCK_E = 16 (COLS 8) where those
      programs number at least 4 a multiprocessor, else BLOCK_E = 8 (COLS 4). Of the tiles timed
      for every walk of the forward and backward at (8, 16, 4096, 128) and (2, 16, 16384, 128)
      on an H100, the fastest within 1 % (benchmarks/NOTES.md).
    * Fewer than 3 tokens-walk programs per multiprocessor and D <= 64: the blocks walk
      (``_blocks_config``). A warp alone on its scheduler is then bound by the latency of each
      token's chain of dependent instructions, which the blocks walk's independent steps avoid;
      with more programs its extra arithmetic costs more than it saves.
    * The interpreter runs programs one after another, each step one NumPy operation on a whole
      tile, so its time follows the number of steps: there the blocks walk with whole key rows,
      up to 2048 / BLOCK_D value columns and 64 tokens a block, which takes the fewest
      (benchmarks/NOTES.md times it against the tokens walk). Normalising, it keeps these sizes.
    """
    block_d = _block_d(D)
    largest_e = triton.next_power_of_2(E)
    if multiprocessors is None:
        return {"WALK": "blocks", "BLOCK_D": block_d, "BLOCK_E": min(largest_e, max(1, 2048 // block_d)),
                "BLOCK_T": 64, "num_warps": 1, "num_stages": 1}
    tokens = _tokens_config(D, dtype, B * H * triton.cdiv(E, 16) >= 4 * multiprocessors if plain else None)
    if B * H * triton.cdiv(E, tokens["BLOCK_E"]) < 3 * multiprocessors and block_d <= 64:
        return _blocks_config(D)
    return tokens


def _tokens_config(D: int, dtype: torch.dtype, many_programs: bool | None = False) -> dict:
    """The tokens walk's rule (see ``default_config``). ``many_programs``: whether 16-column
    programs would number at least 4 a multiprocessor; None for a walk of the normalised
    attention (one state tile)."""
    block_d = _block_d(D)
    if dtype == torch.float32 and block_d == 128 and many_programs is not None:
        block_e = 16 if many_programs else 8
        return {"WALK": "tokens", "BLOCK_E": block_e, "COLS": block_e // _groups(64, 4), "HALVES": 2,
                "num_warps": 1, "UNROLL": 4, "num_stages": 3}
    groups = _groups(block_d, dtype.itemsize)
    block_e = max(8, groups)
    cfg = {"WALK": "tokens", "BLOCK_E": block_e, "COLS": max(1, block_e // groups), "HALVES": 1, "num_warps": 1,
           "UNROLL": 8, "num_stages": 3}
    while _shared_memory_bytes(block_d, cfg, dtype.itemsize) > _SHARED_MEMORY_BUDGET and cfg["UNROLL"] > 1:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            cfg["UNROLL"] //= 2
    return cfg


# The rule costs microseconds of Python, a sizeable part of a small call's host time. Callers
# must not modify the dict it returns.
_cached_default_config = functools.lru_cache(maxsize=256)(default_config)


def _resolve_config(q, v, config, cu_seqlens=None, normalized=False, plain=True):
    """The rule for these inputs with the caller's (checked) keys applied (packed: B sequences).
    ``normalized``: for the NORMALIZE forward, whose blocks walk holds every key row. ``plain``:
    False for the normalised attention's walks, which hold the state in one tile (HALVES = 1)."""
    B, H, _, D = q.shape
    E = v.shape[-1]
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    # The interpreter rule is for speed under TRITON_INTERPRET=1; ask Triton, not the device, so
    # that launches recorded with the interpreter switched off are the ones a GPU would make.
    multiprocessors = None if triton.knobs.runtime.interpret else _device_limits(q.device)[0]
    chosen = _cached_default_config(B, H, D, E, q.dtype, multiprocessors, plain)
    if normalized and chosen["WALK"] == "blocks" and multiprocessors is not None:
        chosen = _normalized_blocks_config(D, q.dtype)
    if config is None:
        return chosen
    # Without "WALK": the rule's walk if it reads every key given, else the walk that does.
    readers = [walk for walk, keys in WALK_KEYS.items() if set(config) <= set(keys)]
    walk = config.get("WALK", chosen["WALK"] if chosen["WALK"] in readers or not readers else readers[0])
    stray = set(config) - {"WALK", *WALK_KEYS[walk]}
    if stray:
        raise ValueError(f"config keys {sorted(stray)} do not apply to WALK={walk!r}, which reads "
                         f"{WALK_KEYS[walk]}")
    if walk != chosen["WALK"]:  # the other walk's rule as the base
        blocks_rule = _normalized_blocks_config(D, q.dtype) if normalized else _blocks_config(D)
        chosen = blocks_rule if walk == "blocks" else _tokens_config(D, q.dtype, False if plain else None)
    chosen = {**chosen, **config}  # a copy: the cached rule's dict is shared
    if walk == "tokens" and not plain and chosen["HALVES"] != 1:
        raise ValueError("HALVES must be 1 for the normalised attention: its walks hold the state, z or dz "
                         f"in one tile; got {chosen['HALVES']}")
    # The rule's groups, if they fit: the lanes one tile of BLOCK_D / HALVES key rows leaves.
    if walk == "tokens" and ("BLOCK_E" in config or "HALVES" in config) and "COLS" not in config:
        groups = _groups(_block_d(D) // chosen["HALVES"], q.dtype.itemsize, chosen["num_warps"])
        chosen["COLS"] = max(1, chosen["BLOCK_E"] // groups)
    if walk == "tokens" and chosen["COLS"] > chosen["BLOCK_E"]:
        raise ValueError(f"COLS ({chosen['COLS']}) must not exceed BLOCK_E ({chosen['BLOCK_E']})")
    if walk == "blocks":
        # At most the whole key dimension: the backward walks reuse the forward's config with
        # the roles of D and E swapped, so a BLOCK_D that splits D may hold all of E.
        chosen["BLOCK_D"] = min(chosen["BLOCK_D"], _block_d(D))
        if normalized and chosen["BLOCK_D"] < D:
            raise ValueError(f"BLOCK_D ({chosen['BLOCK_D']}) must cover D ({D}) when normalising: the "
                             "denominator q_t . z_t sums over the whole key dimension in one program")
    return chosen


@functools.lru_cache(maxsize=None)
def _no_state(device):
    """An empty float32 tensor: the pointer of an absent state, never followed. Empty, it holds no
    memory, so one per device serves every launch (CUDA-graph captures included)."""
    return torch.empty(0, dtype=torch.float32, device=device)


def _launch(q, k, v, initial_state, *, reverse, store_final_state, config, cu_seqlens=None, denominator=None,
            eps=0.0, gradient_walk=0, r=None):
    """One walk over the sequence. Returns (o, final_state or None). With ``cu_seqlens``, one
    walk per packed sequence, and the states are (N, H, D, E). With ``denominator``, a (B, H, T)
    float32 tensor that receives d_t + eps, the normalised forward (NORMALIZE): its states have
    E + 1 columns, z last. ``gradient_walk`` 1 or 2 with ``r``, (B, H, T) float32: a walk of the
    normalised backward (NORMALIZER_GRADIENT), whose states have D + 1 rows."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    normalize = denominator is not None
    cfg = _resolve_config(q, v, config, cu_seqlens, normalize, plain=not normalize and gradient_walk == 0)
    o = torch.empty_like(v, dtype=q.dtype)  # laid out as v, as in chunked
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    final_state = (torch.empty((B, H, D + (gradient_walk != 0), E + normalize), dtype=torch.float32, device=q.device)
                   if store_final_state else None)
    if B * H == 0:
        return o, final_state
    # The kernel never touches a state pointer whose flag is 0, but it needs a float32 tensor.
    unused = _no_state(q.device)
    s0 = initial_state if initial_state is not None else unused
    pointers = (s0, final_state if store_final_state else unused, unused if cu_seqlens is None else cu_seqlens)
    arguments = (T, H, D, E, int(reverse), int(initial_state is not None), int(store_final_state),
                 *q.stride(), *k.stride(), *v.stride())
    normalizer = (denominator if normalize else r if gradient_walk else unused, float(eps))
    s0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    if cfg["WALK"] == "tokens":
        grid = (-(-E // cfg["BLOCK_E"]) * B * H,)  # rounded up, as triton.cdiv without its host cost
        with _launch_guard():
            recurrent_tokens_kernel[grid](
                q, k, v, o, *pointers, *arguments, *o.stride(), *s0_strides, *normalizer,
                BLOCK_D=_block_d(D), BLOCK_E=cfg["BLOCK_E"], COLS=cfg["COLS"], HALVES=cfg["HALVES"], UNROLL=cfg["UNROLL"],
                NUM_STAGES=cfg["num_stages"], IS_VARLEN=cu_seqlens is not None, NORMALIZE=normalize,
                NORMALIZER_GRADIENT=gradient_walk, INTERPRETED=triton.knobs.runtime.interpret,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            )
        return o, final_state
    key_blocks = -(-D // cfg["BLOCK_D"])
    # Several key blocks each write their part of o's sum over D, in float32; they add up below.
    parts = (torch.empty((key_blocks, *o.shape), dtype=torch.float32, device=q.device)
             if key_blocks > 1 else o[None])
    grid = (-(-E // cfg["BLOCK_E"]) * key_blocks * B * H,)
    with _launch_guard():
        recurrent_blocks_kernel[grid](
            q, k, v, parts, *pointers, *arguments, *parts.stride()[1:], *s0_strides,
            parts.stride(0) if key_blocks > 1 else 0, *normalizer,
            BLOCK_D=cfg["BLOCK_D"], BLOCK_E=cfg["BLOCK_E"], BLOCK_T=cfg["BLOCK_T"], NUM_STAGES=cfg["num_stages"],
            IS_VARLEN=cu_seqlens is not None, NORMALIZE=normalize, NORMALIZER_GRADIENT=gradient_walk,
            INTERPRETED=triton.knobs.runtime.interpret, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if key_blocks > 1:
        # In float32, rounded once into o (torch.sum with a 16-bit out= would round each part).
        total = parts[0]
        for part in parts[1:-1]:
            total = total + part
        torch.add(total, parts[-1], out=o)
    return o, final_state


#: Why a backward recorded for a gradient of the gradient (create_graph=True) is refused: the
#: backward kernels are not differentiable themselves, so that gradient would silently miss terms.
SECOND_ORDER_REFUSAL = ("a gradient of these gradients (create_graph=True) is not supported: the backward "
                        "kernels are not differentiable themselves")


class _RecurrentCausalProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, initial_state, config, cu_seqlens):
        o, final_state = _launch(q, k, v, initial_state, reverse=False, store_final_state=True,
                                 config=config, cu_seqlens=cu_seqlens)
        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
        ctx.config = config
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, initial_state, cu_seqlens = ctx.saved_tensors
        if grad_o is None:  # only the final state was used
            grad_o = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
        need_q, need_k, need_v, need_s0 = ctx.needs_input_grad[:4]
        # S_0^T and G^T are views (.mT): the kernel reads the state row by row, in any order.
        s0_t = initial_state.mT if initial_state is not None else None
        g = grad_final_state
        g_t = g.mT if g is not None else None
        dq = dk = dv = ds0 = None
        if need_q:  # dq_t = S_t dO_t
            dq, _ = _launch(grad_o, v, k, s0_t, reverse=False, store_final_state=False, config=ctx.config,
                            cu_seqlens=cu_seqlens)
        if need_k:  # dk_t = P_t v_t
            dk, _ = _launch(v, grad_o, q, g_t, reverse=True, store_final_state=False, config=ctx.config,
                            cu_seqlens=cu_seqlens)
        if need_v or need_s0:  # dv_t = P_t^T k_t, and P_1 = dS_0
            dv, ds0 = _launch(k, q, grad_o, g, reverse=True, store_final_state=need_s0, config=ctx.config,
                              cu_seqlens=cu_seqlens)
        return dq, dk, (dv if need_v else None), ds0, None, None


def _launch_normalized(q, k, v, initial_state, eps, config, cu_seqlens=None):
    """The normalised forward in one walk: (out, final_state (B, H, D, E + 1), d + eps (B, H, T))."""
    denominator = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    o, final_state = _launch(q, k, v, initial_state, reverse=False, store_final_state=True, config=config,
                             cu_seqlens=cu_seqlens, denominator=denominator, eps=eps)
    return o, final_state, denominator


#: The normalised backward's walks that take the denominator's terms (NORMALIZER_GRADIENT).
_DQ_WALK, _DK_WALK = 1, 2


def _normalized_backward(q, k, v, initial_state, o, denominator, grad_o, grad_final_state, config, cu_seqlens,
                         needs_input_grad):
    """The normalised backward: out_t = n_t / (d_t + eps), n_t the plain product's output and
    d_t = q_t . z_t, so n gets g_t = dO_t / (d_t + eps) and d gets r_t = -(g_t . out_t), both
    made here (two elementwise passes). The plain walks run on g, and the dq and dk walks add
    the denominator's terms as they go: dq_t += r_t z_t, and dk_s += dz_s = G_z + sum_{t>=s}
    r_t q_t, whose last value is dz_0, the initial state's z gradient. float16 runs the walks
    in float32: g falls below float16's normal range once d_t is a few thousand."""
    needs_q, needs_k, needs_v, needs_initial_state = needs_input_grad
    E = v.shape[-1]
    work_dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
    g = (grad_o.float() / denominator[..., None]).to(work_dtype)
    r = -(g.float() * o.float()).sum(-1)  # (B, H, T), from the g the walks see
    q_w, k_w, v_w = q.to(work_dtype), k.to(work_dtype), v.to(work_dtype)
    dq = dk = dv = ds0 = None
    if needs_q:  # dq_t = S_t g_t + r_t z_t, from [S_0; z_0]^T: z_0 is its row E
        s0_t = initial_state.mT if initial_state is not None else None
        dq, _ = _launch(g, v_w, k_w, s0_t, reverse=False, store_final_state=False, config=config,
                        cu_seqlens=cu_seqlens, gradient_walk=_DQ_WALK, r=r)
        dq = dq.to(q.dtype)
    if needs_k or needs_initial_state:  # dk_s = P_s v_s + dz_s, from [G; G_z]^T; its final row E is dz_0
        g_t = grad_final_state.mT if grad_final_state is not None else None
        dk, dk_final = _launch(v_w, g, q_w, g_t, reverse=True, store_final_state=needs_initial_state, config=config,
                               cu_seqlens=cu_seqlens, gradient_walk=_DK_WALK, r=r)
        dk = dk.to(k.dtype)
    if needs_v or needs_initial_state:  # dv_s = P_s^T k_s; the final state is dS_0
        g_s = grad_final_state[..., :E] if grad_final_state is not None else None
        dv, ds0 = _launch(k_w, q_w, g, g_s, reverse=True, store_final_state=needs_initial_state, config=config,
                          cu_seqlens=cu_seqlens)
        dv = dv.to(v.dtype)
        if needs_initial_state:
            ds0 = torch.cat([ds0, dk_final[..., E, :].unsqueeze(-1)], dim=-1)
    return dq, dk if needs_k else None, dv if needs_v else None, ds0


class _RecurrentNormalizedAttention(torch.autograd.Function):
    """Forward: one walk. Backward: three walks, the dq and dk ones with the denominator's terms."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, eps, config, cu_seqlens):
        ctx.set_materialize_grads(False)
        o, final_state, denominator = _launch_normalized(q, k, v, initial_state, eps, config, cu_seqlens)
        ctx.save_for_backward(q, k, v, initial_state, o, denominator, cu_seqlens)
        ctx.config = config
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, initial_state, o, denominator, cu_seqlens = ctx.saved_tensors
        if grad_o is None:  # only the final state was used
            grad_o = torch.zeros_like(o)
        dq, dk, dv, ds0 = _normalized_backward(q, k, v, initial_state, o, denominator, grad_o, grad_final_state,
                                               ctx.config, cu_seqlens, ctx.needs_input_grad[:4])
        return dq, dk, dv, ds0, None, None, None


# Input checks. The package's API makes the same ones with the same messages; they are repeated
# here so that this file, copied alone, refuses what its kernels cannot compute right.

#: The largest head dimension (D and E) the kernels take.
MAX_HEAD_DIM = 256
#: Offsets inside one (batch, head) slice are 32-bit: its last element may sit at most this far in.
INDEX_LIMIT = 2**31 - 1
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dense(name, x):
    """Sparse, nested and other non-strided tensors have no (B, H, T, D) strides to walk."""
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor; pad it first")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
                        "convert it with .to_dense()")


def check_cu_seqlens(q, cu_seqlens):
    """cu_seqlens: the (N + 1,) int32/int64 offsets of N sequences packed along dimension 2 of a
    batch of one: 0 first, non-decreasing, total_T last (empty sequences allowed), read back to
    the host once."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be 1-D with N + 1 >= 2 offsets for N sequences, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the inputs' device ({q.device}), got {cu_seqlens.device}")
    if q.shape[0] != 1:
        raise ValueError("with cu_seqlens, q, k and v pack their sequences along T in a batch of one, "
                         f"(1, H, total_T, D); got B={q.shape[0]}")
    first, last, decreasing = torch.stack(
        [cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] < cu_seqlens[:-1]).sum()]).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {decreasing} offsets below the one before")
    if last != q.shape[2]:
        raise ValueError(f"cu_seqlens must end at total_T = {q.shape[2]} (dimension 2 of q), got {last}")


def check_inputs(q, k, v, initial_state, method='recurrent', cu_seqlens=None, *, normalized=False):
    """A TypeError or ValueError naming the argument and the limit for any input the kernels cannot
    take: q, k, v must be dense 4-D tensors, (B, H, T, D), (B, H, T, D) and (B, H, T, E), of one
    dtype of _INPUT_DTYPES, on the GPU (the CPU under TRITON_INTERPRET=1), with 1 <= D, E <=
    MAX_HEAD_DIM and one head spanning at most INDEX_LIMIT + 1 elements; initial_state None or a
    dense floating (B, H, D, E) tensor on their device ((B, H, D, E + 1) when ``normalized``).
    cu_seqlens: None, or the offsets of N sequences packed along T (``check_cu_seqlens``); the
    states are then (N, H, D, E) (E + 1 when ``normalized``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check_dense(name, x)
        if x.dim() != 4:
            shape_hint = "(B, H, T, E)" if name == "v" else "(B, H, T, D)"
            raise ValueError(f"{name} must have 4 dimensions {shape_hint}, got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape (B, H, T, D), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must share B, H and T with q: v is {tuple(v.shape)} (B, H, T, E), q is {tuple(q.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "convert them first, e.g. k.to(q.dtype)"
        )
    if q.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"method {method!r} supports dtypes float32, float16, bfloat16; q, k, v are {q.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    expected_device = "cpu" if triton.knobs.runtime.interpret else "cuda"
    # @triton.jit built a GPU kernel or an interpreter function at import; a stand-in for the
    # kernel (a test's launch recorder) is neither and passes.
    if isinstance(recurrent_tokens_kernel, triton.runtime.JITFunction if triton.knobs.runtime.interpret else InterpretedFunction):
        raise RuntimeError(
            "Triton's interpreter was switched " + ("on" if triton.knobs.runtime.interpret else "off") +
            " after this file was imported, and @triton.jit chose at import: set TRITON_INTERPRET=1 "
            "(for CPU tensors) or leave it unset (for a GPU) before importing this file"
        )
    if q.device.type != expected_device:
        where = "Triton's CPU interpreter" if expected_device == "cpu" else "the GPU"
        move = f"Move them with .to({expected_device!r})"
        if expected_device == "cuda" and not torch.cuda.is_available():
            move = ("This machine has no GPU: set TRITON_INTERPRET=1 before importing this file, and "
                    "Triton's interpreter runs it on CPU tensors")
        raise ValueError(
            f"method {method!r} runs on {where} in this session, so q, k, v must be on "
            f"{expected_device!r}; they are on {q.device}. {move}"
        )
    D, E = q.shape[-1], v.shape[-1]
    if D < 1 or E < 1:
        raise ValueError(f"D and E must be at least 1, got D={D} (q, k) and E={E} (v)")
    if D > MAX_HEAD_DIM or E > MAX_HEAD_DIM:
        raise ValueError(
            f"method {method!r} supports D and E up to {MAX_HEAD_DIM}; got D={D} (q, k) and E={E} (v). "
            "Split the head dimension or use a reference method"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        _, _, length, width = x.shape
        _, _, stride_t, stride_last = x.stride()
        last_offset = (length - 1) * abs(stride_t) + (width - 1) * abs(stride_last)
        if length > 0 and last_offset > INDEX_LIMIT:
            raise ValueError(
                f"method {method!r} indexes one (batch, head) slice with 32-bit offsets: {name} spans "
                f"{last_offset + 1} elements per head (T={x.shape[2]}), above the limit of "
                f"{INDEX_LIMIT + 1}. Split the sequence and chain the pieces with initial_state"
            )
    if cu_seqlens is not None:
        check_cu_seqlens(q, cu_seqlens)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}")
        _check_dense("initial_state", initial_state)
        if cu_seqlens is None:
            expected = (*q.shape[:2], D, E + normalized)
            layout = "(B, H, D, E + 1), z as the last column," if normalized else "(B, H, D, E)"
        else:  # one state per packed sequence
            expected = (cu_seqlens.shape[0] - 1, q.shape[1], D, E + normalized)
            layout = ("(N, H, D, E + 1) with cu_seqlens, z as the last column," if normalized
                      else "(N, H, D, E) with cu_seqlens")
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must have shape {layout} = {expected}, got {tuple(initial_state.shape)}"
            )
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state must be a floating-point tensor, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(
                f"initial_state must be on the same device as q ({q.device}), got {initial_state.device}"
            )


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


def _resolved(q, k, v, initial_state):
    """The inputs with any negative bit materialised (a view such as ``x.conj().imag`` has one): the
    kernels read raw storage, which holds the values before negation. A no-op for ordinary tensors."""
    if initial_state is not None:
        initial_state = initial_state.resolve_neg()
    return q.resolve_neg(), k.resolve_neg(), v.resolve_neg(), initial_state


def recurrent_causal_product(q, k, v, initial_state=None, *, config=None, cu_seqlens=None):
    """q, k: (B, H, T, D); v: (B, H, T, E); one dtype of float32/float16/bfloat16, one device.
    initial_state: None or (B, H, D, E), any floating dtype, used as float32.  Returns
    (o, final_state): o (B, H, T, E) in the input dtype, final_state (B, H, D, E) float32.
    Differentiable in q, k, v and initial_state.
    config: optional dict overriding the block sizes / num_warps the wrapper would choose
    (benchmarks sweep it); None means the wrapper's own rule.  Keys: ``CONFIG_KEYS``, checked
    by ``check_config``; ``TUNING_CANDIDATES`` lists complete ones (the normalised attention refuses
    those whose BLOCK_D does not cover D).
    cu_seqlens: optional (N + 1,) int32/int64 offsets of N sequences packed along T of a batch of
    one (q, k: (1, H, total_T, D)); no state crosses a boundary, and the states are (N, H, D, E)."""
    check_inputs(q, k, v, initial_state, cu_seqlens=cu_seqlens)
    if initial_state is not None:  # the API converts it once, before calling _run_validated
        initial_state = initial_state.float()
    return _run_validated(q, k, v, initial_state, config, cu_seqlens)


def _run_validated(q, k, v, initial_state=None, config=None, cu_seqlens=None, normalized=False):
    """``recurrent_causal_product`` for inputs already through ``check_inputs`` (the package's API
    makes the same checks, once). ``normalized`` (v ends with a column of ones by whose product
    the caller divides) changes nothing here: the walks multiply float32 exactly, on CUDA cores;
    the other kernel files take it too, for their tensor-core products."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the kernels read offset n at cu_seqlens_ptr + n
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _RecurrentCausalProduct.apply(q, k, v, initial_state, config, cu_seqlens)
    # No gradient wanted: skip autograd's bookkeeping, a sizeable part of a small call's time.
    return _launch(q, k, v, initial_state, reverse=False, store_final_state=True, config=config,
                   cu_seqlens=cu_seqlens)


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        kind = type(eps).__qualname__
        kind = kind if type(eps).__module__ == "builtins" else f"{type(eps).__module__}.{kind}"
        raise TypeError(f"eps must be a Python float, got {kind}; convert it with float(eps)")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def recurrent_normalized_attention(q, k, v, initial_state=None, *, eps=1e-6, config=None, cu_seqlens=None):
    """Normalised causal linear attention of features q, k (the feature map already applied):
    out_t = q_t^T S_t / (q_t^T z_t + eps), S_t = S_0 + sum_{s<=t} k_s v_s^T, z_t = z_0 + sum_{s<=t} k_s,
    numerator and denominator accumulated in float32 in one walk. eps (finite, >= 0) is added
    once, to q_t^T z_t. Shapes, dtypes, ``config`` and ``cu_seqlens`` as
    ``recurrent_causal_product``; initial_state: None or (B, H, D, E + 1) ((N, H, D, E + 1) packed),
    any floating dtype used as float32, S_0 then z_0 as the last column. Returns (out,
    final_state): out in the input dtype, final_state float32 in the initial state's layout.
    Differentiable in q, k, v and initial_state."""
    check_inputs(q, k, v, initial_state, cu_seqlens=cu_seqlens, normalized=True)
    _check_eps(eps)
    if initial_state is not None:
        initial_state = initial_state.float()
    return _run_normalized_validated(q, k, v, initial_state, eps, config, cu_seqlens)


def _run_normalized_validated(q, k, v, initial_state=None, eps=1e-6, config=None, cu_seqlens=None):
    """``recurrent_normalized_attention`` for inputs, eps included, already checked."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _RecurrentNormalizedAttention.apply(q, k, v, initial_state, eps, config, cu_seqlens)
    o, final_state, _ = _launch_normalized(q, k, v, initial_state, eps, config, cu_seqlens)
    return o, final_state
