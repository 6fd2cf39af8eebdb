"""Scan causal dot product: segment states combined by a parallel prefix sum.

The state of the causal product is a prefix sum, S_t = S_0 + sum_{j <= t} k_j v_j^T. Cut the
sequence into NS segments of L tokens, sum each segment on its own, scan the NS sums, and each
segment knows the state it starts from (Blelloch's reduce-then-scan, "Prefix sums and their
applications", 1990). Three passes in two launches:

  1. ``scan_summaries_kernel``, one program per (batch*head, segment, block of E): the segment's
     sum U = K^T V over chunks of C tokens, into slot w + 1 of a float32 buffer (B*H, NS, D, E)
     indexed by walk position w.
  2. In the same launch, the last program of each (batch*head, block of E) to finish (an atomic
     count) scans the slots (``_scan_start_states``): slot w <- S_0 + the sums before it.
  3. ``scan_outputs_kernel``, one program per (batch*head, segment, block of E): from its start
     state, the chunked form  O_c = Q_c S + ((Q_c K_c^T) * M) V_c,  S <- S + K_c^T V_c; the
     last segment stores S_T.
Pass 2 has no launch of its own: this method is for few long sequences, where the host's time
per launch sets the pace. The last walked segment is never summed (its sum only feeds S_T).

Backward, with dO the gradient of o and G that of S_T:  dQ = forward product (dO, V, K) from the
forward's start states transposed; dV = reverse product (K, Q, dO) from G, whose final state is
dS_0; dK = reverse product (V, dO, Q) from the same suffix states transposed. ``reverse`` = 1
walks segments and chunks from last to first with the upper triangle. For heads up to 64 wide
(16-bit inputs, and float32 ones under one TF32 product) ``scan_backward_kernel`` does all three
in one launch, else ``scan_outputs_kernel`` runs thrice.
``NORMALIZE`` (``scan_normalized_attention``): out_t = o_t / (q_t . z_t + eps), z_t = z_0 +
sum_{s<=t} k_s, carried in float32 as column E of every state (states of E + 1 columns, z last,
S_0 and S_T included): pass 1 sums the segment's keys beside U, pass 2 scans them with the
rest, and pass 3 carries z through its chunks, forms d_t + eps = the row sum of the chunk's
masked scores + q_t . z_{c-1} + eps and divides before the store (and keeps d_t + eps for the
backward). The backward runs on g_t = dO_t / (d_t + eps) with r_t = -(g_t . out_t), the
denominator's gradient, beside it (a column of r next to g, a column of 1 next to v):
``normalizer_gradient_kernel`` makes r from dO, o and d + eps in one read of both, the suffix
states' pass 1 (``NORMALIZER_GRADIENT``) makes g from dO and d + eps and sums r_t q_t as their
column E, and the fused backward makes g again and adds r to the score gradients, r_t z to dQ
and dz to dK. Where the fused kernel does not apply, pass 3 runs thrice on g (bfloat16 for
bfloat16 inputs, float32 otherwise; ``normalizer_gradient_kernel`` writes it beside r), dQ and
dK in float32, and ``normalizer_terms_kernel`` adds r_t z_t to dQ and dz to dK in one walk each.
``FEATURE_MAP`` (a constexpr, with ``NORMALIZE`` only): "elu" (elu(x) + 1) or "relu" replaces q
and k by phi(q), phi(k) as passes 1 and 3 and the backward's load them, in float32 then rounded
to the input dtype as the products take them, with k's padding kept at 0; the backward stores
dq = dphi(q) * phi'(q), dk likewise (elu + 1: phi' = min(phi, 1); relu: 0 where phi <= 0), and
its passes take q and k mapped the same way in PyTorch, and ``normalizer_terms_kernel`` takes dq
and dk through phi'. "identity" compiles to the kernels without a map.

Shapes: q, k (B, H, T, D); v, o (B, H, T, E); states (B, H, D, E) float32; any strides; T >= 0;
1 <= D, E <= 256 (blocks are powers of two >= 16, the smallest ``tl.dot`` on a GPU). Offsets
inside one (batch, head) slice are int32: its last element must sit at an offset below 2**31. The forward
keeps its start states, B*H*NS*D*E float32 (with NORMALIZE, rows of E + 1 padded to a multiple of
16, and d + eps, B*H*T), for the backward. Packed (``IS_VARLEN``, ``cu_seqlens``
of N + 1 offsets, a batch of one, states (N, H, D, E)): the row is cut into the segments of one
sequence of total_T tokens, boundaries or not, so packing changes neither the programs nor their
lengths. A segment holds pieces, the parts of the sequences that lie in it; its programs walk
them one after another, each from its sequence's S_0 unless it goes on from the segment before,
with chunks counted from the piece's first token (no chunk straddles a boundary), and store
S_T for each sequence that ends in it. A table built on the device (``scan_segments_kernel``,
no read back) names each segment's first and last piece; pass 1 sums only the last piece,
the one that goes on, and pass 2 is a segmented scan: it carries a state into a segment only
when the segment's first sequence began before the segment walked before, and restarts from
that sequence's S_0 elsewhere.
Precision: products accumulate in float32; float32 inputs follow
``torch.get_float32_matmul_precision()`` at each call (``FLOAT32_PRECISIONS``): 3xTF32
(``input_precision="tf32x3"``, about 3e-7 against float64) for "highest", the default; TF32 for
"high" and "medium" (about 1.5e-3; 5e-3 to 1e-2 for the normalised dq, which cancels).
``FLOAT32_PRECISIONS["highest"] = "bf16x3_manual"`` splits each operand
into two bfloat16 parts in the kernel instead (``BF16X3_MANUAL``, three bfloat16 products, about
6e-6), as chunked's "highest" does, on the tiles where that ran right on a GPU (``split_is_right``)
and for calls whose outputs are large enough for that error to hold (``split_is_accurate``), with
3xTF32 in the normalised attention, whose dq cancels to about 7e-5 under the split (the kernels'
own normalised launches, and a product whose caller divides by the product of a column of ones
appended to v: ``_run_validated(normalized=True)``, forward and backward). It is not scan's
default: with Triton 3.6 on an H200 two backward passes under it stopped on an illegal memory
access (short sequences without S_0 or G), which the same passes at 3xTF32 do not. Under a split
(3xTF32, bfloat16 parts) the segment sums and states add each chunk's product in rounded
float32, not in the tensor core's truncating accumulator. bfloat16 rounds the float32 state and
scores to bfloat16; float16 keeps them in float32 (TF32 products).
Without a GPU: set TRITON_INTERPRET=1 before importing this file, since ``@triton.jit`` chooses
Triton's CPU interpreter at import; the wrappers refuse an interpreter switched on or off afterwards.
Tested: Triton 3.9's CPU interpreter; every launch compiled for sm_80 and sm_90 with Triton 3.6
and 3.9; the test suite on an H200 with Triton 3.6 (``IS_VARLEN``, ``scan_segments_kernel``,
float32 "tf32x3" and "tf32", ``NORMALIZE``, ``NORMALIZER_GRADIENT`` and ``FEATURE_MAP``
included). Packed segments that straddle boundaries: the scan and packed-sequence test files
on an H200 (Triton 3.6); the segment rule's two programs a multiprocessor: timed there,
its lengths within those the tests run; bfloat16's four stages at D = 33-128 and their segments
of at most one program a multiprocessor, float16's three stages: timed and the scan test files
run on an H100 (Triton 3.6). The fused backward on float32 inputs under TF32: timed on an H100
and through the float32 tests of test_precision.py, test_scan.py, test_varlen.py and
test_host_path.py there; the normalised dq within 4.6e-3 of float64 at (2, 16, 4096, 64) (the
passes': 6.7e-3). With "elu" the kernels took
longer than on features mapped beforehand (GPU time at (1, 8, 65536, 64) bfloat16: 0.40 / 1.75 ms
forward / forward+backward against 0.29 / 1.00), so ``causal_linear_attention`` maps in PyTorch.
Caveats: SEGMENT_LEN only decides how the work is cut; its rule counts multiprocessors, and
without a GPU assumes an H100/H200's. 3xTF32 spills registers in pass 3 (float32 inputs, sm_90,
Triton 3.9), and on 8 warps with a 16 x 16 state Triton 3.6 miscompiles it: 4 warps there.
The normalised fused backward spills registers at 64-wide bfloat16 heads, as chunked's does
(Triton 3.9, bytes on sm_90 / sm_80: 120 / 808 on features, 360 / 1424 with elu + 1 inside;
the plain one: 0 / 288), and on sm_80 so do pass 3 with elu + 1 (144) and the suffix states'
pass 1 on features (8).
Non-finite values: a chunk product multiplies its masked zeros by every row of v (k, dO, q in
the backward), and 0 * inf is NaN; each loop sums 0 * its result tiles per row, and a program
that saw an inf or NaN redoes its segment one token at a time after the loop (the recurrence,
causal by construction; NORMALIZE: with z, g and r), overwriting what it stored: a slow call,
not a wrong one. The denominators need no such care: their scores are masked by selection.
A config that needs more shared memory than the GPU has fails at launch.
The interpreter multiplies bfloat16 bit patterns in ``tl.dot`` and truncates float32 to
bfloat16: under it (``INTERPRETED``) the kernels round by hand (``_rounded``) and widen every
product operand to float32.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass, replace

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
def _add_product(b_sum, a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """b_sum + a @ b. A tensor-core product that accumulates into b_sum truncates the sum at each
    step; a split of float32 operands (3xTF32, bfloat16 parts) makes three or more such steps a
    chunk, so its product is added in rounded float32."""
    if PRECISION == "tf32x3" or PRECISION == "bf16x3" or PRECISION == "bf16x6" or PRECISION == BF16X3_MANUAL:
        b_sum += _dot(a, b, None, PRECISION, INTERPRETED)
    else:
        b_sum = _dot(a, b, b_sum, PRECISION, INTERPRETED)
    return b_sum


#: float32 products split into bfloat16 parts by the kernel itself: x = hi + lo with hi = x
#: rounded to bfloat16 and lo = (x - hi) rounded, then lo @ hi + hi @ lo + hi @ hi, three plain
#: bfloat16 products, which tensor cores run at twice TF32's rate. lo @ lo, about 2**-16 of the
#: product, is left out, as Triton's "bf16x3" leaves it out: the plain product errs by about 6e-6
#: against float64, within float32's 1e-5, but the normalised attention's dq, whose terms
#: cancel, by about 7e-5, so the normalised launches keep 3xTF32 (``float32_precision``).
#: A choice of ``FLOAT32_PRECISIONS`` for "highest" (chunked's default, not scan's: see the module
#: docstring); ``benchmarks/float32_sweep.py --products`` times it against 3xTF32.
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


#: Columns of the block that carries the normaliser's key sum: the narrowest ``tl.dot`` operand.
UNIT_BLOCK = tl.constexpr(16)


@triton.jit
def _unit_columns(ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """U (ROWS x UNIT_BLOCK): ones in its first column, zeros in the others. The sum of a chunk's
    keys becomes a product, K^T U = (z, 0, ..., 0): z is the state of one more value column, all
    ones, and its product runs on tensor cores like the state's. ``tl.sum`` over a tile's tokens
    instead crosses the warps (shared memory and a barrier) at every chunk, where the products wait."""
    return (tl.arange(0, ROWS)[:, None] * 0 + tl.arange(0, UNIT_BLOCK)[None, :] == 0).to(DTYPE)


@triton.jit
def _features(x, mask, FEATURE_MAP: tl.constexpr, INTERPRETED: tl.constexpr):
    """phi(x) of a tile of q or k as loaded: in float32, rounded to x's dtype as the products take
    it, and 0 where ``mask`` is false (padding loads as 0, which elu + 1 would map to 1). "elu":
    elu(x) + 1, as x + 1 or exp(x), without the cancellation of (exp(x) - 1) + 1; "relu": NaN
    stays NaN, as in PyTorch; "identity": x itself."""
    if FEATURE_MAP == "identity":
        return x
    b_x = x.to(tl.float32)
    if FEATURE_MAP == "elu":
        b_phi = tl.where(b_x > 0, b_x + 1.0, tl.exp(b_x))
    else:
        b_phi = tl.where(b_x < 0, 0.0, b_x)
    return _rounded(tl.where(mask, b_phi, 0.0), x.dtype, INTERPRETED)


@triton.jit
def _through_features(b_grad, b_phi, FEATURE_MAP: tl.constexpr):
    """The gradient of x from b_grad (float32), the gradient of phi(x), and phi(x) as ``_features``
    made it. elu + 1: phi'(x) is 1 above 0 and exp(x) = phi(x) below, so min(phi(x), 1); relu: 0
    where phi(x) <= 0, by selection (an inf gradient times 0 would be NaN)."""
    if FEATURE_MAP == "elu":
        b_phi = b_phi.to(tl.float32)
        return b_grad * tl.where(b_phi < 1.0, b_phi, 1.0)
    if FEATURE_MAP == "relu":
        return tl.where(b_phi <= 0, 0.0, b_grad)
    return b_grad


@triton.jit
def _segment_after_loop(pid, e_blocks, n_segments, H, T, segment_len, reverse):
    """(b, h, walk, first token, tokens, value block) of program ``pid`` (int64) for a walk after
    the chunk loop, one sequence a batch row, derived again from the program id and the
    arguments as the kernels' openings do, so that no value computed before the loop stays live
    through it: such values cost the loop registers."""
    e_block = pid % e_blocks
    walk = (pid // e_blocks) % n_segments
    bh = pid // (e_blocks * n_segments)
    segment = tl.where(reverse != 0, n_segments - 1 - walk, walk)
    first = segment * segment_len
    tokens = tl.minimum(segment_len, T - first).to(tl.int32)
    return bh // H, bh % H, walk, first, tokens, e_block


@triton.jit
def _segment_pieces(segments_ptr, segment, n_segments, reverse):
    """Packed sequences: (the sequence of the segment's first walked piece, its count of pieces,
    its flags) from the segment table (see ``_segment_table``). A piece is the part of one
    sequence that lies in the segment; the pieces are sequences first..last, walked in
    order, or last first when ``reverse``."""
    first = tl.load(segments_ptr + segment)
    last = tl.load(segments_ptr + n_segments + segment)
    flags = tl.load(segments_ptr + 2 * n_segments + segment)
    return tl.where(reverse != 0, last, first), last - first + 1, flags


@triton.jit
def _piece(segments_ptr, walk_first, piece, n_pieces, flags, segment, n_segments, segment_len, T, reverse):
    """Piece number ``piece`` of a segment in walk order: (its sequence, its first token, its
    token count, whether it starts its sequence's walk here (so it starts from that sequence's
    S_0, or G when ``reverse``), whether it ends its sequence's walk here (so its last state is
    the sequence's S_T, or dS_0)). Only the segment's first walked piece can have begun in
    the segment before, and only its last walked one can go on into the next."""
    seq = walk_first + tl.where(reverse != 0, -piece, piece)
    offsets_ptr = segments_ptr + 3 * n_segments
    segment_first = segment * segment_len
    first = tl.maximum(tl.load(offsets_ptr + seq), segment_first)
    end = tl.minimum(tl.load(offsets_ptr + seq + 1), tl.minimum(segment_first + segment_len, T))
    starts = (piece > 0) | ((flags & (1 + reverse)) != 0)
    ends = (piece < n_pieces - 1) | ((flags & (2 - reverse)) != 0)
    return seq, first, tl.maximum(end - first, 0), starts, ends


@triton.jit
def _outputs_token_by_token(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, tokens, reverse, first_column, D, E, eps,
                            stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_ot, stride_oe,
                            stride_sd, stride_se, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                            NORMALIZE: tl.constexpr, FEATURE_MAP: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rewrites o for the segment's tokens from its start state, one token at a time in walk order,
    in float32: S <- S + k_t v_t^T, o_t = q_t S (NORMALIZE: z <- z + k_t, o_t / (q_t . z + eps),
    z read from column E of the start state), q_t and k_t mapped by FEATURE_MAP. No product
    multiplies a token that o_t must not see, so an inf or NaN reaches exactly the outputs it
    reaches in the recurrence. Vectors and
    the state only: fewer registers than a chunk."""
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_e = first_column + tl.arange(0, BLOCK_E).to(tl.int64)
    mask_d = offs_d < D
    mask_e = offs_e < E
    b_state = tl.load(start_ptr + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
                      mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    b_z = tl.zeros([BLOCK_D], dtype=tl.float32)
    if NORMALIZE:
        b_z = tl.load(start_ptr + offs_d * stride_sd + E * stride_se, mask=mask_d, other=0.0)
    for i in tl.range(tokens, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        t = tl.where(reverse != 0, tokens - 1 - i, i)
        b_q = tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0)
        b_q = _features(b_q, mask_d, FEATURE_MAP, INTERPRETED).to(tl.float32)
        b_k = _features(b_k, mask_d, FEATURE_MAP, INTERPRETED).to(tl.float32)
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
    g_t = dO_t / (d_t + eps), rounded as the chunk walks round it, and the denominator's r_t
    (``normalizer_gradient_kernel``, made from the same rounded g; see scan_backward_kernel)."""
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
                                    start_ptr, tokens, D, E, stride_dot, stride_doe, stride_vt, stride_ve, stride_kt,
                                    stride_kd, stride_qt, stride_qd, stride_dqt, stride_dqd, stride_sd, stride_se,
                                    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                                    NORMALIZE: tl.constexpr, FEATURE_MAP: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rewrites dq for the segment's tokens from its forward start state P = S (D x E), one token
    at a time: P <- P + k_t v_t^T, dq_t = P g_t (NORMALIZE: z <- z + k_t from the start state's
    column E, plus r_t z), in float32; causal by construction. With a FEATURE_MAP, k_t is mapped
    and dq_t taken through phi(q_t) (q is read only then)."""
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
    mask_d = offs_d < D
    mask_e = offs_e < E
    b_p = tl.load(start_ptr + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
                  mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    b_z = tl.zeros([BLOCK_D], dtype=tl.float32)
    if NORMALIZE:
        b_z = tl.load(start_ptr + offs_d * stride_sd + E * stride_se, mask=mask_d, other=0.0)
    for t in tl.range(tokens, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        b_g, b_grad_denominator = _token_gradients(do_ptr, grad_denominator_ptr, denominator_ptr, t, offs_e, mask_e,
                                                   stride_dot, stride_doe, NORMALIZE, INTERPRETED)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0)
        b_k = _features(b_k, mask_d, FEATURE_MAP, INTERPRETED).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + offs_e * stride_ve, mask=mask_e, other=0.0).to(tl.float32)
        b_p += b_k[:, None] * b_v[None, :]
        b_dq = tl.sum(b_p * b_g[None, :], 1)
        if NORMALIZE:
            b_z += b_k
            b_dq += b_grad_denominator * b_z
        if FEATURE_MAP != "identity":
            b_q = tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0)
            b_dq = _through_features(b_dq, _features(b_q, mask_d, FEATURE_MAP, INTERPRETED), FEATURE_MAP)
        tl.store(dq_ptr + t * stride_dqt + offs_d * stride_dqd, _rounded(b_dq, dq_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_d)


@triton.jit
def _key_value_gradients_token_by_token(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, grad_denominator_ptr,
                                        denominator_ptr, start_ptr, tokens, D, E,
                                        stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve,
                                        stride_dot, stride_doe, stride_dkt, stride_dkd, stride_dvt, stride_dve,
                                        stride_sd, stride_se, BLOCK_D: tl.constexpr,
                                        BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, FEATURE_MAP: tl.constexpr,
                                        INTERPRETED: tl.constexpr):
    """Rewrites dk and dv for the segment's tokens, last first, from its suffix state R, one token
    at a time: R <- R + q_t g_t^T, dk_t = R v_t, dv_t = R^T k_t (NORMALIZE: dz <- dz + r_t q_t from
    the suffix state's column E, dk_t plus dz), in float32; causal by construction. With a
    FEATURE_MAP, q_t and k_t are mapped and dk_t taken through phi(k_t)."""
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
    mask_d = offs_d < D
    mask_e = offs_e < E
    b_r = tl.load(start_ptr + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
                  mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    b_dz = tl.zeros([BLOCK_D], dtype=tl.float32)
    if NORMALIZE:
        b_dz = tl.load(start_ptr + offs_d * stride_sd + E * stride_se, mask=mask_d, other=0.0)
    for i in tl.range(tokens, num_stages=1, loop_unroll_factor=1, disable_licm=True):
        t = tokens - 1 - i
        b_g, b_grad_denominator = _token_gradients(do_ptr, grad_denominator_ptr, denominator_ptr, t, offs_e, mask_e,
                                                   stride_dot, stride_doe, NORMALIZE, INTERPRETED)
        b_q = tl.load(q_ptr + t * stride_qt + offs_d * stride_qd, mask=mask_d, other=0.0)
        b_k = tl.load(k_ptr + t * stride_kt + offs_d * stride_kd, mask=mask_d, other=0.0)
        b_q = _features(b_q, mask_d, FEATURE_MAP, INTERPRETED).to(tl.float32)
        b_k = _features(b_k, mask_d, FEATURE_MAP, INTERPRETED).to(tl.float32)
        b_v = tl.load(v_ptr + t * stride_vt + offs_e * stride_ve, mask=mask_e, other=0.0).to(tl.float32)
        b_r += b_q[:, None] * b_g[None, :]
        b_dk = tl.sum(b_r * b_v[None, :], 1)
        if NORMALIZE:
            b_dz += b_grad_denominator * b_q
            b_dk += b_dz
        b_dk = _through_features(b_dk, b_k, FEATURE_MAP)
        b_dv = tl.sum(b_r * b_k[:, None], 0)
        tl.store(dk_ptr + t * stride_dkt + offs_d * stride_dkd, _rounded(b_dk, dk_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_d)
        tl.store(dv_ptr + t * stride_dvt + offs_e * stride_dve, _rounded(b_dv, dv_ptr.dtype.element_ty, INTERPRETED),
                 mask=mask_e)


@triton.jit
def _numerator_gradient(b_do, denominator_ptr, offs_t, mask_t, MIXED_DTYPE: tl.constexpr,
                        MIXED_DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """g_t = dO_t / (d_t + eps) of a chunk for the normalised backward, the numerator's gradient,
    as a product operand (bfloat16 for bfloat16 inputs; float32 for float16, whose range g
    leaves at long T)."""
    b_denominator = tl.load(denominator_ptr + offs_t, mask=mask_t, other=1.0)
    return _rounded(b_do.to(tl.float32) / b_denominator[:, None], MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE)


@triton.jit
def _normalizer_gradients(b_do, grad_denominator_ptr, denominator_ptr, offs_t, mask_t,
                          MIXED_DTYPE: tl.constexpr, MIXED_DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(g, r) of a chunk of the normalised backward: ``_numerator_gradient`` and the denominator's
    r_t, read from ``normalizer_gradient_kernel``'s output (a number per token)."""
    return (_numerator_gradient(b_do, denominator_ptr, offs_t, mask_t, MIXED_DTYPE, MIXED_DOT_DTYPE, INTERPRETED),
            tl.load(grad_denominator_ptr + offs_t, mask=mask_t, other=0.0))


@triton.jit
def normalizer_gradient_kernel(
    do_ptr, o_ptr,                  # dO and the normalised forward's output (B, H, T, E)
    denominator_ptr,                # the forward's d_t + eps (B, H, T) float32, contiguous
    grad_denominator_ptr,           # r (B, H, T) float32, contiguous, written
    numerator_ptr,                  # g (B, H, T, E) contiguous, written if WRITE_NUMERATOR
    T, H, E,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_ob, stride_oh, stride_ot, stride_oe,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,          # >= E: r sums over every value column
    INTERPRETED: tl.constexpr,
    WRITE_NUMERATOR: tl.constexpr,  # the backward in passes: they take g as an input
):
    """The denominator's gradient r_t = -(g_t . out_t) for BLOCK_T tokens of one (batch, head),
    g_t = dO_t / (d_t + eps) rounded as the backward's products take it (bfloat16 for bfloat16
    inputs), so that the score gradients g_t . v_s + r_t cancel where they should (v_s ~ out_t).
    FlashAttention's backward starts the same way (the row sums of dO * O): one read of dO and o
    here spares the backward's walks a tile of o a chunk, a load their pipeline left waiting.
    Tokens only: packed sequences need no table here."""
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
    tl.store(grad_denominator_ptr + row + offs_t, -tl.sum(b_g * b_o.to(tl.float32), 1), mask=mask_t)
    if WRITE_NUMERATOR:
        tl.store(numerator_ptr + (row + offs_t[:, None]) * E + offs_e[None, :], b_g, mask=mask)


@triton.jit
def normalizer_terms_kernel(
    plain_ptr,                      # dQ or dK of the plain passes on g (B, H, T, D) float32
    x_ptr,                          # the summed features: phi(k) for dQ, phi(q) for dK (B, H, T, D)
    phi_ptr,                        # the differentiated ones: phi(q) for dQ, phi(k) for dK (B, H, T, D)
    grad_denominator_ptr,           # r (B, H, T) float32, contiguous
    carry_ptr,                      # z_0 for dQ, G's z column for dK (N, H, D) float32: read if has_carry
    out_ptr,                        # dQ or dK (B, H, T, D), written
    total_ptr,                      # dz_0 (N, H, D) float32, contiguous: written if REVERSE
    cu_seqlens_ptr,                 # N + 1 offsets (IS_VARLEN), or a stand-in
    T, H, D, has_carry,
    stride_pb, stride_ph, stride_pt, stride_pd,
    stride_xb, stride_xh, stride_xt, stride_xd,
    stride_fb, stride_fh, stride_ft, stride_fd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_cb, stride_ch, stride_cd,
    REVERSE: tl.constexpr,          # 0: dQ's terms, 1: dK's
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,        # program row n walks packed sequence n
    FEATURE_MAP: tl.constexpr,
):
    """The denominator's terms of the backward in passes, for BLOCK_D columns of one (sequence,
    head), in float32 from the plain part to the result: dQ_t = plain_t + r_t z_t with z_t = z_0 +
    sum_{s <= t} phi(k_s) (REVERSE = 0), or dK_s = plain_s + dz_s with dz_s = G_z + sum_{t >= s}
    r_t phi(q_t) (REVERSE = 1, walking the tokens from last to first; dz_0 stored), then through
    the feature map. The terms cancel much of the plain part, so neither is rounded before they
    meet. Each block of tokens takes its running sums from one ``tl.cumsum``, which adds no
    later token to an earlier one: an inf or NaN stays on its side of the recurrence."""
    pid_bh = tl.program_id(0)
    n = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    if IS_VARLEN:  # a batch of one
        b = n * 0
        first = tl.load(cu_seqlens_ptr + n).to(tl.int64)
        length = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - first
    else:
        b = n
        first = n * 0
        length = T
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_i = tl.arange(0, BLOCK_T)
    b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
    if has_carry:
        b_sum = tl.load(carry_ptr + n * stride_cb + h * stride_ch + offs_d * stride_cd, mask=mask_d, other=0.0)
    for i0 in tl.range(0, length, BLOCK_T):
        mask_i = i0 + offs_i < length
        if REVERSE:
            rows = first + length - 1 - i0 - offs_i
        else:
            rows = first + i0 + offs_i
        mask = mask_i[:, None] & mask_d[None, :]
        b_x = tl.load(x_ptr + b * stride_xb + h * stride_xh + rows[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                      mask=mask, other=0.0).to(tl.float32)
        b_r = tl.load(grad_denominator_ptr + (b * H + h) * T + rows, mask=mask_i, other=0.0)
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
def _normalized_chunk_sum(b_sum, b_z, b_k, b_v, grad_denominator_ptr, denominator_ptr, offs_t, mask_k, mask_t,
                          NORMALIZER_GRADIENT: tl.constexpr, FEATURE_MAP: tl.constexpr,
                          FLOAT32_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Pass 1's step for one chunk of the normalised attention: (sum + K^T V, z + the keys' sum),
    k mapped by FEATURE_MAP first (``mask_k``: its tokens and D). NORMALIZER_GRADIENT, where k and
    v are q and dO: (sum + Q^T g, z + sum of r_t q_t), g made from dO and d + eps, and r read, as
    scan_backward_kernel's walks do (``_normalizer_gradients``)."""
    INPUT_DTYPE: tl.constexpr = b_k.dtype
    DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else INPUT_DTYPE
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE
    b_k = _features(b_k, mask_k, FEATURE_MAP, INTERPRETED)
    if NORMALIZER_GRADIENT:
        b_g, b_grad_denominator = _normalizer_gradients(b_v, grad_denominator_ptr, denominator_ptr, offs_t, mask_t,
                                                        MIXED_DTYPE, MIXED_DOT_DTYPE, INTERPRETED)
        b_sum = _add_product(b_sum, tl.trans(b_k).to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), b_g, FLOAT32_PRECISION,
                             INTERPRETED)
        b_z += tl.sum(b_grad_denominator[:, None] * b_k.to(tl.float32), 0)
    else:
        b_sum = _add_product(b_sum, tl.trans(b_k).to(DOT_DTYPE), b_v.to(DOT_DTYPE), FLOAT32_PRECISION, INTERPRETED)
        b_z += tl.sum(b_k.to(tl.float32), 0)
    return b_sum, b_z


@triton.jit
def _slot_width(E, NORMALIZE: tl.constexpr):
    """Columns of a row of pass 1's and 2's state buffer: E, or with NORMALIZE z in column E and
    the row padded to a multiple of 16, so that rows stay aligned for vector loads and stores
    (an odd width makes pass 2 load element by element). As ``_slot_columns`` on the host."""
    if NORMALIZE:
        return (E // 16 + 1) * 16
    return E


@triton.jit
def scan_summaries_kernel(
    k_ptr, v_ptr, states_ptr,       # states: float32 (B*H, NS, D, W), contiguous; W = _slot_width(E, NORMALIZE)
    initial_state_ptr,              # S_0 of the walk (B, H, D, W) float32, read through its strides
    arrivals_ptr,                   # int32 (B*H * value blocks,), zeros: finished programs so far
    segments_ptr,                   # IS_VARLEN: int32 segment table (see _segment_table)
    grad_denominator_ptr,           # NORMALIZER_GRADIENT: r (B, H, T) float32, contiguous (normalizer_gradient_kernel)
    denominator_ptr,                # NORMALIZER_GRADIENT: the forward's d_t + eps (B, H, T) float32, contiguous
    T, H, D, E,
    segment_len, n_segments,        # L (a multiple of CHUNK) and NS = cdiv(T, L)
    reverse,                        # 1: walk segments from last to first
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    BLOCK_D: tl.constexpr,          # >= D: the whole key dimension lives in one program
    BLOCK_E: tl.constexpr,          # the value columns this program owns
    CHUNK: tl.constexpr,            # tokens per tensor-core tile
    INTERPRETED: tl.constexpr,      # True only under the CPU interpreter (see the header)
    FLOAT32_PRECISION: tl.constexpr,  # float32 operands: "tf32x3", "tf32" or a split (see _dot)
    IS_VARLEN: tl.constexpr,        # k, v hold sequences packed along T of one row (see _segment_table)
    NORMALIZE: tl.constexpr,        # column E of the states, z, sums the keys k (S_0: E + 1 columns)
    NORMALIZER_GRADIENT: tl.constexpr,  # k, v are q, dO of the normalised forward (with NORMALIZE):
                                    # S sums q_t g_t^T and z sums r_t q_t
    FEATURE_MAP: tl.constexpr,      # NORMALIZE: k is mapped by "elu" or "relu" as loaded, or "identity"
):
    """Pass 1: the sum K^T V of the w-th walked segment (w < NS - 1) into slot w + 1 (NORMALIZE:
    its keys' sum beside it, from the first value block's program); the last program of a
    (batch*head, value block) to finish then runs pass 2."""
    INPUT_DTYPE: tl.constexpr = k_ptr.dtype.element_ty
    DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else INPUT_DTYPE
    # A flat grid, value blocks fastest: programs sharing a segment's k run side by side (the
    # second finds it in L2), and B * H is not limited to 65535 as on grid axes 1 and 2.
    e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    pid = tl.program_id(0)
    e_block = pid % e_blocks
    walk = (pid // e_blocks) % (n_segments - 1)
    bh = pid // (e_blocks * (n_segments - 1))
    b = bh // H
    h = bh % H
    segment = tl.where(reverse != 0, n_segments - 1 - walk, walk)
    if IS_VARLEN:  # only the last walked piece carries on into the next segment, if it does not end here
        walk_first, n_pieces, flags = _segment_pieces(segments_ptr, segment, n_segments, reverse)
        _, segment_start, tokens, _, ends = _piece(segments_ptr, walk_first, n_pieces - 1, n_pieces, flags,
                                                   segment, n_segments, segment_len, T, reverse)
        tokens = tl.where(ends, 0, tokens)
    else:
        segment_start = segment * segment_len
        tokens = tl.minimum(segment_len, T - segment_start)

    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    # int64 bases: B*H*T*D can pass 2**31 even when one segment's offsets cannot.
    b64, h64, start64 = b.to(tl.int64), h.to(tl.int64), segment_start.to(tl.int64)
    k_ptr += b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
    v_ptr += b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
    grad_denominator_ptr += (b64 * H + h64) * T + start64
    denominator_ptr += (b64 * H + h64) * T + start64

    b_sum = tl.zeros([BLOCK_D, BLOCK_E], dtype=tl.float32)
    b_z = tl.zeros([BLOCK_D], dtype=tl.float32)  # NORMALIZE: column E of the sum
    for chunk_start in range(0, tokens, CHUNK):
        offs_t = chunk_start + offs_c
        mask_t = offs_t < tokens
        b_k = tl.load(k_ptr + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                      mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        b_v = tl.load(v_ptr + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                      mask=mask_t[:, None] & mask_e[None, :], other=0.0)
        if NORMALIZE:  # z beside the sum, and the backward's g and r (_normalized_chunk_sum)
            b_sum, b_z = _normalized_chunk_sum(
                b_sum, b_z, b_k, b_v, grad_denominator_ptr, denominator_ptr, offs_t, mask_t[:, None] & mask_d[None, :],
                mask_t, NORMALIZER_GRADIENT, FEATURE_MAP, FLOAT32_PRECISION,
                INTERPRETED)
        else:
            b_sum = _add_product(b_sum, tl.trans(b_k).to(DOT_DTYPE), b_v.to(DOT_DTYPE), FLOAT32_PRECISION, INTERPRETED)

    state_width = _slot_width(E, NORMALIZE)
    states_ptr += bh.to(tl.int64) * n_segments * D * state_width
    slot_ptr = states_ptr + (walk + 1).to(tl.int64) * D * state_width
    tl.store(slot_ptr + offs_d[:, None] * state_width + offs_e[None, :], b_sum,
             mask=mask_d[:, None] & mask_e[None, :])
    if NORMALIZE:  # z belongs to no value block: the first block's program stores it
        tl.store(slot_ptr + offs_d * state_width + E, b_z, mask=offs_d < tl.where(e_block == 0, D, 0))

    # Pass 2 needs every sum of this (batch*head, value block), and programs cannot wait for
    # each other: each counts itself in once its sum is stored, and the last to arrive (NS - 2
    # earlier arrivals) scans. The barrier orders every thread's stores before the count; the
    # count's acquire-release order makes the other programs' sums visible to the last one.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + bh * e_blocks + e_block, 1, sem="acq_rel")
    if arrived == n_segments - 2:
        initial_state_ptr += b64 * stride_s0b + h64 * stride_s0h
        _scan_start_states(states_ptr, initial_state_ptr, segments_ptr, stride_s0b, stride_s0d, stride_s0e,
                           D, E, state_width, n_segments, reverse, e_block, BLOCK_D, BLOCK_E, IS_VARLEN)
        if NORMALIZE:  # z, column E, as a value block of one column (block E of width 1), by the first block's
            if e_block == 0:
                _scan_start_states(states_ptr, initial_state_ptr, segments_ptr, stride_s0b, stride_s0d,
                                   stride_s0e, D, E + 1, state_width, n_segments, reverse, E, BLOCK_D, 1, IS_VARLEN)


@triton.jit
def _scan_start_states(states_ptr, initial_state_ptr, segments_ptr, stride_s0b, stride_s0d, stride_s0e,
                       D, E, state_width, n_segments, reverse, e_block, BLOCK_D: tl.constexpr,
                       BLOCK_E: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Pass 2 for one (batch*head, value block): slot w <- S_0 + slots 1..w, seeded with S_0 in
    slot 0. states_ptr: this head's (NS, D, state_width) buffer, columns up to E scanned.

    Packed (IS_VARLEN), a segmented scan: slot w holds the sum of the previous walked segment's
    last piece only (empty when that piece ends there), and unless segment w's first walked
    sequence began before the previous walked segment (the table's restart flag, 4 forwards, 8
    in reverse) the walk restarts from that sequence's S_0 (row ``seq`` of S_0; G in reverse)
    before adding the slot.

    The segments one after another with a running carry, ROWS rows of the slice at a time. Each
    step waits for a load from L2, so the fewer steps the better: the whole slice up to 4096
    entries, else 2048 a step (a larger tile spills registers in pass 1's main loop). The loads
    of a step do not wait on each other: with one S_0 for every sequence (zero strides, no
    initial state given) the restart does not even read the sequence's row."""
    ROWS: tl.constexpr = BLOCK_D if BLOCK_D * BLOCK_E <= 4096 else 2048 // BLOCK_E
    offs_e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    for first_row in range(0, D, ROWS):
        offs_d = first_row + tl.arange(0, ROWS)
        mask = (offs_d < D)[:, None] & (offs_e < E)[None, :]
        offs_state = offs_d[:, None] * state_width + offs_e[None, :]
        offs_s0 = offs_d[:, None] * stride_s0d + offs_e[None, :] * stride_s0e
        first_seq = 0
        if IS_VARLEN:  # forward: sequence 0; reverse: the last one
            first_seq = tl.load(segments_ptr + tl.where(reverse != 0, 2 * n_segments - 1, 0))
        b_carry = tl.load(initial_state_ptr + first_seq * stride_s0b + offs_s0, mask=mask, other=0.0)
        # a scalar that steps a slot at a time: fewer registers than a tile of pointers
        slot_ptr = states_ptr
        tl.store(slot_ptr + offs_state, b_carry, mask=mask)
        for walk in range(1, n_segments):
            slot_ptr += D * state_width
            # .cg reads from L2: other multiprocessors wrote these sums.
            b_sum = tl.load(slot_ptr + offs_state, mask=mask, other=0.0, cache_modifier=".cg")
            if IS_VARLEN:  # the segmented combine: restart unless a sequence runs on from before
                segment = tl.where(reverse != 0, n_segments - 1 - walk, walk)
                if (tl.load(segments_ptr + 2 * n_segments + segment) & (4 + 4 * reverse)) != 0:
                    # the S_0 of the segment's first walked sequence (with one S_0 for every
                    # sequence, no need to look which)
                    seq = 0 if stride_s0b == 0 else tl.load(segments_ptr + reverse * n_segments + segment)
                    b_carry = tl.load(initial_state_ptr + seq * stride_s0b + offs_s0, mask=mask, other=0.0)
            b_carry += b_sum
            tl.store(slot_ptr + offs_state, b_carry, mask=mask)


@triton.jit
def _start_state(start_ptr, stride_sd, stride_se, offs_d, offs_e, mask_d, mask_e, E, NORMALIZE: tl.constexpr):
    """A walk's float32 start state (D x BLOCK_E) and, with NORMALIZE, z from its column E."""
    b_state = tl.load(start_ptr + offs_d[:, None] * stride_sd + offs_e[None, :] * stride_se,
                      mask=mask_d[:, None] & mask_e[None, :], other=0.0)
    b_z = tl.zeros([offs_d.shape[0]], dtype=tl.float32)
    if NORMALIZE:
        b_z = tl.load(start_ptr + offs_d * stride_sd + E * stride_se, mask=mask_d, other=0.0)
    return b_state, b_z


@triton.jit
def _transposed_start_state(start_ptr, stride_sd, stride_se, offs_d, offs_e, mask_d, mask_e, E,
                            NORMALIZE: tl.constexpr):
    """A walk's float32 start state seen transposed, P = S^T (BLOCK_E x BLOCK_D), and with
    NORMALIZE z (BLOCK_D) from column E of S."""
    b_p = tl.load(start_ptr + offs_e[:, None] * stride_se + offs_d[None, :] * stride_sd,
                  mask=mask_e[:, None] & mask_d[None, :], other=0.0)
    b_z = tl.zeros([offs_d.shape[0]], dtype=tl.float32)
    if NORMALIZE:
        b_z = tl.load(start_ptr + offs_d * stride_sd + E * stride_se, mask=mask_d, other=0.0)
    return b_p, b_z


@triton.jit
def scan_outputs_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    start_ptr,                      # float32 start states, element (b, h, walk, d, e) via strides
    initial_state_ptr,              # IS_VARLEN: the walk's S_0 (G when reverse), element (seq, h, d, e) via strides
    final_state_ptr,                # float32 (B*H, D, W), contiguous (packed: one per sequence and head)
    segments_ptr,                   # IS_VARLEN: int32 segment table (see _segment_table)
    denominator_ptr,                # NORMALIZE: d_t + eps (B, H, T) float32, contiguous, written
    T, H, D, E,
    segment_len, n_segments,
    reverse,                        # 1: walk from last to first, so that o_t sees tokens j >= t
    eps,                            # NORMALIZE: added once to each denominator
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_sb, stride_sh, stride_sw, stride_sd, stride_se,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FLOAT32_PRECISION: tl.constexpr,  # float32 operands: "tf32x3", "tf32" or a split (see _dot)
    IS_VARLEN: tl.constexpr,
    NORMALIZE: tl.constexpr,        # divide o_t by d_t + eps, d_t = q_t . z_t (forward walk only): states
                                    # of W = E + 1 columns, z (the keys' sum) in column E
    FEATURE_MAP: tl.constexpr,      # NORMALIZE: q and k are mapped by "elu" or "relu" as loaded, or "identity"
):
    """Pass 3: the chunked causal product of one segment from its start state. Packed, of each
    piece of the segment in walk order: the first from the start state unless it starts its
    sequence here, every other from its sequence's S_0; a piece that ends its sequence here
    stores that sequence's S_T."""
    # The arguments as passed, for a token-by-token walk after the chunk loop (see the end).
    q_arg, k_arg, v_arg, o_arg, start_arg = q_ptr, k_ptr, v_ptr, o_ptr, start_ptr
    STATE_WIDTH_EXTRA: tl.constexpr = 1 if NORMALIZE else 0
    INPUT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    # The operand type that meets the float32 state and scores (see the header).
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    # Under the interpreter every operand is widened to float32 after its rounding: a product of
    # two 16-bit floats is exact in float32, so the CPU computes the GPU's products.
    DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else INPUT_DTYPE
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE
    # A flat grid as in pass 1, over every walk position.
    e_blocks = (E + BLOCK_E - 1) // BLOCK_E
    pid = tl.program_id(0)
    e_block = pid % e_blocks
    walk = (pid // e_blocks) % n_segments
    bh = pid // (e_blocks * n_segments)
    b = bh // H
    h = bh % H
    segment = tl.where(reverse != 0, n_segments - 1 - walk, walk)
    n_pieces = 1  # one sequence a batch row: the segment is one piece (a loop of one pass, unrolled)
    if IS_VARLEN:
        walk_first, n_pieces, flags = _segment_pieces(segments_ptr, segment, n_segments, reverse)

    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    mask_de = mask_d[:, None] & mask_e[None, :]
    causal = tl.where(reverse != 0, offs_c[:, None] <= offs_c[None, :], offs_c[:, None] >= offs_c[None, :])
    b64, h64 = b.to(tl.int64), h.to(tl.int64)

    # disable_licm: what the compiler would hoist out of the loop over pieces (the tensors' bases)
    # would stay live through the chunk loop and cost it registers.
    for piece in tl.range(0, n_pieces, disable_licm=True):
        if IS_VARLEN:  # the piece: its sequence, first token, length
            seq, piece_start, tokens, starts, _ends = _piece(
                segments_ptr, walk_first, piece, n_pieces, flags, segment, n_segments, segment_len, T, reverse)
        else:
            piece_start = segment * segment_len
            tokens = tl.minimum(segment_len, T - piece_start)
        n_chunks = (tokens + CHUNK - 1) // CHUNK
        start64 = piece_start.to(tl.int64)
        q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
        k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
        v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
        o_base = o_ptr + b64 * stride_ob + h64 * stride_oh + start64 * stride_ot
        # NORMALIZE: z, the sum of the keys so far, carried next to the state. It needs no v, so every
        # value block's program carries it; d_t + eps and z are stored by the first block's.
        slot_ptr = start_ptr + b64 * stride_sb + h64 * stride_sh + walk.to(tl.int64) * stride_sw
        if IS_VARLEN:
            if starts:
                b_state, b_z = _start_state(initial_state_ptr + seq * stride_s0b + h64 * stride_s0h, stride_s0d,
                                            stride_s0e, offs_d, offs_e, mask_d, mask_e, E, NORMALIZE)
            else:
                b_state, b_z = _start_state(slot_ptr, stride_sd, stride_se, offs_d, offs_e, mask_d, mask_e, E,
                                            NORMALIZE)
        else:
            b_state, b_z = _start_state(slot_ptr, stride_sd, stride_se, offs_d, offs_e, mask_d, mask_e, E, NORMALIZE)
        denominator_base = denominator_ptr + (b64 * H + h64) * T + start64
        stored_tokens = tl.where(e_block == 0, tokens, 0)
        # NORMALIZE: z carried as K^T U in the first column of b_key_sum (see _unit_columns).
        b_key_sum = tl.where(tl.arange(0, UNIT_BLOCK)[None, :] == 0, b_z[:, None], 0.0)
        b_units = _unit_columns(CHUNK, DOT_DTYPE)

        # A masked zero times an inf or NaN of v is NaN: it would reach the chunk's earlier outputs. The
        # loop keeps its products and only sums 0 * O_c per row (NaN once anything in O_c is not finite);
        # a program that saw one redoes its piece one token at a time after the loop.
        b_seen = tl.zeros([CHUNK], dtype=tl.float32)
        for i in range(0, n_chunks):
            chunk_start = tl.where(reverse != 0, n_chunks - 1 - i, i) * CHUNK
            offs_t = chunk_start + offs_c
            mask_t = offs_t < tokens
            b_q = tl.load(q_base + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                          mask=mask_t[:, None] & mask_d[None, :], other=0.0)
            b_k = tl.load(k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                          mask=mask_t[:, None] & mask_d[None, :], other=0.0)
            b_v = tl.load(v_base + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                          mask=mask_t[:, None] & mask_e[None, :], other=0.0)
            # phi(k) is 0 past the tokens and D, so the state, z and the scores never see phi(q) there
            # (and rows past the tokens are not stored): q's padding needs no mask.
            b_q = _features(b_q, True, FEATURE_MAP, INTERPRETED)
            b_k = _features(b_k, mask_t[:, None] & mask_d[None, :], FEATURE_MAP, INTERPRETED)

            b_kt = tl.trans(b_k).to(DOT_DTYPE)
            b_scores = _dot(b_q.to(DOT_DTYPE), b_kt, None, FLOAT32_PRECISION, INTERPRETED)
            b_scores = tl.where(causal, b_scores, 0.0)
            b_o = _dot(b_q.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE),
                       _rounded(b_state, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                       None, FLOAT32_PRECISION, INTERPRETED)
            b_o = _dot(_rounded(b_scores, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                       b_v.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), b_o, FLOAT32_PRECISION, INTERPRETED)
            b_state = _add_product(b_state, b_kt, b_v.to(DOT_DTYPE), FLOAT32_PRECISION, INTERPRETED)
            b_seen += tl.sum(b_o * 0.0, 1)
            if NORMALIZE:
                # d_t = rowsum of the unrounded masked scores + q_t . z_{c-1}, in float32; masked with
                # tl.where, so an inf or NaN of a later key reaches no earlier denominator.
                b_z = tl.sum(b_key_sum, 1)
                b_denominator = tl.sum(b_scores, 1) + tl.sum(b_q.to(tl.float32) * b_z[None, :], 1) + eps
                tl.store(denominator_base + offs_t, b_denominator, mask=offs_t < stored_tokens)
                b_o = b_o / b_denominator[:, None]
                b_key_sum = _add_product(b_key_sum, b_kt, b_units, FLOAT32_PRECISION, INTERPRETED)
            tl.store(o_base + offs_t[:, None] * stride_ot + offs_e[None, :] * stride_oe,
                     _rounded(b_o, o_ptr.dtype.element_ty, INTERPRETED),
                     mask=mask_t[:, None] & mask_e[None, :])

        # what the store and a redo need, derived again rather than kept live through the loop
        if IS_VARLEN:
            seq, piece_start, tokens, starts, ends_walk = _piece(
                segments_ptr, walk_first, piece, n_pieces, flags, segment, n_segments, segment_len, T, reverse)
            final_row = seq * H + h
        else:
            ends_walk = walk == n_segments - 1
            final_row = bh
        if ends_walk:  # the last walked segment (of its sequence) ends on S_T
            state_width = E + STATE_WIDTH_EXTRA
            final_base = final_state_ptr + final_row.to(tl.int64) * D * state_width
            tl.store(final_base + offs_d[:, None] * state_width + offs_e[None, :], b_state, mask=mask_de)
            if NORMALIZE:
                tl.store(final_base + offs_d * state_width + E, tl.sum(b_key_sum, 1),
                         mask=offs_d < tl.where(e_block == 0, D, 0))

        if tl.sum(b_seen, 0) != 0.0:  # an inf or NaN in some O_c: redo the piece's outputs causally
            if IS_VARLEN:
                start64 = piece_start.to(tl.int64)
                q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
                k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
                v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
                o_base = o_ptr + b64 * stride_ob + h64 * stride_oh + start64 * stride_ot
                if starts:
                    _outputs_token_by_token(
                        q_base, k_base, v_base, o_base, initial_state_ptr + seq * stride_s0b + h64 * stride_s0h,
                        tokens, reverse, e_block * BLOCK_E, D, E, eps, stride_qt, stride_qd, stride_kt, stride_kd,
                        stride_vt, stride_ve, stride_ot, stride_oe, stride_s0d, stride_s0e,
                        BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)
                else:
                    _outputs_token_by_token(
                        q_base, k_base, v_base, o_base,
                        start_ptr + b64 * stride_sb + h64 * stride_sh + walk.to(tl.int64) * stride_sw,
                        tokens, reverse, e_block * BLOCK_E, D, E, eps, stride_qt, stride_qd, stride_kt, stride_kd,
                        stride_vt, stride_ve, stride_ot, stride_oe, stride_sd, stride_se,
                        BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)
            else:
                redo_b, redo_h, redo_walk, redo_first, redo_tokens, redo_e_block = _segment_after_loop(
                    tl.program_id(0).to(tl.int64), (E + BLOCK_E - 1) // BLOCK_E, n_segments, H, T, segment_len,
                    reverse)
                _outputs_token_by_token(
                    q_arg + redo_b * stride_qb + redo_h * stride_qh + redo_first * stride_qt,
                    k_arg + redo_b * stride_kb + redo_h * stride_kh + redo_first * stride_kt,
                    v_arg + redo_b * stride_vb + redo_h * stride_vh + redo_first * stride_vt,
                    o_arg + redo_b * stride_ob + redo_h * stride_oh + redo_first * stride_ot,
                    start_arg + redo_b * stride_sb + redo_h * stride_sh + redo_walk * stride_sw,
                    redo_tokens, reverse, redo_e_block * BLOCK_E, D, E, eps, stride_qt, stride_qd,
                    stride_kt, stride_kd, stride_vt, stride_ve, stride_ot, stride_oe, stride_sd, stride_se,
                    BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)


@triton.jit
def scan_backward_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,    # inputs: q, k (B, H, T, D), v and dO (B, H, T, E)
    grad_denominator_ptr,           # NORMALIZE: r (B, H, T) float32, contiguous (normalizer_gradient_kernel)
    denominator_ptr,                # NORMALIZE: the forward's d_t + eps (B, H, T) float32, contiguous
    dq_ptr, dk_ptr, dv_ptr,         # outputs (B, H, T, D), (B, H, T, D), (B, H, T, E), input dtype
    forward_start_ptr,              # float32 S each segment's forward walk starts from (walk = segment)
    suffix_start_ptr,               # float32 R each segment's reverse walk starts from (walk = NS-1-segment)
    initial_state_ptr,              # IS_VARLEN: float32 S_0, element (seq, h, d, e) via strides
    grad_final_ptr,                 # IS_VARLEN: float32 G, the gradient of S_T, likewise
    ds0_ptr,                        # float32 (B*H, D, W), contiguous: dS_0, written by segment 0
                                    # (the states have W = E + 1 columns, z or dz last, with NORMALIZE)
    segments_ptr,                   # IS_VARLEN: int32 segment table (see _segment_table)
    T, H, D, E,
    segment_len, n_segments,
    compute_dq,                     # 0: q needs no gradient; skip the forward walk (dq_ptr unused)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    stride_fb, stride_fh, stride_fw, stride_fd, stride_fe,
    stride_rb, stride_rh, stride_rw, stride_rd, stride_re,
    stride_s0b, stride_s0h, stride_s0d, stride_s0e,
    stride_gb, stride_gh, stride_gd, stride_ge,
    BLOCK_D: tl.constexpr,          # >= D
    BLOCK_E: tl.constexpr,          # >= E: dK sums over every value column, so one program owns them all
    CHUNK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    NORMALIZE: tl.constexpr,        # the backward of scan_outputs_kernel's NORMALIZE forward
    FEATURE_MAP: tl.constexpr,      # NORMALIZE: the forward's map; dq and dk are taken through it
):
    """The backward's pass 3 for one segment, all three products in one program: a forward walk
    for dQ, from the forward's start state transposed (P = S^T, E x D),
        dQ_c = dO_c P + ((dO_c V_c^T) * L) K_c,   P <- P + V_c^T K_c,
    then a reverse walk for dK and dV together, from the suffix state R = G + sum over later
    segments of Q^T dO (D x E), with U the upper triangle,
        dV_c = ((K_c Q_c^T) * U) dO_c + K_c R,   dK_c = ((V_c dO_c^T) * U) Q_c + V_c R^T,
        R <- R + Q_c^T dO_c,
    and the program of the first segment stores the final R, dS_0. Packed, both walks go piece
    by piece as in scan_outputs_kernel: a piece that starts its sequence's forward walk starts
    from its S_0, one that starts its reverse walk from its G, and one that ends the reverse walk
    stores its dS_0.
    NORMALIZE, out_t = n_t / (d_t + eps) with d_t = q_t . z_t: the numerator's gradient is
    g_t = dO_t / (d_t + eps), the denominator's r_t = -(g_t . out_t); d_t is a causal product of
    q and k with values 1, so both walks run the above on g with a column of r beside it: r_t
    joins every visible score gradient (dO_c V_c^T and V_c dO_c^T), dQ_c gains r_t z_{c-1} (z
    from the forward start state's column E, plus the earlier chunks' keys), and dK_c gains dz,
    the suffix state's column E, G_z plus r_t q_t of the later tokens; what dz ends as is dz_0.
    g is made here, r read (one number a token, from ``normalizer_gradient_kernel``).
    FEATURE_MAP: q and k are mapped as loaded, as in the forward, the walks run on phi(q), phi(k),
    and the gradients of phi(q) and phi(k) are taken through the map before their store."""
    # The arguments as passed, for the token-by-token walks after the chunk loops (see below).
    q_arg, k_arg, v_arg, do_arg, dq_arg, dk_arg, dv_arg = q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr
    grad_denominator_arg, denominator_arg = grad_denominator_ptr, denominator_ptr
    STATE_WIDTH_EXTRA: tl.constexpr = 1 if NORMALIZE else 0
    forward_start_arg, suffix_start_arg = forward_start_ptr, suffix_start_ptr
    INPUT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    MIXED_DTYPE: tl.constexpr = tl.bfloat16 if INPUT_DTYPE == tl.bfloat16 else tl.float32
    # float32 operands (float16's state and scores, and float32 inputs) in one TF32 product: the
    # wrappers launch this kernel for float32 inputs only under TF32 (``fused_backward_config``).
    FLOAT32_PRECISION: tl.constexpr = "tf32"
    DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else INPUT_DTYPE
    MIXED_DOT_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else MIXED_DTYPE
    pid = tl.program_id(0)
    segment = pid % n_segments
    bh = pid // n_segments
    b = bh // H
    h = bh % H
    forward_pieces = 1  # one sequence a batch row: the segment is one piece (loops of one pass, unrolled)
    reverse_pieces = 1
    if IS_VARLEN:
        forward_first, forward_pieces, flags = _segment_pieces(segments_ptr, segment, n_segments, 0)
        reverse_first, reverse_pieces, _flags = _segment_pieces(segments_ptr, segment, n_segments, 1)

    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    # As in scan_outputs_kernel: each walk sums 0 * its gradient tiles per row, and a walk whose
    # tiles held an inf or NaN is redone one token at a time after the loops.
    if compute_dq:
        lower = offs_c[:, None] >= offs_c[None, :]
        # disable_licm: what the compiler would hoist out of the loop over pieces (the tensors'
        # bases) would stay live through the chunk loop and cost it registers.
        for piece in tl.range(0, forward_pieces, disable_licm=True):
            if IS_VARLEN:
                seq, piece_start, tokens, starts, _ends = _piece(segments_ptr, forward_first, piece, forward_pieces,
                                                                 flags, segment, n_segments, segment_len, T, 0)
            else:
                piece_start = segment * segment_len
                tokens = tl.minimum(segment_len, T - piece_start)
            n_chunks = (tokens + CHUNK - 1) // CHUNK
            start64 = piece_start.to(tl.int64)
            q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
            k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
            v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
            do_base = do_ptr + b64 * stride_dob + h64 * stride_doh + start64 * stride_dot
            dq_base = dq_ptr + b64 * stride_dqb + h64 * stride_dqh + start64 * stride_dqt
            grad_denominator_base = grad_denominator_ptr + (b64 * H + h64) * T + start64
            denominator_base = denominator_ptr + (b64 * H + h64) * T + start64
            # P = S^T, E x D, and z from column E of S
            forward_start = forward_start_ptr + b64 * stride_fb + h64 * stride_fh + segment.to(tl.int64) * stride_fw
            if IS_VARLEN:
                if starts:
                    b_p, b_z = _transposed_start_state(initial_state_ptr + seq * stride_s0b + h64 * stride_s0h,
                                                       stride_s0d, stride_s0e, offs_d, offs_e, mask_d, mask_e, E,
                                                       NORMALIZE)
                else:
                    b_p, b_z = _transposed_start_state(forward_start, stride_fd, stride_fe, offs_d, offs_e, mask_d,
                                                       mask_e, E, NORMALIZE)
            else:
                b_p, b_z = _transposed_start_state(forward_start, stride_fd, stride_fe, offs_d, offs_e, mask_d, mask_e,
                                                   E, NORMALIZE)
            b_dq_seen = tl.zeros([CHUNK], dtype=tl.float32)
            if NORMALIZE:  # r a chunk ahead: the pipeline copies ahead only what feeds a product's operands
                b_grad_denominator_next = tl.load(grad_denominator_base + offs_c, mask=offs_c < tokens, other=0.0)
            for i in range(0, n_chunks):
                offs_t = i * CHUNK + offs_c
                mask_t = offs_t < tokens
                mask_td = mask_t[:, None] & mask_d[None, :]
                b_do = tl.load(do_base + offs_t[:, None] * stride_dot + offs_e[None, :] * stride_doe,
                               mask=mask_t[:, None] & mask_e[None, :], other=0.0)        # [C, E]
                b_v = tl.load(v_base + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                              mask=mask_t[:, None] & mask_e[None, :], other=0.0)         # [C, E]
                b_k = tl.load(k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                              mask=mask_td, other=0.0)                                   # [C, D]
                b_k = _features(b_k, mask_td, FEATURE_MAP, INTERPRETED)
                if NORMALIZE:  # g (a product operand) and r in place of dO; every operand as g
                    b_grad_denominator = b_grad_denominator_next
                    b_grad_denominator_next = tl.load(grad_denominator_base + CHUNK + offs_t,
                                                      mask=CHUNK + offs_t < tokens, other=0.0)
                    b_do = _numerator_gradient(b_do, denominator_base, offs_t, mask_t, MIXED_DTYPE, MIXED_DOT_DTYPE,
                                               INTERPRETED)
                    b_vt = tl.trans(b_v).to(MIXED_DTYPE).to(MIXED_DOT_DTYPE)
                    b_scores = tl.dot(b_do, b_vt, input_precision=FLOAT32_PRECISION) + b_grad_denominator[:, None]
                else:
                    b_vt = tl.trans(b_v).to(DOT_DTYPE)
                    b_scores = tl.dot(b_do.to(DOT_DTYPE), b_vt, input_precision=FLOAT32_PRECISION)
                b_scores = tl.where(lower, b_scores, 0.0)
                b_dq = tl.dot(b_do.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE),
                              _rounded(b_p, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                              input_precision=FLOAT32_PRECISION)
                b_dq = tl.dot(_rounded(b_scores, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                              b_k.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), acc=b_dq, input_precision=FLOAT32_PRECISION)
                if NORMALIZE:
                    b_dq += b_grad_denominator[:, None] * b_z[None, :]
                    b_z += tl.sum(b_k.to(tl.float32), 0)
                b_p = tl.dot(b_vt, b_k.to(b_vt.dtype), acc=b_p, input_precision=FLOAT32_PRECISION)
                if FEATURE_MAP != "identity":  # dq = the gradient of phi(q) times phi'(q)
                    b_q = tl.load(q_base + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                                  mask=mask_td, other=0.0)
                    b_dq = _through_features(b_dq, _features(b_q, mask_td, FEATURE_MAP, INTERPRETED), FEATURE_MAP)
                b_dq_seen += tl.sum(b_dq * 0.0, 1)
                tl.store(dq_base + offs_t[:, None] * stride_dqt + offs_d[None, :] * stride_dqd,
                         _rounded(b_dq, dq_ptr.dtype.element_ty, INTERPRETED), mask=mask_td)
            if tl.sum(b_dq_seen, 0) != 0.0:  # an inf or NaN in some dQ_c: redo the piece's dq causally
                if IS_VARLEN:
                    seq, piece_start, tokens, starts, _ends = _piece(
                        segments_ptr, forward_first, piece, forward_pieces, flags, segment, n_segments, segment_len,
                        T, 0)
                    start64 = piece_start.to(tl.int64)
                    q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
                    k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
                    v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
                    do_base = do_ptr + b64 * stride_dob + h64 * stride_doh + start64 * stride_dot
                    dq_base = dq_ptr + b64 * stride_dqb + h64 * stride_dqh + start64 * stride_dqt
                    grad_denominator_base = grad_denominator_ptr + (b64 * H + h64) * T + start64
                    denominator_base = denominator_ptr + (b64 * H + h64) * T + start64
                    if starts:
                        _query_gradients_token_by_token(
                            do_base, v_base, k_base, q_base, dq_base, grad_denominator_base, denominator_base,
                            initial_state_ptr + seq * stride_s0b + h64 * stride_s0h, tokens, D, E,
                            stride_dot, stride_doe, stride_vt, stride_ve, stride_kt, stride_kd, stride_qt, stride_qd,
                            stride_dqt, stride_dqd, stride_s0d, stride_s0e, BLOCK_D, BLOCK_E,
                            NORMALIZE, FEATURE_MAP, INTERPRETED)
                    else:
                        _query_gradients_token_by_token(
                            do_base, v_base, k_base, q_base, dq_base, grad_denominator_base, denominator_base,
                            forward_start_ptr + b64 * stride_fb + h64 * stride_fh + segment.to(tl.int64) * stride_fw,
                            tokens, D, E,
                            stride_dot, stride_doe, stride_vt, stride_ve, stride_kt, stride_kd, stride_qt, stride_qd,
                            stride_dqt, stride_dqd, stride_fd, stride_fe, BLOCK_D, BLOCK_E,
                            NORMALIZE, FEATURE_MAP, INTERPRETED)
                else:
                    redo_b, redo_h, redo_walk, redo_first, redo_tokens, _ = _segment_after_loop(
                        tl.program_id(0).to(tl.int64), 1, n_segments, H, T, segment_len, 0)
                    _query_gradients_token_by_token(
                        do_arg + redo_b * stride_dob + redo_h * stride_doh + redo_first * stride_dot,
                        v_arg + redo_b * stride_vb + redo_h * stride_vh + redo_first * stride_vt,
                        k_arg + redo_b * stride_kb + redo_h * stride_kh + redo_first * stride_kt,
                        q_arg + redo_b * stride_qb + redo_h * stride_qh + redo_first * stride_qt,
                        dq_arg + redo_b * stride_dqb + redo_h * stride_dqh + redo_first * stride_dqt,
                        grad_denominator_arg + (redo_b * H + redo_h) * T + redo_first,
                        denominator_arg + (redo_b * H + redo_h) * T + redo_first,
                        forward_start_arg + redo_b * stride_fb + redo_h * stride_fh + redo_walk * stride_fw,
                        redo_tokens, D, E,
                        stride_dot, stride_doe, stride_vt, stride_ve, stride_kt, stride_kd, stride_qt, stride_qd,
                        stride_dqt, stride_dqd, stride_fd, stride_fe, BLOCK_D, BLOCK_E, NORMALIZE,
                        FEATURE_MAP, INTERPRETED)

    upper = offs_c[:, None] <= offs_c[None, :]
    for piece in tl.range(0, reverse_pieces, disable_licm=True):  # disable_licm: as in the forward walk
        if IS_VARLEN:
            seq, piece_start, tokens, starts, _ends = _piece(
                segments_ptr, reverse_first, piece, reverse_pieces, flags, segment, n_segments, segment_len, T, 1)
        else:
            piece_start = segment * segment_len
            tokens = tl.minimum(segment_len, T - piece_start)
        n_chunks = (tokens + CHUNK - 1) // CHUNK
        start64 = piece_start.to(tl.int64)
        q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
        k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
        v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
        do_base = do_ptr + b64 * stride_dob + h64 * stride_doh + start64 * stride_dot
        dk_base = dk_ptr + b64 * stride_dkb + h64 * stride_dkh + start64 * stride_dkt
        dv_base = dv_ptr + b64 * stride_dvb + h64 * stride_dvh + start64 * stride_dvt
        grad_denominator_base = grad_denominator_ptr + (b64 * H + h64) * T + start64
        denominator_base = denominator_ptr + (b64 * H + h64) * T + start64
        suffix_start = (suffix_start_ptr + b64 * stride_rb + h64 * stride_rh
                        + (n_segments - 1 - segment).to(tl.int64) * stride_rw)
        if IS_VARLEN:
            if starts:
                b_r, b_dz = _start_state(grad_final_ptr + seq * stride_gb + h64 * stride_gh, stride_gd, stride_ge,
                                         offs_d, offs_e, mask_d, mask_e, E, NORMALIZE)               # [D, E]
            else:
                b_r, b_dz = _start_state(suffix_start, stride_rd, stride_re, offs_d, offs_e, mask_d, mask_e, E,
                                         NORMALIZE)
        else:
            b_r, b_dz = _start_state(suffix_start, stride_rd, stride_re, offs_d, offs_e, mask_d, mask_e, E, NORMALIZE)
        b_dkv_seen = tl.zeros([CHUNK], dtype=tl.float32)
        if NORMALIZE:  # r a chunk ahead, as in the forward walk
            offs_last = (n_chunks - 1) * CHUNK + offs_c
            b_grad_denominator_next = tl.load(grad_denominator_base + offs_last,
                                              mask=(offs_last >= 0) & (offs_last < tokens), other=0.0)
        for i in range(0, n_chunks):
            offs_t = (n_chunks - 1 - i) * CHUNK + offs_c
            mask_t = offs_t < tokens
            mask_td = mask_t[:, None] & mask_d[None, :]
            mask_te = mask_t[:, None] & mask_e[None, :]
            b_q = tl.load(q_base + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=mask_td, other=0.0)
            b_k = tl.load(k_base + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=mask_td, other=0.0)
            b_v = tl.load(v_base + offs_t[:, None] * stride_vt + offs_e[None, :] * stride_ve, mask=mask_te, other=0.0)
            b_do = tl.load(do_base + offs_t[:, None] * stride_dot + offs_e[None, :] * stride_doe, mask=mask_te,
                           other=0.0)
            b_q = _features(b_q, mask_td, FEATURE_MAP, INTERPRETED)
            b_k = _features(b_k, mask_td, FEATURE_MAP, INTERPRETED)
            b_kq = tl.dot(b_k.to(DOT_DTYPE), tl.trans(b_q).to(DOT_DTYPE), input_precision=FLOAT32_PRECISION)
            b_kq = tl.where(upper, b_kq, 0.0)
            if NORMALIZE:  # g and r in place of dO, as in the forward walk
                b_grad_denominator = b_grad_denominator_next
                offs_next = offs_t - CHUNK
                b_grad_denominator_next = tl.load(grad_denominator_base + offs_next, mask=offs_next >= 0, other=0.0)
                b_do = _numerator_gradient(b_do, denominator_base, offs_t, mask_t, MIXED_DTYPE, MIXED_DOT_DTYPE,
                                           INTERPRETED)
                b_vdo = tl.dot(b_v.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), tl.trans(b_do),
                               input_precision=FLOAT32_PRECISION)
                b_vdo += b_grad_denominator[None, :]
            else:
                b_vdo = tl.dot(b_v.to(DOT_DTYPE), tl.trans(b_do).to(DOT_DTYPE), input_precision=FLOAT32_PRECISION)
            b_vdo = tl.where(upper, b_vdo, 0.0)
            b_r_mixed = _rounded(b_r, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE)
            b_dv = tl.dot(b_k.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), b_r_mixed, input_precision=FLOAT32_PRECISION)
            b_dv = tl.dot(_rounded(b_kq, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                          b_do.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), acc=b_dv, input_precision=FLOAT32_PRECISION)
            b_dk = tl.dot(b_v.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), tl.trans(b_r_mixed),
                          input_precision=FLOAT32_PRECISION)
            b_dk = tl.dot(_rounded(b_vdo, MIXED_DTYPE, INTERPRETED).to(MIXED_DOT_DTYPE),
                          b_q.to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), acc=b_dk, input_precision=FLOAT32_PRECISION)
            if NORMALIZE:
                b_dk += b_dz[None, :]
                b_dz += tl.sum(b_grad_denominator[:, None] * b_q.to(tl.float32), 0)
                b_r = tl.dot(tl.trans(b_q).to(MIXED_DTYPE).to(MIXED_DOT_DTYPE), b_do, acc=b_r,
                             input_precision=FLOAT32_PRECISION)
            else:
                b_r = tl.dot(tl.trans(b_q).to(DOT_DTYPE), b_do.to(DOT_DTYPE), acc=b_r,
                             input_precision=FLOAT32_PRECISION)
            b_dk = _through_features(b_dk, b_k, FEATURE_MAP)
            b_dkv_seen += tl.sum(b_dk * 0.0, 1) + tl.sum(b_dv * 0.0, 1)
            tl.store(dk_base + offs_t[:, None] * stride_dkt + offs_d[None, :] * stride_dkd,
                     _rounded(b_dk, dk_ptr.dtype.element_ty, INTERPRETED), mask=mask_td)
            tl.store(dv_base + offs_t[:, None] * stride_dvt + offs_e[None, :] * stride_dve,
                     _rounded(b_dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask_te)

        # what the store and a redo need, derived again rather than kept live through the loop
        if IS_VARLEN:
            seq, piece_start, tokens, starts, ends_walk = _piece(
                segments_ptr, reverse_first, piece, reverse_pieces, flags, segment, n_segments, segment_len, T, 1)
            ds0_row = seq * H + h
        else:
            ends_walk = segment == 0
            ds0_row = bh
        if ends_walk:  # the reverse walk ends on dS_0
            state_width = E + STATE_WIDTH_EXTRA
            ds0_base = ds0_ptr + ds0_row.to(tl.int64) * D * state_width
            tl.store(ds0_base + offs_d[:, None] * state_width + offs_e[None, :], b_r,
                     mask=mask_d[:, None] & mask_e[None, :])
            if NORMALIZE:
                tl.store(ds0_base + offs_d * state_width + E, b_dz, mask=mask_d)

        if tl.sum(b_dkv_seen, 0) != 0.0:  # an inf or NaN in dK_c or dV_c: redo both causally
            if IS_VARLEN:
                start64 = piece_start.to(tl.int64)
                q_base = q_ptr + b64 * stride_qb + h64 * stride_qh + start64 * stride_qt
                k_base = k_ptr + b64 * stride_kb + h64 * stride_kh + start64 * stride_kt
                v_base = v_ptr + b64 * stride_vb + h64 * stride_vh + start64 * stride_vt
                do_base = do_ptr + b64 * stride_dob + h64 * stride_doh + start64 * stride_dot
                dk_base = dk_ptr + b64 * stride_dkb + h64 * stride_dkh + start64 * stride_dkt
                dv_base = dv_ptr + b64 * stride_dvb + h64 * stride_dvh + start64 * stride_dvt
                grad_denominator_base = grad_denominator_ptr + (b64 * H + h64) * T + start64
                denominator_base = denominator_ptr + (b64 * H + h64) * T + start64
                if starts:
                    _key_value_gradients_token_by_token(
                        q_base, k_base, v_base, do_base, dk_base, dv_base, grad_denominator_base, denominator_base,
                        grad_final_ptr + seq * stride_gb + h64 * stride_gh, tokens, D, E,
                        stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_dot, stride_doe,
                        stride_dkt, stride_dkd, stride_dvt, stride_dve, stride_gd, stride_ge,
                        BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)
                else:
                    _key_value_gradients_token_by_token(
                        q_base, k_base, v_base, do_base, dk_base, dv_base, grad_denominator_base, denominator_base,
                        suffix_start_ptr + b64 * stride_rb + h64 * stride_rh
                        + (n_segments - 1 - segment).to(tl.int64) * stride_rw, tokens, D, E,
                        stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_dot, stride_doe,
                        stride_dkt, stride_dkd, stride_dvt, stride_dve, stride_rd, stride_re,
                        BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)
            else:
                redo_b, redo_h, redo_walk, redo_first, redo_tokens, _ = _segment_after_loop(
                    tl.program_id(0).to(tl.int64), 1, n_segments, H, T, segment_len, 0)
                _key_value_gradients_token_by_token(
                    q_arg + redo_b * stride_qb + redo_h * stride_qh + redo_first * stride_qt,
                    k_arg + redo_b * stride_kb + redo_h * stride_kh + redo_first * stride_kt,
                    v_arg + redo_b * stride_vb + redo_h * stride_vh + redo_first * stride_vt,
                    do_arg + redo_b * stride_dob + redo_h * stride_doh + redo_first * stride_dot,
                    dk_arg + redo_b * stride_dkb + redo_h * stride_dkh + redo_first * stride_dkt,
                    dv_arg + redo_b * stride_dvb + redo_h * stride_dvh + redo_first * stride_dvt,
                    grad_denominator_arg + (redo_b * H + redo_h) * T + redo_first,
                    denominator_arg + (redo_b * H + redo_h) * T + redo_first,
                    suffix_start_arg + redo_b * stride_rb + redo_h * stride_rh
                    + (n_segments - 1 - redo_walk) * stride_rw,
                    redo_tokens, D, E,
                    stride_qt, stride_qd, stride_kt, stride_kd, stride_vt, stride_ve, stride_dot, stride_doe,
                    stride_dkt, stride_dkd, stride_dvt, stride_dve, stride_rd, stride_re,
                    BLOCK_D, BLOCK_E, NORMALIZE, FEATURE_MAP, INTERPRETED)


@triton.jit
def scan_segments_kernel(
    cu_seqlens_ptr,                 # (N + 1,) int32 or int64 offsets of the packed sequences
    segments_ptr,                   # int32 (3 * NS + N + 1,), written: the segment table (see _segment_table)
    n_sequences, n_segments, segment_len,
    BLOCK_S: tl.constexpr,          # segments per program
    BLOCK_N: tl.constexpr,          # sequences read per step
):
    """The segment table of packed sequences, BLOCK_S segments a program. Segment s holds tokens
    [s L, min((s + 1) L, T)). Its first piece's sequence is the one that holds its first token
    (sequence 0 for segment 0, so that empty sequences in front are walked too): the count of
    sequences that end at or before s L. Its last piece's sequence is the one that holds token
    (s + 1) L if that one began before it, else the last to end at or before (s + 1) L (empty
    ones included); every sequence in between ends in the segment. Program 0 also copies the
    offsets, as int32, after the three rows."""
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_segments
    segment_first = offs_s * segment_len
    segment_end = segment_first + segment_len
    ended_before = tl.zeros([BLOCK_S], dtype=tl.int32)   # sequences that end at or before s L
    ended_within = tl.zeros([BLOCK_S], dtype=tl.int32)   # ... at or before (s + 1) L
    for n0 in range(0, n_sequences, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_sequences
        eos = tl.load(cu_seqlens_ptr + offs_n + 1, mask=mask_n, other=0).to(tl.int32)
        ended_before += tl.sum((mask_n[None, :] & (eos[None, :] <= segment_first[:, None])).to(tl.int32), axis=1)
        ended_within += tl.sum((mask_n[None, :] & (eos[None, :] <= segment_end[:, None])).to(tl.int32), axis=1)
    first = tl.where(offs_s == 0, 0, ended_before)
    # the sequence that holds token (s + 1) L, if any: it goes on into the segment if it began before
    holds_end = ended_within < n_sequences
    next_start = tl.load(cu_seqlens_ptr + ended_within, mask=mask_s & holds_end, other=0).to(tl.int32)
    goes_on = holds_end & (next_start < segment_end)
    last = tl.where(goes_on, ended_within, ended_within - 1)
    first_start = tl.load(cu_seqlens_ptr + first, mask=mask_s, other=0).to(tl.int32)
    last_end = tl.load(cu_seqlens_ptr + last + 1, mask=mask_s, other=0).to(tl.int32)
    # Pass 2 carries a state into segment s only when s's first walked sequence began before the
    # segment walked before s: else it restarts there from that sequence's S_0 (G in reverse).
    forward_restart = first_start >= segment_first - segment_len
    reverse_restart = last_end <= segment_end + segment_len
    flags = ((first_start >= segment_first).to(tl.int32) + 2 * (~goes_on).to(tl.int32)
             + 4 * forward_restart.to(tl.int32) + 8 * reverse_restart.to(tl.int32))
    tl.store(segments_ptr + offs_s, first, mask=mask_s)
    tl.store(segments_ptr + n_segments + offs_s, last, mask=mask_s)
    tl.store(segments_ptr + 2 * n_segments + offs_s, flags, mask=mask_s)
    if tl.program_id(0) == 0:
        for n0 in range(0, n_sequences + 1, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n <= n_sequences
            tl.store(segments_ptr + 3 * n_segments + offs_n,
                     tl.load(cu_seqlens_ptr + offs_n, mask=mask_n, other=0).to(tl.int32), mask=mask_n)


# Host side: configuration, launches, autograd.

#: Keys a ``config`` may set. CHUNK, BLOCK_E, num_warps and num_stages shape the compiled
#: kernels; SEGMENT_LEN (tokens per segment, a multiple of CHUNK) is a runtime argument and only
#: decides how the work is cut.
CONFIG_KEYS = ("CHUNK", "BLOCK_E", "SEGMENT_LEN", "num_warps", "num_stages")

#: Configurations for a benchmark to sweep on a GPU (bfloat16, D = E = 64 and 128): the default
#: rule's blocks (keys left out) and three alternatives that compile without spills in bfloat16
#: and fit sm_80's and sm_90's shared memory up to D = E = 128, each with the rule's segment
#: length (None) and three fixed ones.
TUNING_CANDIDATES = [
    {**blocks, "SEGMENT_LEN": length}
    for blocks in (
        {},
        {"CHUNK": 64, "BLOCK_E": 32, "num_warps": 4, "num_stages": 2},   # twice the programs
        {"CHUNK": 64, "BLOCK_E": 64, "num_warps": 8, "num_stages": 2},   # two warp groups
        {"CHUNK": 32, "BLOCK_E": 64, "num_warps": 4, "num_stages": 3},   # more loads in flight
    )
    for length in (None, 1024, 2048, 4096)
]


def check_config(config):
    """A TypeError or ValueError naming the key and its limit for a config the kernels cannot run:
    CHUNK and BLOCK_E powers of two of at least 16 (``tl.dot``'s smallest tile on a GPU),
    SEGMENT_LEN None or a positive int (a multiple of CHUNK, checked once CHUNK is resolved),
    num_warps a power of two up to 32, num_stages at least 1."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; expected some of {CONFIG_KEYS}")
    for key, value in config.items():
        if key == "SEGMENT_LEN" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"config {key} must be an int, got {value!r}")
        if key in ("CHUNK", "BLOCK_E") and (value < 16 or value & (value - 1)):
            raise ValueError(f"config {key} must be a power of two >= 16, got {value}")
        if key == "num_warps" and not (1 <= value <= 32 and value & (value - 1) == 0):
            raise ValueError(f"config num_warps must be a power of two from 1 to 32, got {value}")
        if key in ("num_stages", "SEGMENT_LEN") and value < 1:
            raise ValueError(f"config {key} must be at least 1, got {value}")


#: Head dimensions the candidates are meant for.
_TUNED_HEAD_DIMS = (64, 128)
#: Pass-3 programs per multiprocessor the segment length aims for: two let one program's loads
#: overlap another's products; more add pass-2 steps and state traffic, and measured slower on
#: an H200 (benchmarks/NOTES.md). bfloat16 with a deeper pipeline takes at most one instead
#: (``_segment_length``). Packed sequences are cut as one sequence of their total length.
_PROGRAMS_PER_SM = 2
#: Pipeline depth (``num_stages``) from which bfloat16's pass-3 program hides its own loads.
_DEEP_PIPELINE_STAGES = 3
#: (multiprocessors, shared memory per block) of an H100/H200, assumed where no GPU answers.
_NOMINAL_LIMITS = (132, 232448)


@functools.lru_cache(maxsize=None)  # asked once per device, not at every launch
def _device_limits(device):
    """(multiprocessors, opt-in shared memory per block) of a GPU; an H100/H200's elsewhere."""
    if device.type != "cuda":
        return _NOMINAL_LIMITS
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)  # asked at every launch; triton.next_power_of_2 costs a microsecond
def _block(n):
    """The power-of-two tile that holds n: tl.dot needs at least 16 on a GPU."""
    return max(16, triton.next_power_of_2(n))


#: ``torch.get_float32_matmul_precision()`` -> the products of float32 operands: 3xTF32 for
#: "highest", one TF32 product for "high" and "medium". "bf16x3_manual" for "highest" splits
#: them into bfloat16 parts (3xTF32 still where ``split_is_right`` or ``split_is_accurate`` says
#: no, and in the normalised attention; not the default here: see the module docstring).
FLOAT32_PRECISIONS = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}


def float32_precision(normalized=False):
    """The products of float32 operands under PyTorch's current setting: ``FLOAT32_PRECISIONS``'s,
    "tf32x3" (about 3e-7) for "highest", the default, "tf32" (about 1.5e-3) for "high" and
    "medium"; a split into bfloat16 parts set there becomes "tf32x3" for the normalised attention
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
#: float64, in this file's kernels or in chunked's, whose tiles fail alike; benchmarks/NOTES.md,
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


#: Triton 3.6 compiles pass 3 with 3xTF32 products on 8 warps and a 16 x 16 state so that it
#: reads shared memory out of bounds on an H200 (compute-sanitizer, D = E = 8): under any split
#: of float32 operands, a config asking for 8 warps where neither side of the state tile is
#: this wide is refused (the rule gives float32 4 warps). (32 x 16, 16 x 64 and 64 x 16 tiles
#: ran right on 8 warps under 3xTF32.)
_TF32X3_8_WARPS_MIN_BLOCK = 32
#: float32 products made of several tensor-core products each.
_SPLIT_PRECISIONS = ("tf32x3", "bf16x3", "bf16x6", "bf16x3_manual")


def _pipelined_bytes(block_d, block_e, chunk, stages, itemsize):
    """Shared memory of pass 3's pipeline: ``stages`` chunks of q, k and v in flight, and the
    state as a product operand (counted at 4 bytes)."""
    return stages * chunk * (2 * block_d + block_e) * itemsize + block_d * block_e * 4


def _default_blocks(D, E, dtype, precision="tf32x3", shared_memory=_NOMINAL_LIMITS[1], denominator=False):
    """CHUNK, BLOCK_E, num_warps and num_stages, chosen so that pass 3 does not spill registers
    on sm_90 for 16-bit inputs (checked with ptxas for every BLOCK_D). ``shared_memory``: a
    block's opt-in bytes (by default an H100/H200's). ``denominator``: for the normalised forward
    (NORMALIZE), which carries z beside the state.

    bfloat16: chunks of 64 tokens, one 64-row tensor-core instruction (wgmma) per product; pass 3
        holds the state [BLOCK_D, BLOCK_E], the scores [64, 64] and the output [64, BLOCK_E] in
        float32 registers, so BLOCK_D * BLOCK_E <= 8192 (64 registers a thread on 4 warps) and
        BLOCK_E <= 64.
    float16: the state and scores enter their products as float32 (TF32), twice the registers:
        BLOCK_D * BLOCK_E <= 4096, and chunks of 32 when D or E exceeds 128 (D and E alike: the
        backward swaps them and must cut the forward's segments into the same chunks).
    float32: tensor-core tiles twice the size of float16's at the same counts (chunks of 64 up
        to D, E = 64, else 32; BLOCK_D * BLOCK_E <= 4096), on 4 warps: faster than 8 under
        3xTF32 too on an H200 (``benchmarks/float32_sweep.py``). Under TF32 alone (``precision``
        "tf32") from D = 65 to 128: whole value heads up to 128 columns. Where E is from 65 to
        128 too, chunks of 16 on 4 warps (D and E alike, so the backward's chunks match);
        elsewhere chunks of 32 (as the swapped backward's float32 tiles), on 8 warps once the
        state passes 8192 entries. At (2, 16, 16384, 128) on an H200 the 16-token chunks were
        the fastest, ahead of chunks of 32 on 8 warps and of 32-column tiles
        (``benchmarks/float32_sweep.py``; figures in benchmarks/NOTES.md).
    Two stages let the loads of the next chunk overlap the products of this one. bfloat16 keys
    from 33 to 128 wide take four where they fit ``shared_memory`` (160 KB of loads in flight at
    D = 128, 96 KB at D = 64), except in the normalised forward, which four made slower, and
    with them segments about twice as long (``_segment_length``), without which four stages
    gained nothing at D = 64. float16 keys 33 to 128 wide take three (four were slower); float32
    keeps two (3xTF32 is slower with more). The timings behind each choice are in
    benchmarks/NOTES.md.
    """
    block_d = _block(D)
    if dtype == torch.float32 and precision == "tf32" and 64 < block_d <= 128:
        if 64 < _block(E) <= 128:
            return {"CHUNK": 16, "BLOCK_E": _block(E), "num_warps": 4, "num_stages": 2}
        block_e = min(_block(E), 128)
        return {"CHUNK": 32, "BLOCK_E": block_e, "num_warps": 8 if block_d * block_e > 8192 else 4,
                "num_stages": 2}
    if dtype == torch.float32:
        chunk = 64 if max(block_d, _block(E)) <= 64 else 32
        state_entries, warps = 4096, 4
    elif dtype == torch.float16:
        chunk, state_entries, warps = (64 if max(block_d, _block(E)) <= 128 else 32), 4096, 4
    else:
        chunk, state_entries, warps = 64, 8192, 4
    block_e = min(_block(E), 64, max(16, state_entries // block_d))
    stages = 2
    deeper = {torch.bfloat16: 4, torch.float16: 3}.get(dtype)
    if (deeper and 32 < block_d <= 128 and not denominator
            and _pipelined_bytes(block_d, block_e, chunk, deeper, 2) <= shared_memory):
        stages = deeper
    return {"CHUNK": chunk, "BLOCK_E": block_e, "num_warps": warps, "num_stages": stages}


def _segment_length(T, batch_heads, D, E, chunk, e_blocks, element_size, multiprocessors,
                    one_program_per_sm=False):
    """Tokens per segment: short enough to fill the GPU, long enough that states stay cheap.

    Parallelism: aim for _PROGRAMS_PER_SM pass-3 programs (batch_heads * e_blocks * NS) on every
    multiprocessor: T / NS tokens rounded to the nearest power of two (at least one chunk), so
    that equal segments split the sequence evenly. ``one_program_per_sm`` (bfloat16 with
    ``_DEEP_PIPELINE_STAGES`` or more, where each program hides its own loads): instead the
    most segments that give at most one program a multiprocessor (the shortest power of
    two that cuts T into no more than multiprocessors / (batch_heads * e_blocks) segments; one
    where the heads alone fill the GPU). Measured on an H100 (benchmarks/NOTES.md): bfloat16 with
    three or four stages was faster so at nine shapes, 8-34 % forward; float16 with three stages
    was faster at the two-program length, and float32 with any deeper pipeline slower.
    Traffic: each segment moves its float32 state (D * E * 4 bytes) about four times; keep that
    under a quarter of the segment's own q, k, v and o, i.e. L >= 64 * D * E / ((2D + 2E) *
    element_size), a multiple of CHUNK. Where parallelism and traffic disagree (short sequences,
    many heads), traffic wins.
    """
    programs_a_segment = max(1, batch_heads * e_blocks)
    if one_program_per_sm:
        segments = max(1, multiprocessors // programs_a_segment)
        parallel_length = max(chunk, triton.next_power_of_2(triton.cdiv(T, segments)))
    else:
        wanted_segments = triton.cdiv(_PROGRAMS_PER_SM * multiprocessors, programs_a_segment)
        parallel_length = max(chunk, 2 ** round(math.log2(max(1.0, T / wanted_segments))))
    traffic_length = triton.cdiv(64 * D * E, (2 * D + 2 * E) * element_size)
    traffic_length = triton.cdiv(traffic_length, chunk) * chunk
    return max(parallel_length, traffic_length)


def default_config(B, H, T, D, E, dtype, multiprocessors, float32_precision="tf32x3",
                   shared_memory=_NOMINAL_LIMITS[1]):
    """The wrapper's rule: the blocks of ``_default_blocks`` and the length of
    ``_segment_length`` for a GPU with ``multiprocessors`` multiprocessors and ``shared_memory``
    opt-in bytes a block (by default an H100/H200's), for float32 inputs whose products are
    ``float32_precision``'s (``float32_precision()``). The keys are ``CONFIG_KEYS``, so the result
    can be passed back as ``config=``. Packed sequences take the config of one sequence of their
    total length."""
    resolved = _resolved_config(B, H, T, D, E, dtype, multiprocessors, (), float32_precision, shared_memory)
    return {key: resolved[key] for key in CONFIG_KEYS}


@functools.lru_cache(maxsize=1024)  # the rule costs microseconds of Python, a short call's host time
def _resolved_config(B, H, T, D, E, dtype, multiprocessors, overrides, float32_precision,
                     shared_memory=_NOMINAL_LIMITS[1], denominator=False):
    """The rule with the (checked) ``overrides`` applied, as a cached dict: never modify it."""
    config = dict(overrides)
    precision = float32_precision if dtype == torch.float32 else "tf32"
    resolved = {**_default_blocks(D, E, dtype, precision, shared_memory, denominator),
                **{k: v for k, v in config.items() if k != "SEGMENT_LEN"}}
    length = config.get("SEGMENT_LEN")
    if length is None:
        length = _segment_length(T, B * H, D, E, resolved["CHUNK"], triton.cdiv(E, resolved["BLOCK_E"]),
                                 dtype.itemsize, multiprocessors,
                                 dtype == torch.bfloat16 and resolved["num_stages"] >= _DEEP_PIPELINE_STAGES)
    elif length < resolved["CHUNK"] or length % resolved["CHUNK"]:
        raise ValueError(f"config SEGMENT_LEN must be a positive multiple of CHUNK={resolved['CHUNK']}, "
                         f"got {length}")
    if (precision in _SPLIT_PRECISIONS and resolved["num_warps"] > 4
            and max(_block(D), resolved["BLOCK_E"]) < _TF32X3_8_WARPS_MIN_BLOCK):
        raise ValueError(f"config num_warps must be at most 4 for float32 products at full precision "
                         f"when neither side of the state tile reaches {_TF32X3_8_WARPS_MIN_BLOCK} "
                         f"(BLOCK_D={_block(D)}, BLOCK_E={resolved['BLOCK_E']}), got {resolved['num_warps']}")
    if precision == BF16X3_MANUAL.value and not split_is_right(_block(D), resolved["BLOCK_E"], resolved["CHUNK"]):
        precision = "tf32x3"
    resolved["SEGMENT_LEN"] = length
    resolved["FLOAT32_PRECISION"] = precision
    return resolved


def _resolve_config(q, v, config, normalized=False, denominator=False):
    """The launch configuration for these inputs: the rule, then the caller's keys; float32
    products at the precision PyTorch's setting asks for now (3xTF32 for "highest" when
    ``normalized``: a pass of the normalised attention, see ``float32_precision``).
    ``denominator``: the normalised forward's passes (see ``_default_blocks``)."""
    B, H, T, D = q.shape
    overrides = tuple(sorted((config or {}).items()))
    precision = float32_precision(normalized)
    if precision == BF16X3_MANUAL.value and not split_is_accurate(q, v, B):  # packed: counted as one row
        precision = "tf32x3"
    multiprocessors, shared_memory = _device_limits(q.device)
    return _resolved_config(B, H, T, D, v.shape[-1], q.dtype, multiprocessors, overrides, precision, shared_memory,
                            denominator)


#: The fused backward holds R (D x E), two [C, C] score tiles and the dK and dV tiles of a chunk
#: in registers at once, which fits heads up to 64 wide (float16 and float32 inputs at 32-token
#: chunks).
FUSED_BACKWARD_MAX_BLOCK = 64
_FUSED_BACKWARD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fused_backward_shared_memory(fused, dtype, normalize=False):
    """Bytes of shared memory of the reverse walk: ``num_stages`` chunks of q, k, v and dO (and,
    when normalising, r and d + eps, float32 a token) in flight, plus R and its transpose as
    product operands (counted at 4 bytes)."""
    chunk_bytes = fused["CHUNK"] * ((2 * fused["BLOCK_D"] + 2 * fused["BLOCK_E"]) * dtype.itemsize + 8 * normalize)
    return fused["num_stages"] * chunk_bytes + 2 * fused["BLOCK_D"] * fused["BLOCK_E"] * 4


def fused_backward_config(D, E, dtype, config=None, *, shared_memory=_NOMINAL_LIMITS[1], normalize=False,
                          precision=None):
    """Launch parameters of ``scan_backward_kernel``, or None where the backward runs pass 3 three
    times instead: heads wider than FUSED_BACKWARD_MAX_BLOCK, or float32 inputs whose
    ``precision`` (the resolved config's ``FLOAT32_PRECISION``) is not one TF32 product, the
    kernel's. CHUNK: the forward's, at most 64 for bfloat16 and 32 for float16 and float32
    (whose float32 intermediates need the registers).
    One program per segment leaves the load pipeline as its parallelism: 4 warps, 4 stages,
    fewer stages until the loads in flight fit ``shared_memory`` (``normalize``: the normalised
    backward's, which also loads r and d + eps)."""
    block_d, block_e = _block(D), _block(E)
    if dtype not in _FUSED_BACKWARD_DTYPES or max(block_d, block_e) > FUSED_BACKWARD_MAX_BLOCK:
        return None
    if dtype == torch.float32 and precision != "tf32":
        return None
    chunk = min(64 if dtype == torch.bfloat16 else 32, (config or {}).get("CHUNK", 64))
    fused = {"BLOCK_D": block_d, "BLOCK_E": block_e, "CHUNK": chunk, "num_warps": 4, "num_stages": 4}
    while fused["num_stages"] > 1 and _fused_backward_shared_memory(fused, dtype, normalize) > shared_memory:
        fused["num_stages"] -= 1
    return fused


def _zero(device):
    """A float32 zero, the S_0 (or G) of every walk that has none: read, never written. One per
    device, made outside any CUDA-graph capture (a tensor made during one holds no value until
    the graph is replayed)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, device=device)
    return _cached_zero(device)


@functools.lru_cache(maxsize=None)
def _cached_zero(device):
    return torch.zeros(1, device=device)


@dataclass(frozen=True)
class _States:
    """Float32 states read by the kernels: element (b, h, walk position, d, e) of ``tensor`` sits
    at offset b*strides[0] + h*strides[1] + walk*strides[2] + d*strides[3] + e*strides[4]."""

    tensor: torch.Tensor
    strides: tuple

    @staticmethod
    def initial(state, device):
        """S_0 for every walk position; None becomes one zero shared through zero strides."""
        if state is None:
            return _States(_zero(device), (0, 0, 0, 0, 0))
        sb, sh, sd, se = state.stride()
        return _States(state, (sb, sh, 0, sd, se))

    def transposed(self):
        """The same states seen as (E, D): the start states of the swapped-role products."""
        sb, sh, sw, sd, se = self.strides
        return replace(self, strides=(sb, sh, sw, se, sd))


def _without_walk(strides):
    """The (b, h, d, e) strides of a ``_States``: a walk's S_0 (or G), row b per sequence."""
    sb, sh, _, sd, se = strides
    return sb, sh, sd, se


#: Segments per program and sequences per step of ``scan_segments_kernel``.
_TABLE_BLOCK_S, _TABLE_BLOCK_N = 128, 64


def _segment_table(cu_seqlens, segment_len, T):
    """The segments of packed sequences: int32 (3 * NS + N + 1,), NS = cdiv(T, L). The
    segments are those of one sequence of T tokens, cut every L tokens whatever the
    boundaries; the part of a sequence that lies in a segment is a piece. Row 0 (entries 0 to
    NS - 1) holds each segment's first piece's sequence, row 1 its last piece's (every
    sequence between them ends in the segment), row 2 its flags (1: the first piece's sequence
    begins in the segment; 2: the last piece's sequence ends in it; 4: the first piece's
    sequence began no earlier than the start of the segment before, so pass 2's forward walk
    restarts at the segment; 8: the last piece's sequence ends no later than the end of the
    segment after, so the reverse walk restarts there), then the N + 1 offsets as int32. One
    launch (``scan_segments_kernel``), without reading the offsets back."""
    n_sequences = cu_seqlens.shape[0] - 1
    n_segments = -(-T // segment_len)
    table = torch.empty(3 * n_segments + n_sequences + 1, dtype=torch.int32, device=cu_seqlens.device)
    with _launch_guard():
        scan_segments_kernel[(triton.cdiv(n_segments, _TABLE_BLOCK_S),)](
            cu_seqlens, table, n_sequences, n_segments, segment_len,
            BLOCK_S=_TABLE_BLOCK_S, BLOCK_N=_TABLE_BLOCK_N, num_warps=4,
        )
    return table


def _slot_columns(E, normalize):
    """``_slot_width``: E, or E + 1 (z last) padded to a multiple of 16 when normalising."""
    return (E // 16 + 1) * 16 if normalize else E


def _segment_starts(k, v, initial, *, reverse, config, segments=None, normalize=False, grad_denominator=None,
                    denominator=None, feature_map="identity"):
    """Passes 1 and 2 (one launch): the state each segment starts from, in walk order.
    ``segments``: the table of packed sequences (``_segment_table``), or None. ``normalize``:
    z (the keys' sum) in column E of the states (rows padded, ``_slot_columns``). With
    ``grad_denominator`` (``_normalizer_gradient``'s r) and the forward's ``denominator``, the
    normalised backward's suffix states (NORMALIZER_GRADIENT): k and v are q and dO, S sums
    q_t g_t^T and z sums r_t q_t.
    ``feature_map`` maps k (q) as the kernel loads it."""
    B, H, T, D = k.shape
    E = v.shape[-1]
    n_segments = -(-T // config["SEGMENT_LEN"])  # rounded up, as triton.cdiv but without its host cost
    if n_segments <= 1:
        return initial
    gradient = denominator is not None
    block_d, chunk = _block(D), config["CHUNK"]
    block_e = config["BLOCK_E"]
    e_blocks = -(-E // block_e)
    width = _slot_columns(E, normalize)
    states = torch.empty(B * H, n_segments, D, width, device=k.device, dtype=torch.float32)
    arrivals = torch.zeros(B * H * e_blocks, device=k.device, dtype=torch.int32)
    sb, sh, _, sd, se = initial.strides
    # Stand-ins for the pointers a launch without NORMALIZER_GRADIENT never follows.
    grad_denominator_arg, denominator_arg = (grad_denominator, denominator) if gradient else (arrivals, arrivals)
    with _launch_guard():
        scan_summaries_kernel[(B * H * (n_segments - 1) * e_blocks,)](
            k, v, states, initial.tensor, arrivals, arrivals if segments is None else segments,
            grad_denominator_arg, denominator_arg, T, H, D, E, config["SEGMENT_LEN"], n_segments,
            int(reverse), *k.stride(), *v.stride(), sb, sh, sd, se,
            BLOCK_D=block_d, BLOCK_E=block_e, CHUNK=chunk, INTERPRETED=triton.knobs.runtime.interpret,
            FLOAT32_PRECISION=config["FLOAT32_PRECISION"], IS_VARLEN=segments is not None,
            NORMALIZE=normalize, NORMALIZER_GRADIENT=gradient, FEATURE_MAP=feature_map,
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    return _States(states, (H * n_segments * D * width, n_segments * D * width, D * width, width, 1))


def _segment_outputs(q, k, v, starts, *, reverse, config, initial=None, segments=None, n_sequences=None,
                     denominator=None, eps=0.0, feature_map="identity", out_dtype=None):
    """Pass 3: o and the final state, every segment from its start state. Packed (``segments``),
    one final state per sequence: (n_sequences, H, D, E), and the pieces that start their
    sequence's walk in a segment start from its row of ``initial`` (the walk's S_0, or G when
    ``reverse``, a ``_States`` seen as ``starts`` is). With ``denominator``, a (B, H, T)
    float32 tensor that receives d_t + eps, the normalised forward (NORMALIZE): its states have
    E + 1 columns, z last, and ``feature_map`` maps q and k as the kernel loads them. o is
    written in ``out_dtype`` (None: q's)."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    n_segments = -(-T // config["SEGMENT_LEN"])  # rounded up, as triton.cdiv but without its host cost
    block_d, block_e, chunk = _block(D), config["BLOCK_E"], config["CHUNK"]
    normalize = denominator is not None
    o = torch.empty_like(v, dtype=q.dtype if out_dtype is None else out_dtype)  # laid out as v, as in chunked
    final_state = torch.empty(B if segments is None else n_sequences, H, D, E + normalize, device=q.device,
                              dtype=torch.float32)
    initial = initial or starts  # without segments, a stand-in the kernel never follows
    sb0, sh0, sd0, se0 = _without_walk(initial.strides)
    with _launch_guard():
        scan_outputs_kernel[(B * H * n_segments * -(-E // block_e),)](
            q, k, v, o, starts.tensor, initial.tensor, final_state, final_state if segments is None else segments,
            denominator if normalize else final_state,
            T, H, D, E, config["SEGMENT_LEN"], n_segments, int(reverse), float(eps),
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *starts.strides, sb0, sh0, sd0, se0,
            BLOCK_D=block_d, BLOCK_E=block_e, CHUNK=chunk, INTERPRETED=triton.knobs.runtime.interpret,
            FLOAT32_PRECISION=config["FLOAT32_PRECISION"], IS_VARLEN=segments is not None, NORMALIZE=normalize,
            FEATURE_MAP=feature_map, num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    return o, final_state


def _launch(q, k, v, initial_state, config, cu_seqlens=None, *, eps=None, feature_map="identity",
            normalized=False):
    """The forward's two launches. Returns (o, final_state, segment start states or None, segment
    length, segment table or None, d + eps or None). Packed (``cu_seqlens``): the segments of
    one sequence of total_T tokens, each walked piece by piece (``_segment_table``), one state per
    sequence. With ``eps``, the normalised forward
    (NORMALIZE): states of E + 1 columns, z last, and d_t + eps (B, H, T) float32 for the backward;
    ``feature_map`` maps q and k in the kernels. ``normalized``: a plain product whose caller
    normalises by its last column (float32 products as ``_resolve_config`` gives them)."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    n_states = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    normalize = eps is not None
    denominator = torch.empty(B, H, T, device=q.device, dtype=torch.float32) if normalize else None
    if T == 0:  # nothing to walk: S_T is S_0
        final_state = torch.empty(n_states, H, D, E + normalize, device=q.device, dtype=torch.float32)
        if initial_state is None:
            final_state.zero_()
        else:
            final_state.copy_(initial_state)
        return torch.empty(B, H, 0, E, device=q.device, dtype=q.dtype), final_state, None, None, None, denominator
    resolved = _resolve_config(q, v, config, normalized=normalize or normalized, denominator=normalize)
    segments = None if cu_seqlens is None else _segment_table(cu_seqlens, resolved["SEGMENT_LEN"], T)
    initial = _States.initial(initial_state, q.device)
    starts = _segment_starts(k, v, initial, reverse=False, config=resolved, segments=segments, normalize=normalize,
                             feature_map=feature_map)
    o, final_state = _segment_outputs(q, k, v, starts, reverse=False, config=resolved, initial=initial,
                                      segments=segments, n_sequences=n_states, denominator=denominator,
                                      eps=eps or 0.0,
                                      feature_map=feature_map)
    return o, final_state, starts, resolved["SEGMENT_LEN"], segments, denominator


#: Tokens a program of ``normalizer_gradient_kernel`` takes.
NORMALIZER_GRADIENT_TOKENS = 64


def _normalizer_gradient(grad_o, o, denominator, *, with_numerator=False):
    """r (B, H, T) float32 of the normalised backward (``normalizer_gradient_kernel``), and with
    ``with_numerator`` (r, g): g (B, H, T, E) contiguous, bfloat16 for bfloat16 inputs, else float32."""
    B, H, T, E = o.shape
    grad_denominator = torch.empty_like(denominator)
    numerator = None
    if with_numerator:
        numerator = torch.empty((B, H, T, E), device=o.device,
                                dtype=torch.bfloat16 if grad_o.dtype == torch.bfloat16 else torch.float32)
    with _launch_guard():
        normalizer_gradient_kernel[(B * H, triton.cdiv(T, NORMALIZER_GRADIENT_TOKENS))](
            grad_o, o, denominator, grad_denominator, grad_denominator if numerator is None else numerator,
            T, H, E, *grad_o.stride(), *o.stride(),
            BLOCK_T=NORMALIZER_GRADIENT_TOKENS, BLOCK_E=_block(E), INTERPRETED=triton.knobs.runtime.interpret,
            WRITE_NUMERATOR=with_numerator)
    return (grad_denominator, numerator) if with_numerator else grad_denominator


#: Tokens and columns a program of ``normalizer_terms_kernel`` takes.
NORMALIZER_TERMS_TOKENS, NORMALIZER_TERMS_COLUMNS = 64, 32


def _normalizer_terms(plain, x, phi, grad_denominator, carry, *, reverse, out, cu_seqlens=None,
                      feature_map="identity"):
    """``normalizer_terms_kernel`` into ``out``: dQ from the plain pass's float32 dQ and the keys'
    features x (``carry``: z_0 or None), or with ``reverse`` dK from dK's and the queries'
    (``carry``: G_z or None), taken through ``feature_map`` at ``phi``. Returns dz_0 (N, H, D)
    float32 when ``reverse``."""
    B, H, T, D = x.shape
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    total = torch.empty((rows, H, D), dtype=torch.float32, device=x.device) if reverse else None
    carry_arg = grad_denominator if carry is None else carry  # a stand-in the kernel never reads
    carry_strides = (0, 0, 0) if carry is None else carry.stride()
    block_d = min(NORMALIZER_TERMS_COLUMNS, triton.next_power_of_2(D))
    with _launch_guard():
        normalizer_terms_kernel[(rows * H, triton.cdiv(D, block_d))](
            plain, x, phi, grad_denominator, carry_arg, out, grad_denominator if total is None else total,
            grad_denominator if cu_seqlens is None else cu_seqlens,
            T, H, D, int(carry is not None), *plain.stride(), *x.stride(), *phi.stride(), *out.stride(),
            *carry_strides, REVERSE=int(reverse), BLOCK_T=NORMALIZER_TERMS_TOKENS, BLOCK_D=block_d,
            IS_VARLEN=cu_seqlens is not None, FEATURE_MAP=feature_map)
    return total


def _launch_backward(q, k, v, grad_o, forward_starts, suffix_starts, *, segment_len, fused, compute_dq,
                     forward_initial, grad_final, segments=None, n_sequences=None, grad_denominator=None,
                     denominator=None, feature_map="identity"):
    """The fused pass 3 of the backward: (dq or None, dk, dv, dS_0); packed (``segments``), dS_0
    is (n_sequences, H, D, E), and pieces start from their sequence's row of ``forward_initial``
    (S_0) or ``grad_final`` (G), both ``_States``. With ``grad_denominator`` (r) and the forward's
    ``denominator``, the normalised backward (NORMALIZE): the states and dS_0 then have E + 1 columns, z (dz) last, and q, k are
    mapped by the forward's ``feature_map``."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    n_segments = -(-T // segment_len)  # rounded up
    normalize = denominator is not None
    # Each gradient laid out as its input: autograd keeps it as is, without a copy to the leaf's strides.
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q) if compute_dq else None
    ds0 = torch.empty(B if segments is None else n_sequences, H, D, E + normalize, device=q.device,
                      dtype=torch.float32)
    dq_arg = dk if dq is None else dq  # a stand-in pointer the kernel never follows
    grad_denominator_arg, denominator_arg = (grad_denominator, denominator) if normalize else (ds0, ds0)  # likewise
    with _launch_guard():
        scan_backward_kernel[(B * H * n_segments,)](
            q, k, v, grad_o, grad_denominator_arg, denominator_arg, dq_arg, dk, dv, forward_starts.tensor,
            suffix_starts.tensor,
            forward_initial.tensor, grad_final.tensor,
            ds0, ds0 if segments is None else segments, T, H, D, E, segment_len, n_segments, int(compute_dq),
            *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dq_arg.stride(),
            *dk.stride(), *dv.stride(), *forward_starts.strides, *suffix_starts.strides,
            *_without_walk(forward_initial.strides), *_without_walk(grad_final.strides),
            BLOCK_D=fused["BLOCK_D"], BLOCK_E=fused["BLOCK_E"], CHUNK=fused["CHUNK"],
            INTERPRETED=triton.knobs.runtime.interpret, IS_VARLEN=segments is not None, NORMALIZE=normalize,
            FEATURE_MAP=feature_map, num_warps=fused["num_warps"], num_stages=fused["num_stages"],
        )
    return dq, dk, dv, ds0


def _backward_in_passes(q, k, v, grad_o, forward_starts, forward_initial, grad_final, overrides, needs, packed,
                        query_key_dtype=None, normalized=False):
    """dq, dk, dv, dS_0 (None where not needed) from pass 3 run up to three times (and passes 1
    and 2 once, for the suffix states), every product cut into the forward's segments:
    dQ = forward product (dO, V, K) from the forward's start states transposed; dV = reverse
    product (K, Q, dO) from G, whose final state is dS_0; dK = reverse product (V, dO, Q) from the
    same suffix states transposed. ``needs``: (q, k, v, initial state). ``forward_initial``: S_0,
    where packed pieces start their forward walk. dq and dk are written in ``query_key_dtype``
    (None: that of their pass's operands). ``normalized``: the passes of the normalised backward
    (float32 products as ``_resolve_config`` gives them)."""
    need_q, need_k, need_v, need_initial = needs
    dq = dk = dv = d_initial = None
    if need_q:
        dq, _ = _segment_outputs(grad_o, v, k, forward_starts.transposed(), reverse=False,
                                 config=_resolve_config(grad_o, k, overrides, normalized),
                                 initial=forward_initial.transposed(),
                                 out_dtype=query_key_dtype, **packed)
    if need_k or need_v or need_initial:
        config = _resolve_config(k, grad_o, overrides, normalized)
        suffix_starts = _segment_starts(q, grad_o, grad_final, reverse=True, config=config,
                                        segments=packed["segments"])
        if need_v or need_initial:
            dv, d_initial = _segment_outputs(k, q, grad_o, suffix_starts, reverse=True, config=config,
                                             initial=grad_final, **packed)
        if need_k:
            dk, _ = _segment_outputs(v, grad_o, q, suffix_starts.transposed(), reverse=True,
                                     config=_resolve_config(v, q, overrides, normalized),
                                     initial=grad_final.transposed(),
                                     out_dtype=query_key_dtype, **packed)
    return dq, dk, dv, d_initial


def _empty_sequence_gradients(q, k, v, grad_final_state, needs):
    """The backward of T = 0: empty gradients for q, k, v; S_T = S_0 passes G through."""
    need_q, need_k, need_v, need_initial = needs
    dq, dk, dv = (torch.zeros_like(x) if need else None for x, need in ((q, need_q), (k, need_k), (v, need_v)))
    return dq, dk, dv, grad_final_state if need_initial else None


#: Why a backward recorded for a gradient of the gradient (create_graph=True) is refused: the
#: backward kernels are not differentiable themselves, so that gradient would silently miss terms.
SECOND_ORDER_REFUSAL = ("a gradient of these gradients (create_graph=True) is not supported: the backward "
                        "kernels are not differentiable themselves")


class _ScanCausalProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, initial_state, config, cu_seqlens, normalized):
        ctx.set_materialize_grads(False)
        ctx.config, ctx.normalized = config, normalized
        o, final_state, starts, ctx.segment_len, segments, _ = _launch(q, k, v, initial_state, config, cu_seqlens,
                                                                       normalized=normalized)
        ctx.save_for_backward(q, k, v, None if starts is None else starts.tensor, segments, initial_state)
        ctx.start_strides = None if starts is None else starts.strides
        ctx.n_states = final_state.shape[0]
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, start_tensor, segments, initial_state = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        need_q, need_k, need_v, need_initial = needs
        packed = {"segments": segments, "n_sequences": ctx.n_states}
        B, H, T, D = q.shape
        E = v.shape[-1]
        if T == 0:
            return (*_empty_sequence_gradients(q, k, v, grad_final_state, needs), None, None, None)
        if grad_o is None:  # only S_T was used
            grad_o = torch.zeros(B, H, T, E, device=q.device, dtype=q.dtype)
        grad_final = _States.initial(grad_final_state, q.device)
        forward_initial = _States.initial(initial_state, q.device)
        # Every product cuts the sequence into the forward's segments, so that start states can
        # be shared: the forward's serve dQ, and one pass 1 and 2 of suffix sums serves dV and dK.
        overrides = {**(ctx.config or {}), "SEGMENT_LEN": ctx.segment_len}
        forward_starts = _States(start_tensor, ctx.start_strides)
        need_suffix = need_k or need_v or need_initial
        config = _resolve_config(k, grad_o, overrides, ctx.normalized)
        fused = fused_backward_config(D, E, q.dtype, config, shared_memory=_device_limits(q.device)[1],
                                      precision=config["FLOAT32_PRECISION"])
        if fused is not None and need_suffix:
            suffix_starts = _segment_starts(q, grad_o, grad_final, reverse=True, config=config,
                                            segments=segments)
            dq, dk, dv, d_initial = _launch_backward(q, k, v, grad_o, forward_starts, suffix_starts,
                                                     segment_len=ctx.segment_len, fused=fused,
                                                     compute_dq=need_q, forward_initial=forward_initial,
                                                     grad_final=grad_final, **packed)
        else:
            dq, dk, dv, d_initial = _backward_in_passes(q, k, v, grad_o, forward_starts, forward_initial,
                                                        grad_final, overrides, needs, packed,
                                                        normalized=ctx.normalized)
        return (dq, dk if need_k else None, dv if need_v else None,
                d_initial if need_initial else None, None, None, None)


def _features_of(x, feature_map):
    """phi(x) in PyTorch as the kernels compute it (``_features``): in float32, rounded to x's dtype."""
    x32 = x.float()
    if feature_map == "elu":
        return torch.where(x32 > 0, x32 + 1, torch.exp(x32)).to(x.dtype)
    return torch.where(x32 < 0, 0.0, x32).to(x.dtype)


def _normalized_backward_in_passes(q, k, v, o, denominator, grad_o, forward_starts, forward_initial, grad_final,
                                   overrides, needs, packed, feature_map, z0, grad_z):
    """The normalised backward where the fused kernel does not apply (float32 under "highest",
    heads over 64):
    ``_backward_in_passes`` on g = dO / (d + eps), then the denominator's terms (its gradient
    r_t = -(g_t . out_t)). g and r come from one launch (``normalizer_gradient_kernel``), g
    rounded as the fused backward rounds it: bfloat16 for bfloat16 inputs, float32 otherwise
    (float16's g falls below its normal range once d_t is a few thousand), and r from that g, so
    that g_t . v_s + r_t cancels where it should. The passes read the first E columns of the
    forward's (S, z) states, write dq and dk in float32, and ``normalizer_terms_kernel``
    completes them with r_t z_t and dz_s (z_0 and G_z: ``z0``, ``grad_z``, None for zeros) before
    rounding; dz_0 comes from dK's terms, which run whenever dS_0 is needed. With a
    ``feature_map``, q and k are mapped here as the forward's kernels mapped them."""
    raw_q, raw_k = q, k
    if feature_map != "identity":
        q, k = _features_of(q, feature_map), _features_of(k, feature_map)
    grad_denominator, g = _normalizer_gradient(grad_o, o, denominator, with_numerator=True)
    need_q, need_k, need_v, need_initial = needs
    plain_q, plain_k, dv, ds0 = _backward_in_passes(
        *(x.to(g.dtype) for x in (q, k, v)), g, forward_starts, forward_initial, grad_final, overrides,
        (need_q, need_k or need_initial, need_v or need_initial, need_initial), packed, query_key_dtype=torch.float32,
        normalized=True)
    cu_seqlens = None
    if packed["segments"] is not None:  # the table ends on the N + 1 offsets
        cu_seqlens = packed["segments"][-(packed["n_sequences"] + 1):]
    terms = {"cu_seqlens": cu_seqlens, "feature_map": feature_map}
    dq = dk = d_initial = None
    if need_q:
        dq = torch.empty_like(raw_q)
        _normalizer_terms(plain_q, k, q, grad_denominator, z0, reverse=False, out=dq, **terms)
    if need_k or need_initial:
        dk = torch.empty_like(raw_k)
        dz0 = _normalizer_terms(plain_k, q, k, grad_denominator, grad_z, reverse=True, out=dk, **terms)
        if need_initial:
            d_initial = torch.cat([ds0, dz0.unsqueeze(-1)], dim=-1)
    return dq, dk, None if dv is None else dv.to(v.dtype), d_initial


class _ScanNormalizedAttention(torch.autograd.Function):
    """Forward: passes 1 to 3 with the normaliser (two launches). Backward: the suffix states'
    passes 1 and 2 and one fused pass 3 with the denominator's terms, or the passes on g and
    the terms' walks."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, eps, config, cu_seqlens, feature_map):
        ctx.set_materialize_grads(False)
        ctx.config = config
        ctx.feature_map = feature_map
        o, final_state, starts, ctx.segment_len, segments, denominator = _launch(
            q, k, v, initial_state, config, cu_seqlens, eps=eps, feature_map=feature_map)
        # q, k as given: the backward maps them again
        ctx.save_for_backward(q, k, v, o, denominator, None if starts is None else starts.tensor, segments,
                              initial_state)
        ctx.start_strides = None if starts is None else starts.strides
        ctx.n_states = final_state.shape[0]
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        if torch.is_grad_enabled():  # create_graph=True (see SECOND_ORDER_REFUSAL)
            raise RuntimeError(SECOND_ORDER_REFUSAL)
        q, k, v, o, denominator, start_tensor, segments, initial_state = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        packed = {"segments": segments, "n_sequences": ctx.n_states}
        B, H, T, D = q.shape
        E = v.shape[-1]
        if T == 0:
            return (*_empty_sequence_gradients(q, k, v, grad_final_state, needs), None, None, None, None)
        if grad_o is None:  # only the final state was used
            grad_o = torch.zeros_like(o)
        grad_final = _States.initial(grad_final_state, q.device)
        forward_initial = _States.initial(initial_state, q.device)
        overrides = {**(ctx.config or {}), "SEGMENT_LEN": ctx.segment_len}
        forward_starts = _States(start_tensor, ctx.start_strides)
        config = _resolve_config(k, grad_o, overrides, normalized=True)
        fused = fused_backward_config(D, E, q.dtype, config, shared_memory=_device_limits(q.device)[1],
                                      normalize=True, precision=config["FLOAT32_PRECISION"])
        if fused is not None:
            grad_denominator = _normalizer_gradient(grad_o, o, denominator)
            suffix_starts = _segment_starts(q, grad_o, grad_final, reverse=True, config=config, segments=segments,
                                            normalize=True, grad_denominator=grad_denominator,
                                            denominator=denominator, feature_map=ctx.feature_map)
            dq, dk, dv, d_initial = _launch_backward(q, k, v, grad_o, forward_starts, suffix_starts,
                                                     segment_len=ctx.segment_len, fused=fused, compute_dq=needs[0],
                                                     forward_initial=forward_initial, grad_final=grad_final,
                                                     grad_denominator=grad_denominator, denominator=denominator,
                                                     feature_map=ctx.feature_map,
                                                     **packed)
        else:
            dq, dk, dv, d_initial = _normalized_backward_in_passes(
                q, k, v, o, denominator, grad_o, forward_starts, forward_initial, grad_final, overrides, needs, packed,
                ctx.feature_map, None if initial_state is None else initial_state[..., E],
                None if grad_final_state is None else grad_final_state[..., E])
        return (dq, dk if needs[1] else None, dv if needs[2] else None, d_initial if needs[3] else None,
                None, None, None, None)


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


def check_inputs(q, k, v, initial_state, method='scan', cu_seqlens=None, *, normalized=False):
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
    if isinstance(scan_outputs_kernel, triton.runtime.JITFunction if triton.knobs.runtime.interpret else InterpretedFunction):
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


def scan_causal_product(q, k, v, initial_state=None, *, config=None, cu_seqlens=None):
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


def _run_validated(q, k, v, initial_state=None, config=None, cu_seqlens=None, normalized=False):
    """``scan_causal_product`` for inputs already through ``check_inputs`` (the package's API
    makes the same checks, once). ``normalized``: v ends with a column of ones, by whose product
    the caller divides the others (the normalised attention of the other methods): float32
    products keep 3xTF32, forward and backward, as the kernels' own normalised launches do."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the kernels read offset n at cu_seqlens_ptr + n
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _ScanCausalProduct.apply(q, k, v, initial_state, config, cu_seqlens, normalized)
    # No gradient wanted: skip autograd's bookkeeping, a sizeable part of a small call's time.
    return _launch(q, k, v, initial_state, config, cu_seqlens, normalized=normalized)[:2]


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        kind = type(eps).__qualname__
        kind = kind if type(eps).__module__ == "builtins" else f"{type(eps).__module__}.{kind}"
        raise TypeError(f"eps must be a Python float, got {kind}; convert it with float(eps)")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


#: Feature maps the normalised kernels apply to q and k as they load them.
FEATURE_MAPS = ("elu", "relu", "identity")


def _check_feature_map(feature_map):
    if not isinstance(feature_map, str) or feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS} (apply others to q and k first and pass "
                         f"'identity'), got {feature_map!r}")


def scan_normalized_attention(q, k, v, initial_state=None, *, eps=1e-6, config=None, cu_seqlens=None,
                              feature_map="identity"):
    """Normalised causal linear attention of features phi(q), phi(k):
    out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps), S_t = S_0 + sum_{s<=t} phi(k_s) v_s^T,
    z_t = z_0 + sum_{s<=t} phi(k_s), numerator and denominator accumulated in float32 in the same
    passes. feature_map, applied by the kernels as they load q and k (no pass of its own): "elu"
    (elu(x) + 1), "relu", or "identity" (the default: q, k are features already). eps (finite,
    >= 0) is added once, to phi(q_t)^T z_t. Shapes, dtypes, ``config`` and ``cu_seqlens`` as
    ``scan_causal_product``; initial_state: None or (B, H, D, E + 1) ((N, H, D, E + 1) packed),
    any floating dtype used as float32, S_0 then z_0 as the last column. Returns (out,
    final_state): out in the input dtype, final_state float32 in the initial state's layout.
    Differentiable in q, k, v and initial_state."""
    check_inputs(q, k, v, initial_state, cu_seqlens=cu_seqlens, normalized=True)
    _check_eps(eps)
    _check_feature_map(feature_map)
    if initial_state is not None:
        initial_state = initial_state.float()
    return _run_normalized_validated(q, k, v, initial_state, eps, config, cu_seqlens, feature_map)


def _run_normalized_validated(q, k, v, initial_state=None, eps=1e-6, config=None, cu_seqlens=None,
                              feature_map="identity"):
    """``scan_normalized_attention`` for inputs, eps and feature_map included, already checked."""
    if config is not None:
        check_config(config)
    q, k, v, initial_state = _resolved(q, k, v, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, initial_state)):
        return _ScanNormalizedAttention.apply(q, k, v, initial_state, float(eps), config, cu_seqlens, feature_map)
    return _launch(q, k, v, initial_state, config, cu_seqlens, eps=float(eps), feature_map=feature_map)[:2]
