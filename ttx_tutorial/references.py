"""The three PyTorch references of the causal dot product.

Algorithm 1 of "Transformers are RNNs" (Katharopoulos et al., 2020):

    S_t = S_{t-1} + k_t v_t^T          (S_0 = initial state, zeros by default)
    o_t = S_t^T q_t

Shapes: q, k: (B, H, T, D); v: (B, H, T, E); initial state and final state: (B, H, D, E).
With ``cu_seqlens`` (the (N + 1,) offsets of N sequences packed along T of a batch of one), each
reference runs once per sequence, from that sequence's row of the (N, H, D, E) initial state.

Each reference returns ``(o, S_T)``. They accumulate in float32 (float64 for float64
inputs) and return ``o`` in the input dtype and the state in float32 (float64 for
float64 inputs). They are differentiable through ordinary torch autograd.

Non-finite values. ``loop`` and ``cumsum`` add token j's term only to the states S_t, t >= j,
so an inf or NaN in q, k or v at token j never reaches an earlier output, nor (with no gradient
flowing into the outputs from j on) the gradients of earlier k and v. ``quadratic`` masks its
scores by selection, which keeps a non-finite k_j out of earlier outputs, and its masked
products never multiply a masked zero by a non-finite row (``_masked_product``), so a
non-finite v_j stays out of earlier outputs and a non-finite k_j out of earlier q-gradients
too; the outputs it reaches become NaN. In every form, a non-finite q_j poisons the k and v
gradients of earlier tokens even when o_j gets no gradient (0 * inf), as in any autograd of
q_j k_s^T.
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _start_state(q, v, initial_state, acc):
    B, H, _, D = q.shape
    E = v.shape[-1]
    if initial_state is None:
        return torch.zeros(B, H, D, E, dtype=acc, device=q.device)
    # A copy, so that the returned state never aliases the caller's tensor (T = 0).
    return initial_state.to(acc, copy=True)


def _per_sequence(reference, q, k, v, initial_state, cu_seqlens):
    """``reference`` on each packed sequence [cu_seqlens[n], cu_seqlens[n + 1]) alone:
    o concatenated along T, the final states stacked as (N, H, D, E)."""
    offsets = cu_seqlens.tolist()
    outputs, states = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        o, state = reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                             None if initial_state is None else initial_state[n:n + 1])
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, dim=2), torch.cat(states, dim=0)


def loop(q, k, v, initial_state=None, cu_seqlens=None):
    """The recurrence literally: one token per Python step. O(T) steps, O(D*E) state."""
    if cu_seqlens is not None:
        return _per_sequence(loop, q, k, v, initial_state, cu_seqlens)
    acc = accumulation_dtype(q.dtype)
    state = _start_state(q, v, initial_state, acc)
    outputs = []
    for t in range(q.shape[2]):
        k_t, v_t, q_t = k[:, :, t].to(acc), v[:, :, t].to(acc), q[:, :, t].to(acc)
        state = state + k_t[..., :, None] * v_t[..., None, :]      # S_t = S_{t-1} + k_t v_t^T
        outputs.append(torch.einsum("bhd,bhde->bhe", q_t, state))  # o_t = S_t^T q_t
    if outputs:
        o = torch.stack(outputs, dim=2)
    else:  # T = 0: an empty product that still belongs to the autograd graph
        o = torch.einsum("bhtd,bhde->bhte", q.to(acc), state)
    return o.to(q.dtype), state


def cumsum(q, k, v, initial_state=None, cu_seqlens=None):
    """Materialise every state S_t with a prefix sum: O(T*D*E) memory."""
    if cu_seqlens is not None:
        return _per_sequence(cumsum, q, k, v, initial_state, cu_seqlens)
    acc = accumulation_dtype(q.dtype)
    state0 = _start_state(q, v, initial_state, acc)
    outer = k.to(acc)[..., :, None] * v.to(acc)[..., None, :]          # (B, H, T, D, E)
    states = torch.cumsum(outer, dim=2) + state0[:, :, None]            # every S_t
    o = torch.einsum("bhtd,bhtde->bhte", q.to(acc), states)
    final = states[:, :, -1] if q.shape[2] > 0 else state0
    return o.to(q.dtype), final


def _seen_product(scores, right, *, reverse):
    """scores @ right for scores masked by selection, in which row t sees the rows j <= t (j >= t
    when ``reverse``). The masked zeros would still multiply every row of ``right``, and 0 * inf
    is NaN: so right's non-finite entries enter the product as 0, and every output that sees one
    is set to NaN."""
    finite = torch.isfinite(right)
    product = scores @ torch.where(finite, right, 0)
    non_finite = (~finite).to(torch.int32)
    if reverse:
        seen = non_finite.flip(-2).cumsum(-2).flip(-2) > 0
    else:
        seen = non_finite.cumsum(-2) > 0
    return torch.where(seen, torch.nan, product)


class _CausalScores(torch.autograd.Function):
    """``(q @ k^T)`` with the entries j > t selected away, forwards and backwards without 0 * inf."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        T = q.shape[-2]
        hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # j > t: not yet seen
        ctx.hidden = hidden
        # Selected, not multiplied by a 0/1 mask: 0 * inf is NaN, and a non-finite k_j would
        # reach the outputs of tokens before j.
        return (q @ k.transpose(-1, -2)).masked_fill(hidden, 0.0)

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        grad = grad.masked_fill(ctx.hidden, 0.0)
        # dq = grad @ k (row t sees k_j, j <= t); dk = grad^T @ q (row j sees q_t, t >= j).
        return (_seen_product(grad, k, reverse=False),
                _seen_product(grad.transpose(-1, -2), q, reverse=True))


class _MaskedProduct(torch.autograd.Function):
    """``scores @ right`` for lower-triangular scores, forwards and backwards without 0 * inf."""

    @staticmethod
    def forward(ctx, scores, right):
        ctx.save_for_backward(scores, right)
        return _seen_product(scores, right, reverse=False)

    @staticmethod
    def backward(ctx, grad):
        scores, right = ctx.saved_tensors
        # d scores = grad @ right^T pairs each output with each row; the caller's mask selects.
        # d right = scores^T @ grad, whose scores^T is upper-triangular: row j sees rows t >= j.
        return grad @ right.transpose(-1, -2), _seen_product(scores.transpose(-1, -2), grad, reverse=True)


def quadratic(q, k, v, initial_state=None, cu_seqlens=None):
    """The masked form ((Q K^T) * M) V + Q S_0: O(T^2) time and memory, like softmax attention."""
    if cu_seqlens is not None:
        return _per_sequence(quadratic, q, k, v, initial_state, cu_seqlens)
    acc = accumulation_dtype(q.dtype)
    state0 = _start_state(q, v, initial_state, acc)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    scores = _CausalScores.apply(qa, ka)                                  # (B, H, T, T), masked
    o = _MaskedProduct.apply(scores, va) + qa @ state0
    final = state0 + ka.transpose(-1, -2) @ va
    return o.to(q.dtype), final
