"""Chunked causal dot product: tensor-core tiles inside a chunk, a float32 state between chunks.

The chunkwise form of linear attention (the recurrence of Katharopoulos et al. 2020, rewritten
as fla's ``fused_chunk`` kernels do). With chunks of C tokens, S_{c-1} the state after the
previous chunk and M the causal mask (diagonal included):

    O_c = Q_c S_{c-1} + ((Q_c K_c^T) * M) V_c          (C x E)
    S_c = S_{c-1} + K_c^T V_c                           (D x E)

``chunked_kernel``: one program per (batch, head, block of E columns) walks the chunks with its
slice of S in float32 registers; every product is a ``tl.dot``, and ``num_stages`` overlaps the
loads of the next chunks with this one's products. ``reverse`` = 1 walks the chunks from last to
first with the upper triangle, so the state holds sum_{s >= t} k_s v_s^T.
Backward, with dO the gradient of o and G that of S_T: dQ = forward product (dO, V, K) from
S_0^T; dK = reverse product (V, dO, Q) from G^T; dV = reverse product (K, Q, dO) from G, whose
final state is dS_0. For heads up to 64 wide (16-bit inputs; float32 ones under one TF32
product in the normalised attention, and in the plain product where its walks split, see
``fused_backward_config``) ``chunked_backward_kernel`` does all three in one launch (two
programs a head: a forward walk for dQ, a reverse walk for dK and dV; with ``SPLIT_WALKS``, for
heads too few to fill the GPU, the reverse walk is two programs, one for dV and one for dK, each
carrying the same R); otherwise ``chunked_kernel`` runs three times.
``NORMALIZE`` (``chunked_normalized_attention``): out_t = o_t / (q_t . z_t + eps), z_t = z_0 +
sum_{s<=t} k_s in float32 beside S (states of E + 1 columns, z last), q_t . z_t = the row sum of
the chunk's masked scores + q_t . z_{c-1}. Its backward runs on g_t = dO_t / (q_t . z_t + eps)
and adds the denominator's gradient r_t = -(g_t . out_t) in the same walks, r made beforehand by
``normalizer_gradient_kernel`` (for the three passes, g beside it, and ``normalizer_terms_kernel``
adds r_t z_t to their dQ and dz to their dK in one walk each). dz after each chunk, the sum of
r_t q_t over the later tokens that every dk_s receives, is made before the fused walks (the r
kernel's sums over the walks' chunks, then ``chunk_suffix_sums_kernel``), so the reverse walk
reads it instead of carrying a sum across its warps. ``FEATURE_MAP`` ("elu"
or "relu", with q and k the features of raw inputs that map made beforehand): the backward takes
the map's derivative, read off the features (min(phi, 1); phi > 0), as it stores dQ and dK, which
are then the raw inputs' gradients (``_run_normalized_validated(features=)``).

Shapes: q, k (B, H, T, D); v, o (B, H, T, E); states (B, H, D, E) float32; any strides; T >= 0
(a partial last chunk is masked); 1 <= D, E <= 256 (blocks are powers of two >= 16, the smallest
``tl.dot`` on a GPU). Offsets inside one (batch, head) slice are int32: its last
element must sit at an offset below 2**31. Packed (``IS_VARLEN``, ``cu_seqlens`` of N + 1
offsets): q, k, v, o hold N sequences along T of a batch of one, program row b walks sequence b,
tokens [cu_seqlens[b], cu_seqlens[b + 1]), in chunks from its first token, and the states are
(N, H, D, E); the Kahan carry then follows the total length. Packed sequences are for the plain
product only: ``chunked_normalized_attention`` takes no ``cu_seqlens`` (recurrent's and scan's do).
Precision: products accumulate in float32. float32 inputs follow
``torch.get_float32_matmul_precision()`` at each call (``FLOAT32_PRECISIONS``). "highest", the
default, splits each operand into two bfloat16 parts in the kernel (``BF16X3_MANUAL``, three
bfloat16 products, about 6e-6 against float64) on the tiles where that ran right on a GPU
(``split_is_right``: Triton 3.6 gets one family wrong) and for calls whose outputs are large
enough for that error to hold (``split_is_accurate``); elsewhere it takes 3xTF32
(``input_precision="tf32x3"``, about 3e-7). So does the normalised attention, whose dq cancels
to about 7e-5 under the split: the kernels' own normalised launches, and a product whose caller
divides by the product of a column of ones appended to v (``_run_validated(normalized=True)``,
forward and backward). "high" and "medium" take one TF32 product (about 1.5e-3; 5e-3 to 1e-2
for the normalised dq, which cancels); keys up to 64 wide then load k a chunk ahead into
registers (``PREFETCH_K``, see the chunk loop), and keys 128 wide walk the chunks transposed,
O_c^T and S^T, with the state in registers (``TRANSPOSED``, ``TRANSPOSED_KEY_BLOCKS``; not the
normalised forward, whose walk carries z).
bfloat16 rounds the float32 state and scores to bfloat16 (same range); float16 keeps them in
float32 (TF32 products, exact for float16 inputs): long sequences of positive features pass
65504. Tensor cores accumulate with truncation: under a split (3xTF32, bfloat16
parts) each chunk's state product is added in rounded float32, and beyond
``COMPENSATED_FROM_CHUNKS`` chunks every dtype adds it with a Kahan carry.
Without a GPU: set TRITON_INTERPRET=1 before importing this file, since ``@triton.jit`` chooses
Triton's CPU interpreter at import; the wrappers refuse an interpreter switched on or off afterwards.
Tested: Triton 3.9's CPU interpreter; every launch compiled for sm_80 and sm_90 with Triton 3.6
and 3.9; the test suite on an H200 with Triton 3.6 (``NORMALIZE``, ``IS_VARLEN``, float32
"tf32x3" and "tf32" and the token-by-token walks below included); the split into bfloat16 parts
on an H200 (this file's and tests/test_precision.py's tests) and every rule tile on an H100; the
fused and normalised backward of this file (tests/test_chunked.py, test_attention.py and
test_feature_maps.py) also on an H100, and so the float32 tests of test_precision.py,
test_chunked.py and test_attention.py with ``PREFETCH_K``; ``TRANSPOSED`` on an H100 through
test_precision.py's tests that take it, and on both of its rule's tiles against float64 (the
forward from S_0, a reverse walk, packed sequences, S_T and every gradient). The fused backward
on float32 inputs under TF32: on an H100 through the float32 tests of test_precision.py,
test_chunked.py, test_varlen.py and test_host_path.py, its gradients within 2.1e-4 of the three
passes', and the normalised dq within 4.8e-3 of float64 at (2, 16, 4096, 64) (the passes': 6.8e-3).
Non-finite values: a chunk product multiplies its masked zeros by every row of v (k, dO, q in
the backward), and 0 * inf is NaN, so an inf or NaN would reach earlier results of its chunk.
Each loop sums 0 * its result tiles per row (NaN once one is not finite); a program that saw
one redoes its tokens one at a time after the loop (``_outputs_token_by_token`` and the two
gradient walks: the recurrence, causal by construction) and overwrites what it stored. The walks
take their offsets afresh from the arguments and do not unroll: values kept live through a
chunk loop cost that loop registers.
Caveats: a program with an inf or NaN in its inputs walks its tokens serially (a slow call,
not a wrong one). A config that needs more shared memory than the GPU has fails at launch. The
interpreter multiplies bfloat16 bit patterns in ``tl.dot`` and truncates float32 to bfloat16:
under it (``INTERPRETED``) the kernels round by hand (``_rounded``) and widen every product
operand to float32.
"""

import contextlib
import functools
import math
import threading

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _add_product(b_sum, b_carry, a, b, COMPENSATED: tl.constexpr, PRECISION: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """(b_sum + a @ b, carry). A tensor-core product that accumulates into b_sum truncates the
    sum at every step, a bias that grows with the number of chunks; COMPENSATED instead adds
    each chunk's product in rounded float32 and keeps the rounding error in b_carry (Kahan).
    A split of float32 operands (3xTF32, bfloat16 parts) makes three or more truncating
    additions a chunk: its product is added in rounded float32."""
    if COMPENSATED:
        y = _dot(a, b, None, PRECISION, INTERPRETED) - b_carry
        total = b_sum + y
        b_carry = (total - b_sum) - y
        b_sum = total
    elif PRECISION == "tf32x3" or PRECISION == "bf16x3" or PRECISION == "bf16x6" or PRECISION == BF16X3_MANUAL:
        b_sum += _dot(a, b, None, PRECISION, INTERPRETED)
    else:
        b_sum = _dot(a, b, b_sum, PRECISION, INTERPRETED)
    return b_sum, b_carry


#: float32 products split into bfloat16 parts by the kernel itself: x = hi + lo with hi = x
#: rounded to bfloat16 and lo = (x - hi) rounded, then lo @ hi + hi @ lo + hi @ hi, three plain
#: bfloat16 products, which tensor cores run at twice TF32's rate. lo @ lo, about 2**-16 of the
#: product, is left out, as Triton's "bf16x3" leaves it out: the plain product errs by about 6e-6
#: against float64, within float32's 1e-5, but the normalised attention's dq, whose terms
#: cancel, by about 7e-5, so the normalised launches keep 3xTF32 (``float32_precision``).
#: "highest"'s products (``FLOAT32_PRECISIONS``); ``benchmarks/float32_sweep.py --products``
#: times them against 3xTF32.
BF16X3_MANUAL = tl.constexpr("bf16x3_manual")


@triton.jit
def _bfloat16_parts(x, INTERPRETED: tl.constexpr):
    """(hi, lo) of float32 x, both bfloat16 values: hi = x rounded, lo = (x - hi) rounded. Under
    the interpreter they stay float32 tensors (its ``tl.dot`` multiplies bfloat16 bit patterns)."""
    hi = _rounded(x, tl.bfloat16, INTERPRETED)
    lo = _rounded(x - hi.to(tl.float32), tl.bfloat16, INTERPRETED)
    if INTERPRETED:
        hi = hi.to(tl.float32)
        lo = lo.to(tl.float32)
    return hi, lo


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b (acc None: a @ b) in float32, with PRECISION the ``input_precision`` of
    float32 operands, or BF16X3_MANUAL (see there): the small parts' products, then the large one."""
    if PRECISION == BF16X3_MANUAL:
        a_hi, a_lo = _bfloat16_parts(a.to(tl.float32), INTERPRETED)
        b_hi, b_lo = _bfloat16_parts(b.to(tl.float32), INTERPRETED)
        acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_hi, acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)
    return acc


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


#: Columns of the blocks that carry the normaliser's sums: the narrowest ``tl.dot`` operand.
UNIT_BLOCK = tl.constexpr(16)


@triton.jit
def _unit_columns(ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """U (ROWS x UNIT_BLOCK): ones in its first column, zeros in the others. Sums over the tokens
    become products, K^T U = (z, 0, ..., 0): z is the state of one more value column, all ones,
    and its product runs on tensor cores like the state's. ``tl.sum`` over a tile's tokens instead
    crosses the warps (shared memory and a barrier) at every chunk, where the products wait."""
    return (tl.arange(0, ROWS)[:, None] * 0 + tl.arange(0, UNIT_BLOCK)[None, :] == 0).to(DTYPE)


@triton.jit
def _normalized(b_o, b_scores, b_q, b_key_sum, eps, denominator_ptrs, store_mask):
    """O_c / (d + eps) for a chunk: d_t = rowsum(A)_t + q_t . z_{c-1} in float32, from the
    unrounded masked scores A and z_{c-1}, the row sums of ``b_key_sum`` (only its first column is
    not zero). It needs no v, so every value block's program computes it for itself; d_t + eps is
    stored where ``store_mask`` holds."""
    b_z = tl.sum(b_key_sum, 1)
    b_denominator = tl.sum(b_scores, 1) + tl.sum(b_q.to(tl.float32) * b_z[None, :], 1) + eps
    tl.store(denominator_ptrs, b_denominator, mask=store_mask)
    return b_o / b_denominator[:, None]


@triton.jit
def _numerator_gradient(b_do, denominator_ptr, offs_t, mask_t, MIXED_DTYPE: tl.constexpr,
                        MIXED_DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """g_t = dO_t / (d_t + eps) of a chunk for the normalised backward, as a product operand
    (bfloat16 for bfloat16 inputs; float32 for float16, whose range g leaves at long T)."""
    b_denominator = tl.load(denominator_ptr + offs_t, mask=mask_t, other=1.0)
    return _rounded(b_do.to(tl.float32) / b_denominator[:, None], MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE)


@triton.jit
def _through_features(b_grad, b_phi, FEATURE_MAP: tl.constexpr):
    """The gradient of x from b_grad (float32), the gradient of phi(x), and the feature phi(x)
    itself. elu + 1: phi'(x) is 1 above 0 and exp(x) = phi(x) below, so min(phi(x), 1); relu: 0
    where phi(x) <= 0, by selection (an inf gradient times 0 would be NaN); a NaN feature passes
    the gradient on, as PyTorch's backward of elu and relu does."""
    if FEATURE_MAP == "elu":
        b_phi = b_phi.to(tl.float32)
        return b_grad * tl.where(b_phi < 1.0, b_phi, 1.0)
    if FEATURE_MAP == "relu":
        return tl.where(b_phi <= 0, 0.0, b_grad)
    return b_grad


@triton.jit
def normalizer_gradient_kernel(
    do_ptr, o_ptr,                  # dO and the normalised forward's output (B, H, T, E)
    denominator_ptr,                # the forward's d_t + eps (B, H, T) float32, contiguous
    grad_denominator_ptr,           # r (B, H, T) float32, contiguous, written
    numerator_ptr,                  # g (B, H, T, E) contiguous, written if WRITE_NUMERATOR
    q_ptr,                          # WRITE_CHUNK_SUMS: q (B, H, T, D)
    chunk_sums_ptr,                 # WRITE_CHUNK_SUMS: sum of r_t q_t over each BLOCK_T tokens (B, H, NC, D), written
    T, H, E, D,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_qb, stride_qh, stride_qt, stride_qd,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,          # >= E: r sums over every value column
    BLOCK_D: tl.constexpr,          # >= D where WRITE_CHUNK_SUMS
    INTERPRETED: tl.constexpr,
    WRITE_NUMERATOR: tl.constexpr,  # the backward in passes: they take g as an input
    WRITE_CHUNK_SUMS: tl.constexpr,  # the fused backward with chunks of BLOCK_T tokens: dz's per-chunk terms
):
    """The denominator's gradient r_t = -(g_t . out_t) for BLOCK_T tokens of one (batch, head),
    g_t = dO_t / (d_t + eps) rounded as the backward's products take it (bfloat16 for bfloat16
    inputs), so that the score gradients g_t . v_s + r_t cancel where they should (v_s ~ out_t).
    FlashAttention's backward starts the same way (the row sums of dO * O): one read of dO and o
    here spares the backward's walks a tile of o a chunk, a load their pipeline left waiting.
    WRITE_CHUNK_SUMS: also sum_t r_t q_t over the BLOCK_T tokens, one chunk of the fused
    backward, from which ``chunk_suffix_sums_kernel`` makes dz after each chunk."""
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if do_ptr.dtype.element_ty == tl.bfloat16 else tl.float32
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_e < E)[None, :]
    b_do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_t[:, None] * stride_dot
                   + offs_e[None, :] * stride_doe, mask=mask, other=0.0)
    b_o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_oe,
                  mask=mask, other=0.0)
    row = pid_bh.to(tl.int64) * T
    b_g = _numerator_gradient(b_do, denominator_ptr + row, offs_t, mask_t, MIXED_DTYPE, tl.float32, INTERPRETED)
    b_grad_denominator = -tl.sum(b_g * b_o.to(tl.float32), 1)
    tl.store(grad_denominator_ptr + row + offs_t, b_grad_denominator, mask=mask_t)
    if WRITE_CHUNK_SUMS:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        b_q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                      mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        b_weighted = tl.sum(b_grad_denominator[:, None] * b_q.to(tl.float32), 0)
        tl.store(chunk_sums_ptr + (pid_bh.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * D + offs_d,
                 b_weighted, mask=mask_d)
    if WRITE_NUMERATOR:
        tl.store(numerator_ptr + (row + offs_t[:, None]) * E + offs_e[None, :], b_g, mask=mask)


@triton.jit
def chunk_suffix_sums_kernel(
    chunk_sums_ptr,                 # sum of r_t q_t over each chunk (B, H, NC, D) float32, contiguous
    g_ptr,                          # G (B, H, D, E + 1) float32: its z column read if has_final_grad
    suffix_ptr,                     # dz after each chunk (B, H, NC, D) float32, contiguous, written
    ds0_ptr,                        # dS_0 (B, H, D, E + 1) float32, contiguous: its z column written
    num_chunks, H, D, E, has_final_grad,
    stride_gb, stride_gh, stride_gd, stride_ge,
    BLOCK_D: tl.constexpr,
    SCAN_CHUNKS: tl.constexpr,      # chunks one step of the scan takes
):
    """For one (batch, head): dz_c = G_z + the chunk sums of every later chunk, for each chunk c,
    and dz_0 = G_z + all of them (dS_0's z column). The fused backward's reverse walk then adds
    dz_c to its chunk's dK instead of carrying dz, which would cost it registers it has not got.
    Each step takes SCAN_CHUNKS chunks from the end: row c holds chunk c + 1's sum, so a reversed
    inclusive cumsum of the rows sums the chunks after c up to the next step's first, and the carry
    (dz after that chunk, row 0 of the step before) adds everything later."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_c = tl.arange(0, SCAN_CHUNKS)
    b_carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    if has_final_grad:
        b_carry = tl.load(g_ptr + b * stride_gb + h * stride_gh + offs_d * stride_gd + E * stride_ge, mask=mask_d,
                          other=0.0)
    rows = pid_bh.to(tl.int64) * num_chunks * D
    steps = tl.cdiv(num_chunks, SCAN_CHUNKS)
    for i in range(steps):
        chunks = (steps - 1 - i) * SCAN_CHUNKS + offs_c
        later = chunks + 1  # the step's last row reads the next step's first chunk, which the carry lacks
        b_later = tl.load(chunk_sums_ptr + rows + later[:, None] * D + offs_d[None, :],
                          mask=(later < num_chunks)[:, None] & mask_d[None, :], other=0.0)
        b_suffix = b_carry[None, :] + tl.cumsum(b_later, 0, reverse=True)
        tl.store(suffix_ptr + rows + chunks[:, None] * D + offs_d[None, :], b_suffix,
                 mask=(chunks < num_chunks)[:, None] & mask_d[None, :])
        b_carry = tl.sum(tl.where((offs_c == 0)[:, None], b_suffix, 0.0), 0)
    b_first = tl.load(chunk_sums_ptr + rows + offs_d, mask=mask_d, other=0.0)
    tl.store(ds0_ptr + pid_bh.to(tl.int64) * D * (E + 1) + offs_d * (E + 1) + E, b_carry + b_first, mask=mask_d)


@triton.jit
def normalizer_terms_kernel(
    plain_ptr,                      # dQ or dK of the plain passes on g (B, H, T, D) float32
    x_ptr,                          # the summed features: k for dQ, q for dK (B, H, T, D)
    phi_ptr,                        # the differentiated features: q for dQ, k for dK (FEATURE_MAP)
    grad_denominator_ptr,           # r (B, H, T) float32, contiguous
    carry_ptr,                      # z_0 for dQ, G's z column for dK (B, H, D) float32: read if has_carry
    out_ptr,                        # dQ or dK (B, H, T, D), written
    total_ptr,                      # dz_0 (B, H, D) float32, contiguous: written if REVERSE
    T, H, D, has_carry,
    stride_pb, stride_ph, stride_pt, stride_pd,
    stride_xb, stride_xh, stride_xt, stride_xd,
    stride_fb, stride_fh, stride_ft, stride_fd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_cb, stride_ch, stride_cd,
    REVERSE: tl.constexpr,          # 0: dQ's terms, 1: dK's
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FEATURE_MAP: tl.constexpr,      # "identity", or the map that made q and k: the result taken through it
):
    """The denominator's terms of the backward in passes, for BLOCK_D columns of one (batch,
    head), in float32 from the plain part to the rounded result: dQ_t = plain_t + r_t z_t with
    z_t = z_0 + sum_{s <= t} k_s (REVERSE = 0), or dK_s = plain_s + dz_s with dz_s = G_z +
    sum_{t >= s} r_t q_t (REVERSE = 1, walking the tokens from last to first; dz_0 stored), then
    through the feature map. The terms cancel much of the plain part, so neither is rounded before
    they meet. Each block of
    tokens takes its running sums from one ``tl.cumsum``, which adds no later token to an
    earlier one: an inf or NaN stays on its side of the recurrence."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_i = tl.arange(0, BLOCK_T)
    b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
    if has_carry:
        b_sum = tl.load(carry_ptr + b * stride_cb + h * stride_ch + offs_d * stride_cd, mask=mask_d, other=0.0)
    for i0 in tl.range(0, T, BLOCK_T):
        mask_i = i0 + offs_i < T
        if REVERSE:
            rows = (T - 1 - i0 - offs_i).to(tl.int64)
        else:
            rows = (i0 + offs_i).to(tl.int64)
        mask = mask_i[:, None] & mask_d[None, :]
        b_x = tl.load(x_ptr + b * stride_xb + h * stride_xh + rows[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                      mask=mask, other=0.0).to(tl.float32)
        b_r = tl.load(grad_denominator_ptr + pid_bh.to(tl.int64) * T + rows, mask=mask_i, other=0.0)
        b_plain = tl.load(plain_ptr + b * stride_pb + h * stride_ph + rows[:, None] * stride_pt
                          + offs_d[None, :] * stride_pd, mask=mask, other=0.0)
        if REVERSE:
            b_summand = b_r[:, None] * b_x
            b_out = b_plain + b_sum[None, :] + tl.cumsum(b_summand, axis=0)
        else:
            b_summand = b_x
            b_out = b_plain + b_r[:, None] * (b_sum[None, :] + tl.cumsum(b_summand, axis=0))
        b_sum += tl.sum(b_summand, axis=0)
        if FEATURE_MAP != "identity":
            b_phi = tl.load(phi_ptr + b * stride_fb + h * stride_fh + rows[:, None] * stride_ft
                            + offs_d[None, :] * stride_fd, mask=mask, other=0.0)
            b_out = _through_features(b_out, b_phi, FEATURE_MAP)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :] * stride_od,
                 b_out.to(out_ptr.dtype.element_ty), mask=mask)
    if REVERSE:
        tl.store(total_ptr + pid_bh.to(tl.int64) * D + offs_d, b_sum, mask=mask_d)


@triton.jit
def _sequence_after_loop(cu_seqlens_ptr, bh, H, T, IS_VARLEN: tl.constexpr):
    """(batch, h, first token, T) of program row bh (int64) for a walk after the chunk loop:
    batch is 0 for packed sequences (which live in a batch of one), first token 0 otherwise.
    Derived again from the program id and the arguments, in int64, so that no value the kernel
    computed before its loop stays live through it: such values cost the loop registers."""
    b = bh // H
    h = bh - b * H
    if IS_VARLEN:
        first = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        return b * 0, h, first, (tl.load(cu_seqlens_ptr + b + 1) - first).to(tl.int32)
    return b, h, b * 0, T


@triton.jit
def _start_state(state_ptr, has_state, D, E, first_column, stride_sd, stride_se,
                 BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr):
    """(S, z) a token-by-token walk starts from: columns [first_column, first_column + BLOCK_E) of
    a (D, E) state (E + 1 columns, z last, with NORMALIZE), or zeros without one. Offsets are made
    here, after the chunk loop, so that none stays live through it."""
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_e = first_column + tl.arange(0, BLOCK_E).to(tl.int64)
    b_state = tl.zeros([BLOCK_D, BLOCK_E], dtype=tl.float32)
    b_z = tl.zeros([BLOCK_D], dtype=tl.float32)
    if has_state:
        b_state = tl.load(state_ptr + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
                          mask=(offs_d[:, None] < D) & (offs_e[None, :] < E), other=0.0).to(tl.float32)
        if NORMALIZE:
            b_z = tl.load(state_ptr + offs_d * stride_sd + E * stride_se, mask=offs_d < D, other=0.0)
    return b_state, b_z


@triton.jit
def _outputs_token_by_token(q_ptr, k_ptr, v_ptr, o_ptr, state_ptr, has_state, T, D, E, first_column, reverse, eps,
                            stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_ot, stride_oe,
                            stride_sd, stride_se, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                            NORMALIZE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rewrites o for tokens [0, T) from the start state, one token at a time in walk order, in
    float32: S <- S + k_t v_t^T, o_t = q_t S (NORMALIZE: z <- z + k_t, o_t / (q_t . z + eps)).
    No product multiplies a token that o_t must not see, so an inf or NaN reaches exactly the
    outputs it reaches in the recurrence. Vectors and the state only: fewer registers than a chunk."""
    b_state, b_z = _start_state(state_ptr, has_state, D, E, first_column, stride_sd, stride_se,
                                BLOCK_D, BLOCK_E, NORMALIZE)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_e = first_column + tl.arange(0, BLOCK_E).to(tl.int64)
    mask_d = offs_d < D
    mask_e = offs_e < E
    for i in tl.range(T, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        t = tl.where(reverse != 0, T - 1 - i, i)
        b_q = tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + offs_e * stride_ve, mask=mask_e, other=0.0).to(tl.float32)
        b_state += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_q[:, None] * b_state, 0)
        if NORMALIZE:
            b_z += b_k
            b_o = b_o / (tl.sum(b_q * b_z, 0) + eps)
        tl.store(o_ptr + t * stride_ot + offs_e * stride_oe, _rounded(b_o, o_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_e)


@triton.jit
def _token_gradients(do_ptr, grad_denominator_ptr, denominator_ptr, t, offs_e, mask_e, stride_dot, stride_doe,
                     NORMALIZE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(g_t, r_t) in float32 for one token: dO_t and 0, or with NORMALIZE the numerator's gradient
    dO_t / (d_t + eps), rounded as the chunk walks round it, and the denominator's r_t
    (``normalizer_gradient_kernel``, made from the same rounded g)."""
    b_g = tl.load(do_ptr + t * stride_dot + offs_e * stride_doe, mask=mask_e, other=0.0)
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if b_g.dtype == tl.bfloat16 else tl.float32
    b_g = b_g.to(tl.float32)
    b_grad_denominator = 0.0
    if NORMALIZE:
        b_g = _rounded(b_g / tl.load(denominator_ptr + t), MIXED_DTYPE, INTERPRETED).to(tl.float32)
        b_grad_denominator = tl.load(grad_denominator_ptr + t)
    return b_g, b_grad_denominator


@triton.jit
def _query_gradients_token_by_token(do_ptr, v_ptr, k_ptr, q_ptr, dq_ptr, grad_denominator_ptr, denominator_ptr,
                                    state_ptr, has_state, T, D, E, stride_dot, stride_doe, stride_vt, stride_ve,
                                    stride_kt, stride_kd, stride_qt, stride_qd, stride_dqt, stride_dqd,
                                    stride_sd, stride_se, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                                    NORMALIZE: tl.constexpr, FEATURE_MAP: tl.constexpr,
                                    INTERPRETED: tl.constexpr):
    """Rewrites dq for tokens [0, T) from P = S_0 (D x E, and z_0), one token at a time:
    P <- P + k_t v_t^T, dq_t = P g_t (NORMALIZE: z <- z + k_t, plus r_t z), in float32, then
    through FEATURE_MAP's derivative at q_t (q is read only then); causal by construction, as
    ``_outputs_token_by_token``."""
    b_p, b_z = _start_state(state_ptr, has_state, D, E, 0, stride_sd, stride_se, BLOCK_D, BLOCK_E, NORMALIZE)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    for t in tl.range(T, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        b_g, b_grad_denominator = _token_gradients(do_ptr, grad_denominator_ptr, denominator_ptr, t, offs_e, mask_e,
                                                   stride_dot, stride_doe, NORMALIZE, INTERPRETED)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + offs_e * stride_ve, mask=mask_e, other=0.0).to(tl.float32)
        b_p += b_k[:, None] * b_v[None, :]
        b_dq = tl.sum(b_p * b_g[None, :], 1)
        if NORMALIZE:
            b_z += b_k
            b_dq += b_grad_denominator * b_z
        if FEATURE_MAP != "identity":
            b_dq = _through_features(b_dq, tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0),
                                     FEATURE_MAP)
        tl.store(dq_ptr + t * stride_dqt + offs_d * stride_dqd, _rounded(b_dq, dq_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_d)


@triton.jit
def _key_value_gradients_token_by_token(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, grad_denominator_ptr,
                                        denominator_ptr, state_ptr, has_state, T, D, E,
                                        stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve,
                                        stride_dot, stride_doe, stride_dkt, stride_dkd, stride_dvt, stride_dve,
                                        stride_sd, stride_se,
                                        BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                                        NORMALIZE: tl.constexpr, FEATURE_MAP: tl.constexpr,
                                        INTERPRETED: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr):
    """Rewrites dk (WANT_DK) and dv (WANT_DV) for tokens [0, T), last first, from R = G (and dz = G's z column), one
    token at a time: R <- R + q_t g_t^T, dk_t = R v_t, dv_t = R^T k_t (NORMALIZE: dz <- dz + r_t q_t,
    dk_t plus dz), in float32, dk_t then through FEATURE_MAP's derivative at k_t; causal by
    construction, as ``_outputs_token_by_token``."""
    b_r, b_dz = _start_state(state_ptr, has_state, D, E, 0, stride_sd, stride_se, BLOCK_D, BLOCK_E, NORMALIZE)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    for i in tl.range(T, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        t = T - 1 - i
        b_g, b_grad_denominator = _token_gradients(do_ptr, grad_denominator_ptr, denominator_ptr, t, offs_e, mask_e,
                                                   stride_dot, stride_doe, NORMALIZE, INTERPRETED)
        b_q = tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + offs_e * stride_ve, mask=mask_e, other=0.0).to(tl.float32)
        b_r += b_q[:, None] * b_g[None, :]
        b_dk = tl.sum(b_r * b_v[None, :], 1)
        if NORMALIZE:
            b_dz += b_grad_denominator * b_q
            b_dk += b_dz
        if WANT_DV:
            b_dv = tl.sum(b_r * b_k[:, None], 0)
        if WANT_DK:
            b_dk = _through_features(b_dk, b_k, FEATURE_MAP)
            tl.store(dk_ptr + t * stride_dkt + offs_d * stride_dkd,
                     _rounded(b_dk, dk_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)
        if WANT_DV:
            tl.store(dv_ptr + t * stride_dvt + offs_e * stride_dve,
                     _rounded(b_dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask_e)


@triton.jit
def _reverse_walk(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, grad_denominator_ptr, denominator_ptr, g_ptr, ds0_ptr,
                  suffix_ptr,
                  cu_seqlens_ptr, q_arg, k_arg, v_arg, do_arg, dk_arg, dv_arg, grad_denominator_arg,
                  denominator_arg, g_arg, b, h, pid_bh, T, H, D, E, has_final_grad, num_chunks,
                  stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                  stride_vb, stride_vh, stride_vt, stride_ve, stride_dob, stride_doh, stride_dot, stride_doe,
                  stride_dkb, stride_dkh, stride_dkt, stride_dkd, stride_dvb, stride_dvh, stride_dvt, stride_dve,
                  stride_gb, stride_gh, stride_gd, stride_ge,
                  BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, INTERPRETED: tl.constexpr,
                  COMPENSATED: tl.constexpr, IS_VARLEN: tl.constexpr, NORMALIZE: tl.constexpr,
                  FEATURE_MAP: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr):
    """``chunked_backward_kernel``'s reverse walk (its comments give the algebra): dK (WANT_DK)
    and dV (WANT_DV) of one (batch, head), carrying R = G + sum of Q^T dO over the later chunks
    either way. The walk that makes dV writes dS_0's E columns, the one that makes dK its z
    column (NORMALIZE); one program with both makes all. Pointers as the kernel offsets them; the
    ``*_arg`` pointers as passed, for the token-by-token walk after the loop."""
    INPUT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    FLOAT32_PRECISION: tl.constexpr = "tf32"  # as in chunked_backward_kernel
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE
    # k feeds dV's products, and dK only through the feature map's derivative; v feeds only dK.
    LOADS_K: tl.constexpr = WANT_DV or FEATURE_MAP != "identity"
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, CHUNK)
    mask_d = offs_d < D
    mask_e = offs_e < E
    b_r = tl.full([BLOCK_D, BLOCK_E], 0.0, dtype=tl.float32)
    if has_final_grad:
        g_ptr += b * stride_gb + h * stride_gh
        b_r = tl.load(g_ptr + offs_d[:, None] * stride_gd + offs_e[None, :] * stride_ge,
                      mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    # Row s (token s) receives from column t (token t) when t >= s.
    upper = offs_c[:, None] <= offs_c[None, :]
    b_dkv_seen = tl.zeros([CHUNK], dtype=tl.float32)
    b_r_carry = tl.full([BLOCK_D, BLOCK_E], 0.0, dtype=tl.float32)
    # r a chunk ahead, as in the forward walk, where the walk has the registers for it: with a
    # feature map, phi'(k) needs them, and r loaded where it is used measured faster there.
    PREFETCH_R: tl.constexpr = NORMALIZE and WANT_DK and FEATURE_MAP == "identity"
    if PREFETCH_R:
        offs_last = (num_chunks - 1) * CHUNK + offs_c
        b_grad_denominator_next = tl.load(grad_denominator_ptr + offs_last, mask=offs_last < T, other=0.0)
    for i in range(num_chunks):
        offs_t = (num_chunks - 1 - i) * CHUNK + offs_c
        mask_t = offs_t < T
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_te = mask_t[:, None] & mask_e[None, :]
        b_q = tl.load(q_ptr + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=mask_td, other=0.0)
        if LOADS_K:
            b_k = tl.load(k_ptr + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=mask_td, other=0.0)
        if WANT_DK:
            b_v = tl.load(v_ptr + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve, mask=mask_te, other=0.0)
        b_do = tl.load(do_ptr + offs_t[:, None] * stride_dot + offs_e[None, :] * stride_doe, mask=mask_te,
                       other=0.0)
        if INTERPRETED:
            b_q = b_q.to(tl.float32)
            b_do = b_do.to(tl.float32)
            if LOADS_K:
                b_k = b_k.to(tl.float32)
            if WANT_DK:
                b_v = b_v.to(tl.float32)
        if NORMALIZE:
            if PREFETCH_R:
                b_grad_denominator = b_grad_denominator_next
                offs_next = offs_t - CHUNK
                b_grad_denominator_next = tl.load(grad_denominator_ptr + offs_next, mask=offs_next >= 0, other=0.0)
            elif WANT_DK:
                b_grad_denominator = tl.load(grad_denominator_ptr + offs_t, mask=mask_t, other=0.0)
            b_do = _numerator_gradient(b_do, denominator_ptr, offs_t, mask_t, MIXED_DTYPE, MIXED_DOT_DTYPE,
                                       INTERPRETED)
            b_q = b_q.to(MIXED_DOT_DTYPE)
            if LOADS_K:
                b_k = b_k.to(MIXED_DOT_DTYPE)
            if WANT_DK:
                b_v = b_v.to(MIXED_DOT_DTYPE)

        # The order of the products is the one measured fastest for each kind of walk: with both
        # gradients, both score tiles first, then the four products that read R; with one, R's
        # rounding first.
        if not (WANT_DK and WANT_DV):
            b_r_mixed = _rounded(b_r, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE)
        if WANT_DV:
            b_kq = tl.dot(b_k, tl.trans(b_q), input_precision=FLOAT32_PRECISION)        # [C, C]
            b_kq = tl.where(upper, b_kq, 0.0)
        if WANT_DK:
            b_vdo = tl.dot(b_v, tl.trans(b_do), input_precision=FLOAT32_PRECISION)      # [C, C]
            if NORMALIZE:
                b_vdo += b_grad_denominator[None, :]
            b_vdo = tl.where(upper, b_vdo, 0.0)
        if WANT_DK and WANT_DV:
            b_r_mixed = _rounded(b_r, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE)
        if WANT_DV:
            b_dv = tl.dot(b_k.to(MIXED_DOT_DTYPE), b_r_mixed, input_precision=FLOAT32_PRECISION)       # [C, E]
            b_dv = tl.dot(_rounded(b_kq, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE), b_do.to(MIXED_DOT_DTYPE),
                          acc=b_dv, input_precision=FLOAT32_PRECISION)
            if not WANT_DK:
                b_dkv_seen += tl.sum(b_dv * 0.0, 1)
        if WANT_DK:
            b_dk = tl.dot(b_v.to(MIXED_DOT_DTYPE), tl.trans(b_r_mixed), input_precision=FLOAT32_PRECISION)  # [C, D]
            b_dk = tl.dot(_rounded(b_vdo, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE), b_q.to(MIXED_DOT_DTYPE),
                          acc=b_dk, input_precision=FLOAT32_PRECISION)
            if NORMALIZE:  # dz after this chunk, from chunk_suffix_sums_kernel
                b_dk += tl.load(suffix_ptr + (pid_bh.to(tl.int64) * num_chunks + num_chunks - 1 - i) * D + offs_d,
                                mask=mask_d, other=0.0)[None, :]
        b_r, b_r_carry = _add_product(b_r, b_r_carry, tl.trans(b_q), b_do, COMPENSATED, FLOAT32_PRECISION, INTERPRETED)
        if WANT_DK:
            if FEATURE_MAP != "identity":  # b_k is loaded only then where dV is not wanted
                b_dk = _through_features(b_dk, b_k, FEATURE_MAP)
            if WANT_DV:
                b_dkv_seen += tl.sum(b_dk * 0.0, 1) + tl.sum(b_dv * 0.0, 1)
            else:
                b_dkv_seen += tl.sum(b_dk * 0.0, 1)
        if WANT_DK:
            tl.store(dk_ptr + offs_t[:, None] * stride_dkt + offs_d[None, :] * stride_dkd,
                     _rounded(b_dk, dk_ptr.dtype.element_ty, INTERPRETED), mask=mask_td)
        if WANT_DV:
            tl.store(dv_ptr + offs_t[:, None] * stride_dvt + offs_e[None, :] * stride_dve,
                     _rounded(b_dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask_te)

    state_width = E + 1 if NORMALIZE else E
    ds0_ptr += pid_bh.to(tl.int64) * D * state_width
    if WANT_DV:
        tl.store(ds0_ptr + offs_d[:, None] * state_width + offs_e[None, :], b_r, mask=mask_d[:, None] & mask_e[None, :])

    if tl.sum(b_dkv_seen, 0) != 0.0:  # an inf or NaN in this walk's dK_c or dV_c: redo them from G
        row = tl.program_id(0).to(tl.int64)
        batch, h, first, tokens = _sequence_after_loop(cu_seqlens_ptr, row, H, T, IS_VARLEN)
        _key_value_gradients_token_by_token(
            q_arg + batch * stride_qb + h * stride_qh + first * stride_qt,
            k_arg + batch * stride_kb + h * stride_kh + first * stride_kt,
            v_arg + batch * stride_vb + h * stride_vh + first * stride_vt,
            do_arg + batch * stride_dob + h * stride_doh + first * stride_dot,
            dk_arg + batch * stride_dkb + h * stride_dkh + first * stride_dkt,
            dv_arg + batch * stride_dvb + h * stride_dvh + first * stride_dvt,
            grad_denominator_arg + row * tokens, denominator_arg + row * tokens,
            g_arg + (row // H) * stride_gb + h * stride_gh, has_final_grad, tokens, D, E,
            stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_dot, stride_doe,
            stride_dkt, stride_dkd, stride_dvt, stride_dve, stride_gd, stride_ge,
            BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED, WANT_DK, WANT_DV)


@triton.jit
def _query_tile(q_ptr, i, num_chunks, reverse, offs_c, offs_d, mask_d, stride_qt, stride_qd, T, CHUNK: tl.constexpr):
    """(chunk, its token offsets, their mask, Q_c [C, D]) of step i of a walk (from the last chunk
    when ``reverse``): zero rows past T contribute nothing to the scores or the state."""
    chunk = tl.where(reverse != 0, num_chunks - 1 - i, i)
    offs_t = chunk * CHUNK + offs_c
    mask_t = offs_t < T
    b_q = tl.load(q_ptr + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                  mask=mask_t[:, None] & mask_d[None, :], other=0.0)
    return chunk, offs_t, mask_t, b_q


@triton.jit
def _key_tile(k_ptr, chunk, offs_d, offs_c, mask_d, stride_kt, stride_kd, T, CHUNK: tl.constexpr):
    """K_c^T [D, C] of chunk ``chunk``: zeros for tokens outside [0, T), so a chunk before the
    first or past the last loads nothing."""
    offs_t = chunk * CHUNK + offs_c
    mask_t = (offs_t >= 0) & (offs_t < T)
    return tl.load(k_ptr + offs_d[:, None] * stride_kd + offs_t[None, :] * stride_kt,
                   mask=mask_d[:, None] & mask_t[None, :], other=0.0)


@triton.jit
def chunked_kernel(
    q_ptr, k_ptr, v_ptr,            # inputs: q, k (B, H, T, D), v (B, H, T, E)
    o_ptr,                          # output (B, H, T, E), dtype of v
    initial_state_ptr,              # (B, H, D, E) float32 (E + 1 columns, z last, when NORMALIZE)
    final_state_ptr,                # (B, H, D, E) float32 (E + 1 when NORMALIZE), written
    cu_seqlens_ptr,                 # IS_VARLEN: (B + 1,) token offsets of the packed sequences
    denominator_ptr,                # NORMALIZE: d_t + eps (B, H, T) float32, contiguous, written
    T, H, D, E,
    reverse,                        # 1: walk the chunks backwards, so o_t sees tokens s >= t
    has_initial_state,              # 0: start from zeros (initial_state_ptr is then never read)
    eps,                            # NORMALIZE: added once to each denominator
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    stride_sfb, stride_sfh, stride_sfd, stride_sfe,
    BLOCK_D: tl.constexpr,          # >= D: the whole key dimension lives in one program
    BLOCK_E: tl.constexpr,          # the slice of value columns this program owns
    CHUNK: tl.constexpr,            # tokens per chunk
    INTERPRETED: tl.constexpr,      # True only under the CPU interpreter (see the header)
    COMPENSATED: tl.constexpr,      # long sequences: the state summed with a carry
    FLOAT32_PRECISION: tl.constexpr,  # float32 operands: "tf32x3", "tf32" or a split (see _dot)
    IS_VARLEN: tl.constexpr,        # q, k, v, o hold B sequences packed in one row (see the header)
    NORMALIZE: tl.constexpr,        # divide o_t by d_t + eps, d_t = q_t . z_t (forward walk only)
    TRANSPOSED: tl.constexpr,       # walk O_c^T and S^T (see the loops); float32 TF32 products only
):
    """One program per (batch, head, BLOCK_E value columns) walks the chunks: O_c, then S_c."""
    # The arguments as passed, for a token-by-token walk after the chunk loop (see the end).
    q_arg, k_arg, v_arg, o_arg, initial_state_arg = q_ptr, k_ptr, v_ptr, o_ptr, initial_state_ptr
    # Float32 intermediates (state, masked scores) meet the inputs in a tensor-core product:
    # rounded to bfloat16 for bfloat16 inputs (same range), kept float32 (TF32) for float16.
    INPUT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    # Under the interpreter every operand is widened to float32 after its rounding: a product of
    # two 16-bit floats is exact in float32, so the CPU computes the GPU's products.
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE

    # One flat grid, value blocks fastest: the programs sharing a head's q and k run together,
    # so the second one finds them in L2, and B * H is not limited to 65535 as grid axis 1 is.
    num_e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    pid = tl.program_id(0)
    pid_bh = pid // num_e_blocks
    pid_e = pid % num_e_blocks
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    if IS_VARLEN:  # sequence b is tokens [bos, eos) of the one packed row; its chunks start at bos
        bos = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        T = (tl.load(cu_seqlens_ptr + b + 1) - bos).to(tl.int32)
        q_ptr += bos * stride_qt + h * stride_qh
        k_ptr += bos * stride_kt + h * stride_kh
        v_ptr += bos * stride_vt + h * stride_vh
        o_ptr += bos * stride_ot + h * stride_oh
    else:
        q_ptr += b * stride_qb + h * stride_qh
        k_ptr += b * stride_kb + h * stride_kh
        v_ptr += b * stride_vb + h * stride_vh
        o_ptr += b * stride_ob + h * stride_oh

    offs_d = tl.arange(0, BLOCK_D)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, CHUNK)
    mask_d = offs_d < D
    mask_e = offs_e < E
    mask_de = mask_d[:, None] & mask_e[None, :]

    # The state as the chunk loop carries it: S (D x E), or S^T (E x D) in the transposed loop.
    if TRANSPOSED:
        b_state = tl.full([BLOCK_E, BLOCK_D], 0.0, dtype=tl.float32)
    else:
        b_state = tl.full([BLOCK_D, BLOCK_E], 0.0, dtype=tl.float32)
    # NORMALIZE: z, the sum of the keys so far (column E of the states), carried as K^T U beside the
    # state: the first column of b_key_sum (see _unit_columns).
    offs_u = tl.arange(0, UNIT_BLOCK)
    b_key_sum = tl.full([BLOCK_D, UNIT_BLOCK], 0.0, dtype=tl.float32)
    if has_initial_state:
        initial_state_ptr += b * stride_s0b + h * stride_s0h
        if TRANSPOSED:
            b_state = tl.load(initial_state_ptr + offs_e[:, None] * stride_s0e + offs_d[None, :] * stride_s0d,
                              mask=mask_e[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        else:
            b_state = tl.load(initial_state_ptr + offs_d[:, None] * stride_s0d + offs_e[None, :] * stride_s0e,
                              mask=mask_de, other=0.0).to(tl.float32)
        if NORMALIZE:
            b_key_sum = tl.load(initial_state_ptr + offs_d[:, None] * stride_s0d + E * stride_s0e + offs_u[None, :] * 0,
                                mask=mask_d[:, None] & (offs_u[None, :] == 0), other=0.0)

    # Inside a chunk, row i (token t) sees column j (token s) when s <= t, or s >= t in reverse.
    # The flags are runtime integers: they act outside the products, so one compiled kernel
    # serves the forward and backward passes.
    visible = tl.where(reverse != 0, offs_c[:, None] <= offs_c[None, :], offs_c[:, None] >= offs_c[None, :])

    num_chunks = (T + CHUNK - 1) // CHUNK
    b_carry = tl.full(b_state.shape, 0.0, dtype=tl.float32)
    b_key_sum_carry = tl.full([BLOCK_D, UNIT_BLOCK], 0.0, dtype=tl.float32)
    b_units = _unit_columns(CHUNK, tl.float32 if INTERPRETED else INPUT_DTYPE)
    # NORMALIZE: d_t + eps and z belong to no value block; the first block's program stores them.
    stored_tokens = tl.where(pid_e == 0, T, 0)
    stored_rows = tl.where(pid_e == 0, D, 0)
    # A masked zero times an inf or NaN of v is NaN: it would reach the chunk's earlier outputs. The
    # loop keeps its products and only sums 0 * O_c per row (NaN once anything in O_c is not finite);
    # a program that saw one redoes its tokens one by one after the loop.
    b_seen = tl.zeros([CHUNK], dtype=tl.float32)
    # TF32 products take float32 tiles from shared memory with the summed dimension contiguous, so
    # the one tile of k goes there in two layouts (Q K^T sums over D, K^T V over the tokens): the
    # compiler loads it into registers for that, outside the pipeline of copies, and each chunk
    # would wait on its own load. A chunk ahead in registers, that wait overlaps this chunk's work.
    # 16-bit tiles need no such load (one copy serves both products), nor does the split into
    # bfloat16 parts (its operands are made in registers); under 3xTF32 or with wider keys the
    # extra tile costs registers that those tiles lack, and it ran slower (an H100,
    # benchmarks/NOTES.md).
    PREFETCH_K: tl.constexpr = INPUT_DTYPE == tl.float32 and FLOAT32_PRECISION == "tf32" and BLOCK_D <= 64
    if PREFETCH_K:
        b_kt_next = _key_tile(k_ptr, tl.where(reverse != 0, num_chunks - 1, 0), offs_d, offs_c, mask_d,
                              stride_kt, stride_kd, T, CHUNK)
    if TRANSPOSED:
        # Under TF32 a product takes a register tile only as its first operand, and one from shared
        # memory only with its summed dimension contiguous. With 128-wide keys the untransposed
        # loop stores the whole state to shared memory every chunk for Q S, and its 32-row
        # products run as the older ``mma.sync``. Transposed, every product but the scores has the
        # state's or the values' rows as its own, and S^T stays in registers between them:
        #     O_c^T = S_{c-1}^T Q_c^T + V_c^T ((Q_c K_c^T) * M)^T,   S_c^T = S_{c-1}^T + V_c^T K_c
        # q serves Q K^T and S^T Q^T as it lies (D contiguous), the scores as computed are P^T
        # with the summed tokens contiguous, and k takes a second layout for V^T K.
        tl.static_assert(not NORMALIZE, "the transposed loop carries no normaliser")
        for i in range(num_chunks):
            chunk, offs_t, mask_t, b_q = _query_tile(q_ptr, i, num_chunks, reverse, offs_c, offs_d, mask_d,
                                                     stride_qt, stride_qd, T, CHUNK)  # b_q [C, D]
            b_kt = _key_tile(k_ptr, chunk, offs_d, offs_c, mask_d, stride_kt, stride_kd, T, CHUNK)  # [D, C]
            b_vt = tl.load(v_ptr + offs_e[:, None] * stride_ve + offs_t[None, :] * stride_vt,
                           mask=mask_e[:, None] & mask_t[None, :], other=0.0)          # [E, C]
            # A tile used as loaded or as carried goes to its product through shared memory; one
            # made by an operation (this select, true wherever the tile is nonzero) stays in registers.
            b_vt = tl.where(mask_e[:, None], b_vt, 0.0)
            b_scores = _dot(b_q, b_kt, None, FLOAT32_PRECISION, INTERPRETED)          # [C, C]
            b_scores = tl.where(visible, b_scores, 0.0)
            b_ot = _dot(tl.where(mask_e[:, None], b_state, 0.0), tl.trans(b_q), None,
                        FLOAT32_PRECISION, INTERPRETED)                                 # [E, C]
            b_ot = _dot(b_vt, tl.trans(b_scores), b_ot, FLOAT32_PRECISION, INTERPRETED)
            b_state, b_carry = _add_product(b_state, b_carry, b_vt, tl.trans(b_kt), COMPENSATED,
                                            FLOAT32_PRECISION, INTERPRETED)
            b_seen += tl.sum(b_ot * 0.0, 0)
            tl.store(o_ptr + offs_e[:, None] * stride_oe + offs_t[None, :] * stride_ot,
                     _rounded(b_ot, o_ptr.dtype.element_ty, INTERPRETED), mask=mask_e[:, None] & mask_t[None, :])
        final_state_ptr += b * stride_sfb + h * stride_sfh
        tl.store(final_state_ptr + offs_e[:, None] * stride_sfe + offs_d[None, :] * stride_sfd, b_state,
                 mask=mask_e[:, None] & mask_d[None, :])
    else:
        for i in range(num_chunks):
            chunk, offs_t, mask_t, b_q = _query_tile(q_ptr, i, num_chunks, reverse, offs_c, offs_d, mask_d,
                                                     stride_qt, stride_qd, T, CHUNK)  # b_q [C, D]
            # k is loaded transposed, ready for both Q K^T and K^T V; with PREFETCH_K a chunk ahead.
            if PREFETCH_K:
                b_kt = b_kt_next                                                       # [D, C]
                b_kt_next = _key_tile(k_ptr, tl.where(reverse != 0, num_chunks - 2 - i, i + 1), offs_d, offs_c, mask_d,
                                      stride_kt, stride_kd, T, CHUNK)
            else:
                b_kt = _key_tile(k_ptr, chunk, offs_d, offs_c, mask_d, stride_kt, stride_kd, T, CHUNK)  # [D, C]
            b_v = tl.load(v_ptr + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                          mask=mask_t[:, None] & mask_e[None, :], other=0.0)          # [C, E]
            if INTERPRETED:
                b_q = b_q.to(tl.float32)
                b_kt = b_kt.to(tl.float32)
                b_v = b_v.to(tl.float32)

            # O_c = Q_c S_{c-1} + ((Q_c K_c^T) * M) V_c, then S_c = S_{c-1} + K_c^T V_c. In this order
            # the state update is the last product of the loop, so the GPU leaves it running while the
            # program stores O_c and issues the next loads (Triton waits on every other product at once).
            b_scores = _dot(b_q, b_kt, None, FLOAT32_PRECISION, INTERPRETED)          # [C, C]
            b_scores = tl.where(visible, b_scores, 0.0)
            b_o = _dot(b_q.to(MIXED_DOT_DTYPE), _rounded(b_state, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                       None, FLOAT32_PRECISION, INTERPRETED)                             # [C, E]
            b_o = _dot(_rounded(b_scores, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE), b_v.to(MIXED_DOT_DTYPE),
                       b_o, FLOAT32_PRECISION, INTERPRETED)
            if NORMALIZE:
                b_o = _normalized(b_o, b_scores, b_q, b_key_sum, eps, denominator_ptr + (b * H + h) * T + offs_t,
                                  offs_t < stored_tokens)
                b_key_sum, b_key_sum_carry = _add_product(b_key_sum, b_key_sum_carry, b_kt, b_units, COMPENSATED,
                                                          FLOAT32_PRECISION, INTERPRETED)
            b_state, b_carry = _add_product(b_state, b_carry, b_kt, b_v, COMPENSATED, FLOAT32_PRECISION, INTERPRETED)
            b_seen += tl.sum(b_o * 0.0, 1)

            tl.store(o_ptr + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_oe,
                     _rounded(b_o, o_ptr.dtype.element_ty, INTERPRETED), mask=mask_t[:, None] & mask_e[None, :])

        final_state_ptr += b * stride_sfb + h * stride_sfh
        tl.store(final_state_ptr + offs_d[:, None] * stride_sfd + offs_e[None, :] * stride_sfe,
                 b_state, mask=mask_de)
    if NORMALIZE:
        tl.store(final_state_ptr + offs_d * stride_sfd + E * stride_sfe, tl.sum(b_key_sum, 1),
                 mask=offs_d < stored_rows)

    if tl.sum(b_seen, 0) != 0.0:  # an inf or NaN in some O_c: redo the outputs causally
        e_blocks = (E + BLOCK_E - 1) // BLOCK_E
        row = tl.program_id(0).to(tl.int64) // e_blocks
        first_column = (tl.program_id(0).to(tl.int64) - row * e_blocks) * BLOCK_E
        batch, h, first, tokens = _sequence_after_loop(cu_seqlens_ptr, row, H, T, IS_VARLEN)
        _outputs_token_by_token(q_arg + batch * stride_qb + h * stride_qh + first * stride_qt,
                                k_arg + batch * stride_kb + h * stride_kh + first * stride_kt,
                                v_arg + batch * stride_vb + h * stride_vh + first * stride_vt,
                                o_arg + batch * stride_ob + h * stride_oh + first * stride_ot,
                                initial_state_arg + (row // H) * stride_s0b + h * stride_s0h, has_initial_state,
                                tokens, D, E, first_column, reverse, eps, stride_qt, stride_qd, stride_kt, stride_kd,
                                stride_vt, stride_ve, stride_ot, stride_oe, stride_s0d, stride_s0e,
                                BLOCK_D, BLOCK_E, NORMALIZE, INTERPRETED)


@triton.jit
def chunked_backward_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,    # inputs: q, k (B, H, T, D), v and dO (B, H, T, E)
    grad_denominator_ptr,           # NORMALIZE: r (B, H, T) float32, contiguous (normalizer_gradient_kernel)
    denominator_ptr,                # NORMALIZE: the forward's d_t + eps (B, H, T) float32, contiguous
    dq_ptr, dk_ptr, dv_ptr,         # outputs (B, H, T, D), (B, H, T, D), (B, H, T, E), input dtype
    initial_state_ptr,              # S_0 (B, H, D, E) float32, read when has_initial_state
    g_ptr,                          # G, the gradient of S_T (B, H, D, E) float32, read when has_final_grad
    ds0_ptr,                        # dS_0 (B, H, D, E) float32, contiguous, written
                                    # (the three states have E + 1 columns, z last, when NORMALIZE)
    suffix_ptr,                     # NORMALIZE: dz after each chunk (B, H, NC, D) float32 (chunk_suffix_sums_kernel)
    cu_seqlens_ptr,                 # IS_VARLEN: (B + 1,) token offsets of the packed sequences
    T, H, D, E,
    compute_dq,                     # 0: no forward walk (q needs no gradient; dq_ptr unused), a grid
                                    # (B * H, 1 + SPLIT_WALKS)
    has_initial_state,              # 0: S_0 = 0 (initial_state_ptr is never read)
    has_final_grad,                 # 0: G = 0, S_T was not used (g_ptr is never read)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    stride_gb, stride_gh, stride_gd, stride_ge,
    BLOCK_D: tl.constexpr,          # >= D
    BLOCK_E: tl.constexpr,          # >= E: dK sums over every value column, so one program owns them all
    CHUNK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    COMPENSATED: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    NORMALIZE: tl.constexpr,        # the backward of chunked_kernel's NORMALIZE forward
    FEATURE_MAP: tl.constexpr,      # "identity", or the map that made q and k (features): dq and dk
                                    # are taken through its derivative before they are stored
    SPLIT_WALKS: tl.constexpr,      # the reverse walk as two programs, one for dV and one for dK
):
    """The whole backward of one (batch, head) in its row of programs: with compute_dq, program 0
    walks forward for dQ and the next one(s) backwards for dK, dV and dS_0; without, the reverse
    walk(s) alone. With SPLIT_WALKS the reverse walk is two programs, dV's then dK's, each
    carrying the same R: its products are done twice, and each program holds half the tiles. A
    walk is a chain of dependent loads and products: more programs a head let the GPU overlap one
    walk's waits with another's work (most where the heads are fewer than the multiprocessors)."""
    # The arguments as passed, for the token-by-token walks after the chunk loops (see the end).
    q_arg, k_arg, v_arg, do_arg = q_ptr, k_ptr, v_ptr, do_ptr
    grad_denominator_arg, denominator_arg = grad_denominator_ptr, denominator_ptr
    dq_arg, dk_arg, dv_arg, initial_state_arg, g_arg = dq_ptr, dk_ptr, dv_ptr, initial_state_ptr, g_ptr
    # Two walks over the chunks.
    # Forward walk, dQ: with P_c = S_c^T = S_0^T + sum over chunks up to c of V^T K (E x D) and
    # L the lower triangle (s <= t),
    #   dQ_c = dO_c P_{c-1} + ((dO_c V_c^T) * L) K_c,   P_c = P_{c-1} + V_c^T K_c.
    # Reverse walk, dK and dV: with R_c = G + sum over later chunks of Q^T dO (D x E) and U the
    # upper triangle (t >= s),
    #   dV_c = ((K_c Q_c^T) * U) dO_c + K_c R_c,   dK_c = ((V_c dO_c^T) * U) Q_c + V_c R_c^T,
    #   R_{c-1} = R_c + Q_c^T dO_c,  and R_0 = dS_0.
    # NORMALIZE, out_t = n_t / (d_t + eps) with d_t = q_t . z_t: the numerator's gradient is
    # g_t = dO_t / (d_t + eps) and the denominator's r_t = -(dO_t . out_t) / (d_t + eps). Both walks
    # run the plain backward on g, and d_t, a causal product of q and k with values 1, adds r_t to
    # every visible score gradient, r_t z_{c-1} to dq_t (z_{c-1}: z_0 and the earlier chunks' keys),
    # and to dk_s the sum of r_t q_t over the later chunks' tokens and the final z's gradient
    # (dz after the chunk; dz_0 after them all). r_t comes made, one number a token, from
    # normalizer_gradient_kernel, and dz per chunk from chunk_suffix_sums_kernel: carried next to
    # R it would take registers the reverse walk has not got. (The forward walk could make r, as
    # -(q_t . P_t g_t) / (d_t + eps), but only by running before the reverse walk instead of beside
    # it, and a walk alone on its multiprocessor waits on its loads.)
    # Precision as in chunked_kernel's TF32 launches: float32 operands (float16's state and
    # scores, and float32 inputs) in one TF32 product. The wrappers launch this kernel for float32
    # inputs only where PyTorch's float32 matmul precision allows TF32 (``fused_backward_config``).
    INPUT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    FLOAT32_PRECISION: tl.constexpr = "tf32"
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE

    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    if IS_VARLEN:  # as in chunked_kernel: both walks stay inside tokens [bos, eos)
        bos = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        T = (tl.load(cu_seqlens_ptr + b + 1) - bos).to(tl.int32)
        q_ptr += bos * stride_qt + h * stride_qh
        k_ptr += bos * stride_kt + h * stride_kh
        v_ptr += bos * stride_vt + h * stride_vh
        do_ptr += bos * stride_dot + h * stride_doh
        dq_ptr += bos * stride_dqt + h * stride_dqh
        dk_ptr += bos * stride_dkt + h * stride_dkh
        dv_ptr += bos * stride_dvt + h * stride_dvh
    else:
        q_ptr += b * stride_qb + h * stride_qh
        k_ptr += b * stride_kb + h * stride_kh
        v_ptr += b * stride_vb + h * stride_vh
        do_ptr += b * stride_dob + h * stride_doh
        dq_ptr += b * stride_dqb + h * stride_dqh
        dk_ptr += b * stride_dkb + h * stride_dkh
        dv_ptr += b * stride_dvb + h * stride_dvh

    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, CHUNK)
    mask_d = offs_d < D
    mask_e = offs_e < E
    num_chunks = (T + CHUNK - 1) // CHUNK
    grad_denominator_ptr += (b * H + h) * T
    denominator_ptr += (b * H + h) * T
    # As in chunked_kernel: each walk sums 0 * its gradient tiles per row, and a walk whose tiles
    # held an inf or NaN is redone one token at a time after the loops.
    if (compute_dq != 0) & (tl.program_id(1) == 0):  # the forward walk: dQ
        b_p = tl.full([BLOCK_E, BLOCK_D], 0.0, dtype=tl.float32)
        b_z = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
        if has_initial_state:
            initial_state_ptr += b * stride_s0b + h * stride_s0h
            b_p = tl.load(initial_state_ptr + offs_e[:, None] * stride_s0e + offs_d[None, :] * stride_s0d,
                          mask=mask_e[:, None] & mask_d[None, :], other=0.0)
            if NORMALIZE:
                b_z = tl.load(initial_state_ptr + offs_d * stride_s0d + E * stride_s0e, mask=mask_d, other=0.0)
        # Row t (token t) receives from column s (token s) when s <= t.
        lower = offs_c[:, None] >= offs_c[None, :]
        b_dq_seen = tl.zeros([CHUNK], dtype=tl.float32)
        b_p_carry = tl.full([BLOCK_E, BLOCK_D], 0.0, dtype=tl.float32)
        if NORMALIZE:  # r a chunk ahead: the pipeline copies ahead only what feeds a product's operands
            b_grad_denominator_next = tl.load(grad_denominator_ptr + offs_c, mask=offs_c < T, other=0.0)
        for i in range(num_chunks):
            offs_t = i * CHUNK + offs_c
            mask_t = offs_t < T
            mask_td = mask_t[:, None] & mask_d[None, :]
            b_do = tl.load(do_ptr + offs_t[:, None] * stride_dot + offs_e[None, :] * stride_doe,
                           mask=mask_t[:, None] & mask_e[None, :], other=0.0)           # [C, E]
            if FEATURE_MAP != "identity":  # phi(q), for phi'(q): loaded first, its wait under the products
                b_phi_q = tl.load(q_ptr + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                                  mask=mask_td, other=0.0)
            b_vt = tl.load(v_ptr + offs_e[:, None] * stride_ve + offs_t[None, :] * stride_vt,
                           mask=mask_e[:, None] & mask_t[None, :], other=0.0)           # [E, C]
            b_k = tl.load(k_ptr + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                          mask=mask_td, other=0.0)                                      # [C, D]
            if INTERPRETED:
                b_do = b_do.to(tl.float32)
                b_vt = b_vt.to(tl.float32)
                b_k = b_k.to(tl.float32)
            if NORMALIZE:
                b_grad_denominator = b_grad_denominator_next
                b_grad_denominator_next = tl.load(grad_denominator_ptr + CHUNK + offs_t, mask=CHUNK + offs_t < T,
                                                  other=0.0)
                b_do = _numerator_gradient(b_do, denominator_ptr, offs_t, mask_t, MIXED_DTYPE, MIXED_DOT_DTYPE,
                                           INTERPRETED)
                b_vt = b_vt.to(MIXED_DOT_DTYPE)
                b_k = b_k.to(MIXED_DOT_DTYPE)
            b_scores = tl.dot(b_do, b_vt, input_precision=FLOAT32_PRECISION)          # [C, C]
            if NORMALIZE:
                b_scores += b_grad_denominator[:, None]
            b_scores = tl.where(lower, b_scores, 0.0)
            b_dq = tl.dot(b_do.to(MIXED_DOT_DTYPE), _rounded(b_p, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                          input_precision=FLOAT32_PRECISION)                             # [C, D]
            b_dq = tl.dot(_rounded(b_scores, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                          b_k.to(MIXED_DOT_DTYPE), acc=b_dq, input_precision=FLOAT32_PRECISION)
            if NORMALIZE:
                b_dq += b_grad_denominator[:, None] * b_z[None, :]
                b_z += tl.sum(b_k.to(tl.float32), 0)
            b_p, b_p_carry = _add_product(b_p, b_p_carry, b_vt, b_k, COMPENSATED, FLOAT32_PRECISION, INTERPRETED)
            if FEATURE_MAP != "identity":
                b_dq = _through_features(b_dq, b_phi_q, FEATURE_MAP)
            b_dq_seen += tl.sum(b_dq * 0.0, 1)
            tl.store(dq_ptr + offs_t[:, None] * stride_dqt + offs_d[None, :] * stride_dqd,
                     _rounded(b_dq, dq_ptr.dtype.element_ty, INTERPRETED), mask=mask_td)
        if tl.sum(b_dq_seen, 0) != 0.0:  # an inf or NaN in some dQ_c: redo dq causally, from S_0 and z_0
            row = tl.program_id(0).to(tl.int64)
            batch, h_dq, first, T_dq = _sequence_after_loop(cu_seqlens_ptr, row, H, T, IS_VARLEN)
            _query_gradients_token_by_token(
                do_arg + batch * stride_dob + h_dq * stride_doh + first * stride_dot,
                v_arg + batch * stride_vb + h_dq * stride_vh + first * stride_vt,
                k_arg + batch * stride_kb + h_dq * stride_kh + first * stride_kt,
                q_arg + batch * stride_qb + h_dq * stride_qh + first * stride_qt,
                dq_arg + batch * stride_dqb + h_dq * stride_dqh + first * stride_dqt,
                grad_denominator_arg + row * T_dq, denominator_arg + row * T_dq,
                initial_state_arg + (row // H) * stride_s0b + h_dq * stride_s0h, has_initial_state,
                T_dq, D, E, stride_dot, stride_doe, stride_vt, stride_ve, stride_kt, stride_kd, stride_qt, stride_qd,
                stride_dqt, stride_dqd, stride_s0d, stride_s0e, BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)

    # The reverse walk(s), the row's last program(s): dK, dV and dS_0. Their arguments as passed
    # and as offset above, the strides, and the constexprs.
    walk_args = (q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, grad_denominator_ptr, denominator_ptr, g_ptr, ds0_ptr,
                 suffix_ptr,
                 cu_seqlens_ptr, q_arg, k_arg, v_arg, do_arg, dk_arg, dv_arg, grad_denominator_arg,
                 denominator_arg, g_arg, b, h, pid_bh, T, H, D, E, has_final_grad, num_chunks,
                 stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_ve, stride_dob, stride_doh, stride_dot, stride_doe,
                 stride_dkb, stride_dkh, stride_dkt, stride_dkd, stride_dvb, stride_dvh, stride_dvt, stride_dve,
                 stride_gb, stride_gh, stride_gd, stride_ge)
    if SPLIT_WALKS:  # two programs after dQ's: dV (and dS_0's E columns), then dK (and dz_0)
        if tl.program_id(1) >= compute_dq:
            if tl.program_id(1) == compute_dq:
                _reverse_walk(*walk_args, BLOCK_D, BLOCK_E, CHUNK, INTERPRETED, COMPENSATED, IS_VARLEN, NORMALIZE,
                              FEATURE_MAP, False, True)
            else:
                _reverse_walk(*walk_args, BLOCK_D, BLOCK_E, CHUNK, INTERPRETED, COMPENSATED, IS_VARLEN, NORMALIZE,
                              FEATURE_MAP, True, False)
    elif tl.program_id(1) == tl.num_programs(1) - 1:
        _reverse_walk(*walk_args, BLOCK_D, BLOCK_E, CHUNK, INTERPRETED, COMPENSATED, IS_VARLEN, NORMALIZE,
                      FEATURE_MAP, True, True)


#: Keys a ``config`` may set; missing keys keep the rule's value (``default_config``).
CONFIG_KEYS = ("BLOCK_E", "CHUNK", "num_warps", "num_stages")


def check_config(config):
    """A TypeError or ValueError naming the key and its limit for a config the kernels cannot run:
    BLOCK_E and CHUNK powers of two of at least 16 (``tl.dot``'s smallest tile on a GPU),
    num_warps a power of two up to 32, num_stages at least 1."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; expected some of {CONFIG_KEYS}")
    for key, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"config {key} must be an int, got {value!r}")
        if key in ("BLOCK_E", "CHUNK") and (value < 16 or value & (value - 1)):
            raise ValueError(f"config {key} must be a power of two >= 16, got {value}")
        if key == "num_warps" and not (1 <= value <= 32 and value & (value - 1) == 0):
            raise ValueError(f"config num_warps must be a power of two from 1 to 32, got {value}")
        if key == "num_stages" and value < 1:
            raise ValueError(f"config num_stages must be at least 1, got {value}")


#: Configurations for a benchmark to sweep on bfloat16 inputs with D = E in {64, 128}; all fit an
#: H100/H200's shared memory. Narrower value blocks give more programs per head but re-read q
#: and k; longer chunks halve the sequential steps but quadruple the score tile; more stages keep
#: more loads in flight.
TUNING_CANDIDATES = [
    {"BLOCK_E": 32, "CHUNK": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_E": 64, "CHUNK": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_E": 128, "CHUNK": 64, "num_warps": 8, "num_stages": 3},
]


def _block(n):
    """The power of two covering n, at least 16: the smallest ``tl.dot`` dimension on a GPU."""
    return max(16, triton.next_power_of_2(n))


def _shared_memory_estimate(block_d, config, dtype, transposed=False):
    """Bytes of shared memory: ``num_stages`` chunks of q, k and v in flight, plus the state as a
    product operand (counted at 4 bytes, as float16 inputs need), which the transposed loop
    keeps in registers. Other operands that go through shared memory (TF32's second copy of k,
    the scores) are not counted: on the rule's tiles the compiled kernels need less than this
    estimate (188,416 against 221,184 bytes at BLOCK_D 128, BLOCK_E 32, CHUNK 64, 3 stages)."""
    chunk_bytes = config["CHUNK"] * (2 * block_d + config["BLOCK_E"]) * dtype.itemsize
    return config["num_stages"] * chunk_bytes + (0 if transposed else block_d * config["BLOCK_E"] * 4)


#: Key blocks (BLOCK_D) on which float32 under one TF32 product walks the transposed loop
#: (``TRANSPOSED`` in ``chunked_kernel``): 128, where the rule's tiles for it ran faster (an H100,
#: benchmarks/NOTES.md, 2026-12-07). At 64 it ran slower than the untransposed loop (which loads k
#: a chunk ahead there); at 256, not timed, the state of a 32-column block alone would take 64
#: registers a thread on 4 warps, before the tiles of q, k and the scores.
TRANSPOSED_KEY_BLOCKS = frozenset({128})


def _transposed(dtype, precision, block_d, normalize):
    """Whether a launch walks the transposed loop: float32 inputs, one TF32 product, a key block
    in ``TRANSPOSED_KEY_BLOCKS``, and not the normalised forward (whose loop carries z)."""
    return dtype == torch.float32 and precision == "tf32" and block_d in TRANSPOSED_KEY_BLOCKS and not normalize


#: (multiprocessors, shared memory per block) of an H100/H200, assumed where no GPU answers.
_NOMINAL_LIMITS = (132, 232448)


#: ``torch.get_float32_matmul_precision()`` -> the products of float32 operands: the split into
#: bfloat16 parts for "highest" (3xTF32 where ``split_is_right`` or ``split_is_accurate`` says
#: no, and in the normalised attention; see the module docstring), one TF32 product for "high"
#: and "medium". "tf32x3" in place of "bf16x3_manual" gives 3xTF32 everywhere.
FLOAT32_PRECISIONS = {"highest": "bf16x3_manual", "high": "tf32", "medium": "tf32"}


def float32_precision(normalized=False):
    """The products of float32 operands under PyTorch's current setting: ``FLOAT32_PRECISIONS``'s,
    the split into bfloat16 parts (about 6e-6) for "highest", the default, "tf32" (about 1.5e-3) for
    "high" and "medium"; the split becomes "tf32x3" (about 3e-7) for the normalised attention
    (``normalized``), whose dq cancels."""
    precision = FLOAT32_PRECISIONS[torch.get_float32_matmul_precision()]
    return "tf32x3" if normalized and precision == BF16X3_MANUAL.value else precision


#: The fewest elements an output of a call (o, the states, each gradient) may have for the call
#: to take the split: its relative error is about 6e-6 an element at random, and the norm of
#: the error over a few dozen elements can pass float32's 1e-5 (1.2e-5 at (B, H, T, D, E) =
#: (1, 2, 1, 5, 7) over 30 random draws under the interpreter, which computes the split exactly);
#: over 512 elements or more the largest was 6.1e-6. Smaller calls take 3xTF32.
SPLIT_MIN_ELEMENTS = 1024


def split_is_accurate(q, v, sequences):
    """Whether a call on ``q`` (B, H, T, D) and ``v`` with ``sequences`` states (B, or N packed
    sequences) has outputs large enough for the split (``SPLIT_MIN_ELEMENTS``); symmetric in D
    and E, so that the backward's passes, which swap them, decide as the forward did."""
    batch, heads, tokens, D = q.shape
    E = v.shape[-1]
    return heads * min(batch * tokens * min(D, E), sequences * D * E) >= SPLIT_MIN_ELEMENTS


#: (state rows, value columns, chunk tokens) of the tiles on which the split into bfloat16 parts
#: ran right on a GPU (an H100, Triton 3.6: forward, S_T and every gradient within 6.5e-6 of
#: float64, in this file's kernels or in scan's, whose tiles fail alike; benchmarks/NOTES.md,
#: 2026-12-05): every tile of both float32 rules for heads of 16 to 256 but the wrong ones below
#: and three of scan's that no GPU has run the split on (16 x 64 and 32 x 64 at 32 tokens, 32 x 16
#: at 64), which take 3xTF32.
SPLIT_TILES = frozenset({
    (16, 16, 64), (16, 32, 64), (16, 64, 64), (32, 32, 64), (32, 64, 64), (64, 64, 64), (64, 128, 64),
    (64, 32, 32), (64, 64, 32), (128, 16, 32), (128, 32, 32), (128, 64, 32), (128, 64, 16), (256, 16, 32),
    (256, 32, 32), (256, 64, 32),
})


def split_is_right(block_d, block_e, chunk):
    """Whether a launch on a tile of ``block_d`` state rows, ``block_e`` value columns and
    ``chunk`` tokens may take the split into bfloat16 parts: only on a tile measured right
    (``SPLIT_TILES``); elsewhere 3xTF32. Triton 3.6 compiles the split wrong for sm_90 on 64-row
    tiles of at most 32 columns with 64-token chunks: errors near 1, inf, and with 8 warps an
    illegal memory access (so is Triton's own "bf16x3" there)."""
    return (block_d, block_e, chunk) in SPLIT_TILES


def default_config(D, E, dtype, *, heads=None, multiprocessors=None, shared_memory=_NOMINAL_LIMITS[1],
                   precision="tf32x3", transposed=False):
    """The wrapper's rule for key size D, value size E and input dtype, given B * H (``heads``)
    and the GPU's multiprocessors and shared memory (None: unknown); for float32 inputs,
    ``precision`` is their products' (``float32_precision()``: "bf16x3_manual", "tf32x3" or
    "tf32"; a split into bfloat16 parts takes 3xTF32's tiles).

    Registers decide most of it (ptxas' register and stack use for sm_90): each thread holds
    BLOCK_D * BLOCK_E / (32 * num_warps) float32 values of the state beside the other tiles.
    - float32: tensor-core tiles as for 16-bit inputs, each twice as large: 64-token chunks up to
      D = 64 and 32 beyond, 64 value columns up to D = 128 and 32 beyond, 3 stages of loads
      (one program a multiprocessor hides its load latency only with its own pipeline). The
      narrowing of value blocks on an idle GPU applies as for 16-bit inputs. Timed with
      ``benchmarks/float32_sweep.py`` on an H200 (benchmarks/NOTES.md, 2026-12-04):
      - TF32: from D = 65 to 128, whole value heads up to 128 columns (q and k read once per
        head), and as for bfloat16 4 warps while the state takes at most 64 registers a thread
        (else 8). At (8, 16, 4096, 128) 1.5x faster than 64 columns on 8 warps, 2 stages.
      - 3xTF32 also holds each operand's TF32 part and remainder, and its tiles spill on sm_90
        (less or not at all at 16-token chunks): 4 warps up to D = 64, 8 beyond, where only 2
        stages were timed (``method="auto"`` runs "recurrent" there).
    - 16-bit inputs: value blocks of 64 or 128 columns for D <= 128 (q and k read once per head
      up to E = 128), 32 at D > 128; halved down to 32 while the programs number fewer than half
      the multiprocessors, so that a head's programs share its q and k through L2.
    - bfloat16: at most 64 value columns (32 past D = 128), so the state takes at most 64
      registers a thread on 4 warps; 4 stages of loads.
    - float16: 8 warps, 32-token chunks for D > 64 (its TF32 products hold float32 copies of q,
      the state and the scores), 3 stages.
    - ``transposed`` (the transposed TF32 loop, ``_transposed``): 64-token chunks where value
      blocks are 32 wide (few heads); its state lives in registers, which leaves room for them.
      At (2, 16, 16384, 128) 2.9x faster than 32-token chunks on an H100 (benchmarks/NOTES.md,
      2026-12-07).
    Stages down to 2, then chunk length, then the last stages shrink until the loads fit the
    GPU's shared memory.
    """
    block_d = _block(D)
    block_e = min(max(64, _block(E)), 128) if block_d <= 128 else 32
    wide_tf32 = dtype == torch.float32 and precision == "tf32" and 64 < block_d <= 128
    if dtype != torch.float16 and not wide_tf32:
        block_e = min(block_e, 64)
    if heads is not None and multiprocessors is not None:
        while block_e > 32 and 2 * heads * triton.cdiv(E, block_e) < multiprocessors:
            block_e //= 2
    if dtype == torch.float32 and precision == "tf32":
        config = {"BLOCK_E": block_e, "CHUNK": 64 if block_d <= 64 or (transposed and block_e <= 32) else 32,
                  "num_warps": 4 if block_d * block_e <= 8192 else 8, "num_stages": 3}
    elif dtype == torch.float32:
        config = {"BLOCK_E": block_e, "CHUNK": 64 if block_d <= 64 else 32, "num_warps": 4 if block_d <= 64 else 8,
                  "num_stages": 3 if block_d <= 64 else 2}
    elif dtype == torch.bfloat16:
        config = {"BLOCK_E": block_e, "CHUNK": 64, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_E": block_e, "CHUNK": 64 if block_d <= 64 else 32, "num_warps": 8, "num_stages": 3}
    while _shared_memory_estimate(block_d, config, dtype, transposed) > shared_memory:
        if config["num_stages"] > 2:
            config["num_stages"] -= 1
        elif config["CHUNK"] > 16:
            config["CHUNK"] //= 2
        elif config["num_stages"] > 1:
            config["num_stages"] -= 1
        else:
            break
    return config


# The rule costs microseconds of Python; a launch costs tens of them in all, and at small sizes
# the host, not the GPU, sets the pace. Callers must not modify the dict it returns.
_cached_default_config = functools.lru_cache(maxsize=256)(default_config)


@functools.lru_cache(maxsize=None)  # asked once per device, not at every launch
def _device_limits(device):
    """(multiprocessors, opt-in shared memory per block) of a GPU; an H100/H200's elsewhere."""
    if device.type != "cuda":
        return _NOMINAL_LIMITS
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin


#: Beyond this many chunks the states are summed with a carry (``_add_product``): tensor-core
#: products accumulate with truncation, whose bias grows with the number of chunks. Below it the
#: bias stays well under bfloat16's and TF32's rounding (3xTF32 adds its products rounded, see
#: ``_add_product``), and the carry would cost registers.
COMPENSATED_FROM_CHUNKS = 4096


def _compensated(T, chunk):
    return -(-T // chunk) > COMPENSATED_FROM_CHUNKS  # chunks, rounded up


@functools.lru_cache(maxsize=256)
def _launch_plan(B, H, T, D, E, dtype, limits, interpreted, precision, overrides, normalize=False):
    """(grid, launch keywords) of ``chunked_kernel`` for one shape: the rule with the (checked)
    ``overrides`` applied, then the constexprs. Pure, so cached: a call at a known shape skips the
    rule's microseconds. ``precision``: the float32 products' (``float32_precision``); a split
    into bfloat16 parts becomes 3xTF32 on a tile where ``split_is_right`` says no. ``normalize``:
    the normalised forward, which never walks the transposed loop. The returned dict is shared;
    callers must not modify it."""
    multiprocessors, shared_memory = limits
    if interpreted:  # programs run one after another: no multiprocessors to fill
        multiprocessors = None
    transposed = _transposed(dtype, precision, _block(D), normalize)
    chosen = {**_cached_default_config(D, E, dtype, heads=B * H, multiprocessors=multiprocessors,
                                       shared_memory=shared_memory, precision=precision, transposed=transposed),
              **dict(overrides)}
    if precision == BF16X3_MANUAL.value and not split_is_right(_block(D), chosen["BLOCK_E"], chosen["CHUNK"]):
        precision = "tf32x3"
    grid = (B * H * triton.cdiv(E, chosen["BLOCK_E"]),)
    return grid, {"BLOCK_D": _block(D), "BLOCK_E": chosen["BLOCK_E"], "CHUNK": chosen["CHUNK"],
                  "INTERPRETED": interpreted, "COMPENSATED": _compensated(T, chosen["CHUNK"]),
                  "FLOAT32_PRECISION": precision, "TRANSPOSED": transposed,
                  "num_warps": chosen["num_warps"], "num_stages": chosen["num_stages"]}


def _launch(q, k, v, initial_state, *, reverse, config, cu_seqlens=None, denominator=None, eps=0.0,
            out_dtype=None, normalized=False):
    """One pass of the kernel over (q, k, v): returns (o, final_state), both freshly allocated,
    o in ``out_dtype`` (None: v's). With ``cu_seqlens``, q, k, v hold its sequences packed in one
    row, and the states are per sequence: (N, H, D, E). With ``denominator``, a (B, H, T) float32
    tensor that receives d_t + eps, the normalised forward (NORMALIZE): its states have E + 1
    columns, z last (not with ``cu_seqlens``). ``normalized``: a pass of the normalised backward,
    or a plain product whose caller normalises by its last column, whose float32 products keep
    3xTF32 as the normalised forward's do (``float32_precision``)."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    if cu_seqlens is not None:  # one program row and one state per packed sequence
        B = cu_seqlens.shape[0] - 1
    # 16-bit inputs meet float32 operands only as float16's state and scores, exact in TF32.
    normalize = denominator is not None
    precision = float32_precision(normalize or normalized) if q.dtype == torch.float32 else "tf32"
    if precision == BF16X3_MANUAL.value and not split_is_accurate(q, v, B):
        precision = "tf32x3"
    # config was checked by check_config in _run_validated; as sorted items it keys the cache.
    grid, launch_keywords = _launch_plan(B, H, T, D, E, q.dtype, _device_limits(q.device),
                                         triton.knobs.runtime.interpret, precision,
                                         () if config is None else tuple(sorted(config.items())), normalize)
    # o laid out as v (any dense strides): a (B, T, H, E) buffer seen as (B, H, T, E) gets an o
    # that the caller reshapes back without a copy, and a leaf gets a gradient it keeps as is.
    o = torch.empty_like(v, dtype=v.dtype if out_dtype is None else out_dtype)
    # Always written, even where a backward pass discards it: B * H * D * E floats, against the
    # T * (2 * D + 2 * E) elements each pass moves, and one kernel variant fewer to compile.
    final_state = torch.empty((B, H, D, E + normalize), dtype=torch.float32, device=v.device)
    # Without an initial state (or a denominator), final_state stands in for its pointer; the
    # kernel never reads it.
    has_initial_state = initial_state is not None
    initial_state = initial_state if has_initial_state else final_state
    with _launch_guard():
        chunked_kernel[grid](
            q, k, v, o, initial_state, final_state, final_state if cu_seqlens is None else cu_seqlens,
            denominator if normalize else final_state,
            T, H, D, E, int(reverse), int(has_initial_state), float(eps),
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *initial_state.stride(), *final_state.stride(),
            IS_VARLEN=cu_seqlens is not None, NORMALIZE=normalize, **launch_keywords,
        )
    return o, final_state


#: The fused backward holds R (D x E), two [C, C] score tiles and the dK and dV tiles of a chunk
#: in registers at once, which fits heads up to 64 wide without spills (float16 and float32
#: inputs at 32-token chunks).
FUSED_BACKWARD_MAX_BLOCK = 64
_FUSED_BACKWARD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fused_backward_shared_memory(fused, dtype, normalize=False):
    """Bytes of shared memory of the reverse walk: ``num_stages`` chunks of q, k, v and dO (and
    d + eps when normalising) in flight, plus R and its transpose as product operands (counted at
    4 bytes)."""
    chunk_bytes = fused["CHUNK"] * ((2 * fused["BLOCK_D"] + 2 * fused["BLOCK_E"]) * dtype.itemsize + 4 * normalize)
    return fused["num_stages"] * chunk_bytes + 2 * fused["BLOCK_D"] * fused["BLOCK_E"] * 4


def fused_backward_config(D, E, dtype, config=None, *, shared_memory=_NOMINAL_LIMITS[1], normalize=False,
                          heads=None, multiprocessors=None, precision=None):
    """Launch parameters of ``chunked_backward_kernel``, or None where the backward runs
    ``chunked_kernel`` three times instead: heads wider than FUSED_BACKWARD_MAX_BLOCK, or float32
    inputs whose ``precision`` (``float32_precision()``) is not one TF32 product, the kernel's
    (the passes keep the split or 3xTF32 of "highest"), and float32's plain product where its
    walks do not split (below): there the passes ran faster on an H100 than the fused plan with
    any of the stages, warps or chunks timed, while with split walks, and in the normalised
    backward, the fused launch was the faster (benchmarks/NOTES.md, 2026-12-07).
    CHUNK: the forward's, at most 64 for bfloat16 and 32 for float16 and float32 (whose float32
    intermediates need the registers). A walk's parallelism is its load pipeline and the other
    walk's program: 4 warps, 4 stages (3 for ``normalize``, the normalised backward, whose walks
    wait longer on their products: two programs then share a multiprocessor; timed faster on an
    H200), fewer stages until the loads in flight fit ``shared_memory``. SPLIT_WALKS where the
    ``heads`` (B * H, or sequences * H when packed) are so few that every program of the split
    launch, three a head, has a multiprocessor of its own (3 * heads <= multiprocessors): the
    longest program, the reverse walk, then makes one of its two gradients, four of its seven
    products a chunk (R's update in both). On an H200 faster with 8 heads, slower with 128; see
    benchmarks/fused_backward_variants.py."""
    block_d, block_e = _block(D), _block(E)
    if dtype not in _FUSED_BACKWARD_DTYPES or max(block_d, block_e) > FUSED_BACKWARD_MAX_BLOCK:
        return None
    if dtype == torch.float32 and precision != "tf32":
        return None
    heads_known = heads is not None and multiprocessors is not None
    split_walks = heads_known and 3 * heads <= multiprocessors
    if dtype == torch.float32 and not normalize and heads_known and not split_walks:
        return None
    chunk = min(64 if dtype == torch.bfloat16 else 32, (config or {}).get("CHUNK", 64))
    fused = {"BLOCK_D": block_d, "BLOCK_E": block_e, "CHUNK": chunk, "num_warps": 4,
             "num_stages": 3 if normalize else 4,
             "SPLIT_WALKS": split_walks}
    while fused["num_stages"] > 1 and _fused_backward_shared_memory(fused, dtype, normalize) > shared_memory:
        fused["num_stages"] -= 1
    return fused


@functools.lru_cache(maxsize=256)
def _backward_plan(heads, T, D, E, dtype, limits, interpreted, overrides, normalize=False, precision=None):
    """Launch keywords of ``chunked_backward_kernel`` for one shape (``fused_backward_config``
    with the constexprs), or None where the backward runs ``chunked_kernel`` three times instead.
    ``precision``: float32's products at this call (``float32_precision``). Cached like
    ``_launch_plan``; the returned dict is shared and must not be modified."""
    multiprocessors, shared_memory = limits
    if interpreted:  # programs run one after another: no multiprocessors to fill
        multiprocessors = None
    fused = fused_backward_config(D, E, dtype, dict(overrides), shared_memory=shared_memory, normalize=normalize,
                                  heads=heads, multiprocessors=multiprocessors, precision=precision)
    if fused is None:
        return None
    return {**fused, "INTERPRETED": interpreted, "COMPENSATED": _compensated(T, fused["CHUNK"])}


#: Tokens a program of ``normalizer_gradient_kernel`` takes in the backward in passes (the fused
#: backward's take its walks' chunk).
NORMALIZER_GRADIENT_TOKENS = 64


def _normalizer_gradient(grad_o, o, denominator, *, with_numerator=False, q=None,
                         tokens=NORMALIZER_GRADIENT_TOKENS):
    """(r, g, chunk sums) of the normalised backward (``normalizer_gradient_kernel``, ``tokens`` a
    program): r (B, H, T) float32; with ``with_numerator``, g (B, H, T, E) contiguous, bfloat16 for
    bfloat16 inputs, else float32; with ``q``, the sum of r_t q_t over each chunk of ``tokens``
    tokens, (B, H, NC, D) float32. Each of the last two is None where it was not asked for."""
    B, H, T, E = o.shape
    grad_denominator = torch.empty_like(denominator)
    chunk_sums = None
    if q is not None:
        chunk_sums = torch.empty((B, H, triton.cdiv(T, tokens), q.shape[-1]), dtype=torch.float32, device=o.device)
    numerator = None
    if with_numerator:
        numerator = torch.empty((B, H, T, E), device=o.device,
                                dtype=torch.bfloat16 if grad_o.dtype == torch.bfloat16 else torch.float32)
    q_arg = grad_o if q is None else q  # a stand-in the kernel never reads without q
    with _launch_guard():
        normalizer_gradient_kernel[(B * H, triton.cdiv(T, tokens))](
            grad_o, o, denominator, grad_denominator, grad_denominator if numerator is None else numerator,
            q_arg, grad_denominator if chunk_sums is None else chunk_sums,
            T, H, E, 1 if q is None else q.shape[-1], *grad_o.stride(), *o.stride(), *q_arg.stride(),
            BLOCK_T=tokens, BLOCK_E=_block(E), BLOCK_D=1 if q is None else _block(q.shape[-1]),
            INTERPRETED=triton.knobs.runtime.interpret, WRITE_NUMERATOR=with_numerator,
            WRITE_CHUNK_SUMS=q is not None)
    return grad_denominator, numerator, chunk_sums


#: Chunks one step of ``chunk_suffix_sums_kernel``'s scan takes.
SUFFIX_SCAN_CHUNKS = 64


#: Tokens and columns a program of ``normalizer_terms_kernel`` takes.
NORMALIZER_TERMS_TOKENS, NORMALIZER_TERMS_COLUMNS = 64, 32


def _normalizer_terms(plain, x, phi, grad_denominator, carry, *, reverse, out, feature_map="identity"):
    """``normalizer_terms_kernel`` into ``out``: dQ from the plain pass's float32 dQ and the keys
    x (``carry``: z_0 or None), or with ``reverse`` dK from dK's and the queries (``carry``: G_z
    or None), then through ``feature_map``'s derivative at ``phi`` (q's features for dQ, k's for
    dK). Returns dz_0 (B, H, D) float32 when ``reverse``."""
    B, H, T, D = x.shape
    total = torch.empty((B, H, D), dtype=torch.float32, device=x.device) if reverse else None
    carry_arg = grad_denominator if carry is None else carry  # a stand-in the kernel never reads
    carry_strides = (0, 0, 0) if carry is None else carry.stride()
    block_d = min(NORMALIZER_TERMS_COLUMNS, triton.next_power_of_2(D))
    with _launch_guard():
        normalizer_terms_kernel[(B * H, triton.cdiv(D, block_d))](
            plain, x, phi, grad_denominator, carry_arg, out, grad_denominator if total is None else total,
            T, H, D, int(carry is not None), *plain.stride(), *x.stride(), *phi.stride(), *out.stride(),
            *carry_strides, REVERSE=int(reverse), BLOCK_T=NORMALIZER_TERMS_TOKENS, BLOCK_D=block_d,
            FEATURE_MAP=feature_map)
    return total


def _launch_backward(q, k, v, initial_state, grad_o, grad_final_state, launch_keywords, *, compute_dq,
                     cu_seqlens=None, o=None, denominator=None, feature_map="identity"):
    """dQ (when compute_dq), dK, dV and dS_0 in one launch (``chunked_backward_kernel``).
    initial_state, grad_final_state: S_0 and G, float32 (B, H, D, E), or None for zeros
    (with ``cu_seqlens``: (N, H, D, E), one state per packed sequence). With the forward's ``o``
    and ``denominator``, the normalised backward (NORMALIZE, not with ``cu_seqlens``): the three
    states then have E + 1 columns, z last. With a ``feature_map``, q and k are its features and
    dQ, dK the gradients of the inputs it mapped. launch_keywords: ``_backward_plan``'s."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    normalize = denominator is not None
    # Each gradient laid out as its input: autograd keeps it as is, without a copy to the leaf's strides.
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q) if compute_dq else None
    ds0 = torch.empty((B, H, D, E + normalize), dtype=torch.float32, device=q.device)
    # Absent tensors get a stand-in pointer the kernel never follows (its flag is 0).
    dq_arg = dk if dq is None else dq
    s0_arg = ds0 if initial_state is None else initial_state
    g_arg = ds0 if grad_final_state is None else grad_final_state
    suffix = ds0
    if normalize:  # r, then dz after each of the walks' chunks (chunk_suffix_sums_kernel)
        grad_denominator, _, chunk_sums = _normalizer_gradient(grad_o, o, denominator, q=q,
                                                               tokens=launch_keywords["CHUNK"])
        suffix = torch.empty_like(chunk_sums)
        with _launch_guard():
            chunk_suffix_sums_kernel[(B * H,)](
                chunk_sums, g_arg, suffix, ds0, chunk_sums.shape[2], H, D, E, int(grad_final_state is not None),
                *g_arg.stride(), BLOCK_D=_block(D), SCAN_CHUNKS=SUFFIX_SCAN_CHUNKS)
    else:
        grad_denominator = denominator = ds0
    with _launch_guard():
        chunked_backward_kernel[(B * H, 1 + int(launch_keywords["SPLIT_WALKS"]) + int(compute_dq))](
            q, k, v, grad_o, grad_denominator, denominator, dq_arg, dk, dv, s0_arg, g_arg, ds0, suffix,
            ds0 if cu_seqlens is None else cu_seqlens, T, H, D, E,
            int(compute_dq), int(initial_state is not None), int(grad_final_state is not None),
            *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dq_arg.stride(),
            *dk.stride(), *dv.stride(), *s0_arg.stride(), *g_arg.stride(),
            IS_VARLEN=cu_seqlens is not None, NORMALIZE=normalize, FEATURE_MAP=feature_map, **launch_keywords,
        )
    return dq, dk, dv, ds0


#: Why a backward recorded for a gradient of the gradient (create_graph=True) is refused: the
#: backward kernels are not differentiable themselves, so that gradient would silently miss terms.
SECOND_ORDER_REFUSAL = ("a gradient of these gradients (create_graph=True) is not supported: the backward "
                        "kernels are not differentiable themselves")


class _ChunkedCausalProduct(torch.autograd.Function):
    """Forward: one pass. Backward: one fused launch, or up to three passes."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, config, cu_seqlens, normalized):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to fill
        o, final_state = _launch(q, k, v, initial_state, reverse=False, config=config, cu_seqlens=cu_seqlens,
                                 normalized=normalized)
        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
        ctx.config, ctx.normalized = config, normalized
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, initial_state, cu_seqlens = ctx.saved_tensors
        needs_q, needs_k, needs_v, needs_initial_state = ctx.needs_input_grad[:4]
        grad_q = grad_k = grad_v = grad_initial_state = None
        if grad_o is None:  # only S_T was used
            grad_o = torch.zeros_like(v)
        passes = {"config": ctx.config, "cu_seqlens": cu_seqlens, "normalized": ctx.normalized}
        sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        fused = _backward_plan(sequences * q.shape[1], q.shape[2], q.shape[3], v.shape[3], q.dtype,
                               _device_limits(q.device), triton.knobs.runtime.interpret,
                               () if ctx.config is None else tuple(sorted(ctx.config.items())),
                               precision=float32_precision(ctx.normalized) if q.dtype == torch.float32 else None)
        if fused is not None and (needs_k or needs_v or needs_initial_state):
            grad_q, grad_k, grad_v, grad_initial_state = _launch_backward(
                q, k, v, initial_state, grad_o, grad_final_state, fused, compute_dq=needs_q,
                cu_seqlens=cu_seqlens)
            return (grad_q, grad_k if needs_k else None, grad_v if needs_v else None,
                    grad_initial_state if needs_initial_state else None, None, None, None)
        if needs_q:  # dq_t = sum_{s<=t} (dO_t . v_s) k_s + S_0 dO_t
            initial_t = None if initial_state is None else initial_state.transpose(-1, -2)
            grad_q, _ = _launch(grad_o, v, k, initial_t, reverse=False, **passes)
        if needs_k:  # dk_s = sum_{t>=s} (v_s . dO_t) q_t + G v_s
            g_t = None if grad_final_state is None else grad_final_state.transpose(-1, -2)
            grad_k, _ = _launch(v, grad_o, q, g_t, reverse=True, **passes)
        if needs_v or needs_initial_state:  # dv_s = sum_{t>=s} (k_s . q_t) dO_t + G^T k_s
            grad_v, grad_initial_state = _launch(k, q, grad_o, grad_final_state, reverse=True, **passes)
        return (grad_q, grad_k, grad_v if needs_v else None,
                grad_initial_state if needs_initial_state else None, None, None, None)


def _launch_normalized(q, k, v, initial_state, eps, config):
    """The normalised forward in one pass: (out, final_state (B, H, D, E + 1), d + eps (B, H, T))."""
    B, H, T, _ = q.shape
    denominator = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    o, final_state = _launch(q, k, v, initial_state, reverse=False, config=config, denominator=denominator, eps=eps)
    return o, final_state, denominator


def _normalized_backward_in_passes(q, k, v, initial_state, o, denominator, grad_o, grad_final_state, config,
                                   needs_input_grad, feature_map="identity"):
    """The normalised backward where the fused kernel does not apply (float32 under "highest",
    heads over 64): the plain backward's passes on g = dO / (d + eps), then the denominator's terms
    (its gradient r_t = -(g_t . out_t)). g and r come from one launch
    (``normalizer_gradient_kernel``), g rounded as the fused backward rounds it: bfloat16 for
    bfloat16 inputs, float32 otherwise (float16's g falls below its normal range once d_t is a few
    thousand), and r from that g, so that g_t . v_s + r_t cancels where it should. The dq and dk
    passes write float32, which ``normalizer_terms_kernel`` completes with r_t z_t and dz_s before
    rounding; dz_0 comes from dK's terms, which run whenever dS_0 is needed. With a ``feature_map``,
    q and k are its features and the terms' walks take dq and dk through its derivative."""
    needs_q, needs_k, needs_v, needs_initial_state = needs_input_grad
    E = v.shape[-1]
    grad_denominator, g, _ = _normalizer_gradient(grad_o, o, denominator, with_numerator=True)
    q_w, k_w, v_w = (x.to(g.dtype) for x in (q, k, v))
    grad_q = grad_k = grad_v = grad_initial_state = None
    grad_z = None if grad_final_state is None else grad_final_state[..., E]
    if needs_q:
        s0_t = None if initial_state is None else initial_state[..., :E].transpose(-1, -2)
        plain_q, _ = _launch(g, v_w, k_w, s0_t, reverse=False, config=config, out_dtype=torch.float32,
                             normalized=True)
        grad_q = torch.empty_like(q)
        _normalizer_terms(plain_q, k, q, grad_denominator, None if initial_state is None else initial_state[..., E],
                          reverse=False, out=grad_q, feature_map=feature_map)
    if needs_k or needs_initial_state:
        g_t = None if grad_final_state is None else grad_final_state[..., :E].transpose(-1, -2)
        plain_k, _ = _launch(v_w, g, q_w, g_t, reverse=True, config=config, out_dtype=torch.float32,
                             normalized=True)
        grad_k = torch.empty_like(k)
        dz0 = _normalizer_terms(plain_k, q, k, grad_denominator, grad_z, reverse=True, out=grad_k,
                                feature_map=feature_map)
    if needs_v or needs_initial_state:
        g_s = None if grad_final_state is None else grad_final_state[..., :E]
        grad_v, grad_s0 = _launch(k_w, q_w, g, g_s, reverse=True, config=config, normalized=True)
        grad_v = grad_v.to(v.dtype)
        if needs_initial_state:
            grad_initial_state = torch.cat([grad_s0, dz0.unsqueeze(-1)], dim=-1)
    return grad_q, grad_k, grad_v, grad_initial_state


class _ChunkedNormalizedAttention(torch.autograd.Function):
    """Forward: one pass. Backward: one fused launch, or the plain passes on g and the terms' walks.
    With a ``feature_map``, q and k are the raw inputs and ``features`` their features (made
    beforehand, outside autograd): the kernels run on the features and return the raw inputs'
    gradients, taken through the map's derivative as they are stored."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, eps, config, feature_map="identity", features=None):
        ctx.set_materialize_grads(False)
        phi_q, phi_k = (q, k) if features is None else features
        o, final_state, denominator = _launch_normalized(phi_q, phi_k, v, initial_state, eps, config)
        ctx.save_for_backward(phi_q, phi_k, v, initial_state, o, denominator)
        ctx.config, ctx.feature_map = config, feature_map
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, initial_state, o, denominator = ctx.saved_tensors
        needs_q, needs_k, needs_v, needs_initial_state = ctx.needs_input_grad[:4]
        if grad_o is None:  # only the final state was used
            grad_o = torch.zeros_like(o)
        fused = _backward_plan(q.shape[0] * q.shape[1], q.shape[2], q.shape[3], v.shape[3], q.dtype,
                               _device_limits(q.device), triton.knobs.runtime.interpret,
                               () if ctx.config is None else tuple(sorted(ctx.config.items())), normalize=True,
                               precision=float32_precision(True) if q.dtype == torch.float32 else None)
        feature_map = ctx.feature_map
        if fused is not None:
            grad_q, grad_k, grad_v, grad_initial_state = _launch_backward(
                q, k, v, initial_state, grad_o, grad_final_state, fused, compute_dq=needs_q, o=o,
                denominator=denominator, feature_map=feature_map)
        else:
            grad_q, grad_k, grad_v, grad_initial_state = _normalized_backward_in_passes(
                q, k, v, initial_state, o, denominator, grad_o, grad_final_state, ctx.config,
                ctx.needs_input_grad[:4], feature_map)
        return (grad_q, grad_k if needs_k else None, grad_v if needs_v else None,
                grad_initial_state if needs_initial_state else None, None, None, None, None)


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


def check_inputs(q, k, v, initial_state, method='chunked', cu_seqlens=None, *, normalized=False):
    """A TypeError or ValueError naming the argument and the limit for any input the kernels cannot
    take: q, k, v must be dense 4-D tensors, (B, H, T, D), (B, H, T, D) and (B, H, T, E), of one
    dtype of _INPUT_DTYPES, on the GPU (the CPU under TRITON_INTERPRET=1), with 1 <= D, E <=
    MAX_HEAD_DIM and one head spanning at most INDEX_LIMIT + 1 elements; initial_state None or a
    dense floating (B, H, D, E) tensor on their device ((B, H, D, E + 1) when ``normalized``).
    cu_seqlens: None, or the offsets of N sequences packed along T (``check_cu_seqlens``); the
    states are then (N, H, D, E)."""
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
    if isinstance(chunked_kernel, triton.runtime.JITFunction if triton.knobs.runtime.interpret else InterpretedFunction):
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
            layout, expected = "(N, H, D, E) with cu_seqlens", (cu_seqlens.shape[0] - 1, q.shape[1], D, E)
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


def chunked_causal_product(q, k, v, initial_state=None, *, config=None, cu_seqlens=None):
    """q, k: (B, H, T, D); v: (B, H, T, E); one dtype of float32/float16/bfloat16, one device.
    initial_state: None or (B, H, D, E), any floating dtype, used as float32.  Returns
    (o, final_state): o (B, H, T, E) in the input dtype, final_state (B, H, D, E) float32.
    Differentiable in q, k, v and initial_state.
    config: optional dict overriding the block sizes / num_warps the wrapper would choose
    (benchmarks sweep it); None means the wrapper's own rule.  Keys: ``CONFIG_KEYS``, checked
    by ``check_config``; ``TUNING_CANDIDATES`` lists complete ones.
    cu_seqlens: optional (N + 1,) int32/int64 offsets of N sequences packed along T of a batch of
    one (q, k: (1, H, total_T, D)); no state crosses a boundary, and the states are (N, H, D, E)."""
    check_inputs(q, k, v, initial_state, cu_seqlens=cu_seqlens)
    if initial_state is not None:  # the API converts it once, before calling _run_validated
        initial_state = initial_state.float()
    return _run_validated(q, k, v, initial_state, config, cu_seqlens)


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        kind = type(eps).__qualname__
        kind = kind if type(eps).__module__ == "builtins" else f"{type(eps).__module__}.{kind}"
        raise TypeError(f"eps must be a Python float, got {kind}; convert it with float(eps)")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def chunked_normalized_attention(q, k, v, initial_state=None, *, eps=1e-6, config=None):
    """Normalised causal linear attention of features q, k (the feature map already applied):
    out_t = q_t^T S_t / (q_t^T z_t + eps), S_t = S_0 + sum_{s<=t} k_s v_s^T, z_t = z_0 + sum_{s<=t} k_s,
    numerator and denominator accumulated in float32 in one pass. eps (finite, >= 0) is added
    once, to q_t^T z_t. Shapes and dtypes as ``chunked_causal_product``; initial_state: None or
    (B, H, D, E + 1), any floating dtype, used as float32, S_0 then z_0 as the last column.
    Returns (out, final_state): out in the input dtype, final_state (B, H, D, E + 1) float32 in
    the same layout. Differentiable in q, k, v and initial_state. No packed sequences
    (``cu_seqlens``): recurrent's and scan's take them."""
    check_inputs(q, k, v, initial_state, normalized=True)
    _check_eps(eps)
    if initial_state is not None:
        initial_state = initial_state.float()
    return _run_normalized_validated(q, k, v, initial_state, eps, config)


def _run_normalized_validated(q, k, v, initial_state=None, eps=1e-6, config=None, features=None):
    """``chunked_normalized_attention`` for inputs, eps included, already checked. ``features``:
    None (q and k are the features), or (feature_map, phi_q, phi_k): q and k are raw inputs that
    "elu" or "relu" mapped to phi_q and phi_k beforehand, and the gradients are q's and k's
    (the map's derivative taken as the backward stores dq and dk, in no pass of its own)."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    feature_map, mapped = "identity", None
    if features is not None:
        feature_map, mapped = features[0], tuple(x.resolve_neg() for x in features[1:])
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _ChunkedNormalizedAttention.apply(q, k, v, initial_state, eps, config, feature_map, mapped)
    phi_q, phi_k = (q, k) if mapped is None else mapped
    o, final_state, _ = _launch_normalized(phi_q, phi_k, v, initial_state, eps, config)
    return o, final_state


def _run_validated(q, k, v, initial_state=None, config=None, cu_seqlens=None, normalized=False):
    """``chunked_causal_product`` for inputs already through ``check_inputs`` (the package's API
    makes the same checks, once). ``normalized``: v ends with a column of ones, by whose product
    the caller divides the others (the normalised attention of the other methods): float32
    products keep 3xTF32, forward and backward, as the kernels' own normalised launches do."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the kernels read offset n at cu_seqlens_ptr + n
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _ChunkedCausalProduct.apply(q, k, v, initial_state, config, cu_seqlens, normalized)
    # No gradient wanted: skip autograd's bookkeeping, a sizeable part of a small call's time.
    return _launch(q, k, v, initial_state, reverse=False, config=config, cu_seqlens=cu_seqlens,
                   normalized=normalized)
