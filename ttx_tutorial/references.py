"""The three PyTorch references of the causal dot product.

Algorithm 1 of "Transformers are RNNs" (Katharopoulos et al., 2020):

    S_t = S_{t-1} + k_t v_t^T          (S_0 = initial state, zeros by default)
    o_t = S_t^T q_t

Shapes: q, k: (B, H, T, D); v: (B, H, T, E); initial state and final state: (B, H, D, E).

Each reference returns ``(o, S_T)``. They accumulate in float32 (float64 for float64
inputs) and return ``o`` in the input dtype and the state in float32 (float64 for
float64 inputs). They are differentiable through ordinary torch autograd.

Non-finite values. ``loop`` and ``cumsum`` add token j's term only to the states S_t, t >= j,
so an inf or NaN in q, k or v at token j never reaches an earlier output, nor (with no gradient
flowing into the outputs from j on) the gradients of earlier k and v. ``quadratic`` masks its
scores by selection, which keeps a non-finite k_j out of earlier outputs; but its products
(scores @ V forward, the score gradient @ K backward) multiply the masked zeros by every row,
and 0 * inf is NaN: a non-finite v_j reaches the outputs, and a non-finite k_j the q-gradients,
of earlier tokens. In every form, a non-finite q_j poisons the k and v gradients of earlier
tokens even when o_j gets no gradient (0 * inf again), as in any autograd of q_j k_s^T.
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


def loop(q, k, v, initial_state=None):
    """The recurrence literally: one token per Python step. O(T) steps, O(D*E) state."""
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


def cumsum(q, k, v, initial_state=None):
    """Materialise every state S_t with a prefix sum: O(T*D*E) memory."""
    acc = accumulation_dtype(q.dtype)
    state0 = _start_state(q, v, initial_state, acc)
    outer = k.to(acc)[..., :, None] * v.to(acc)[..., None, :]          # (B, H, T, D, E)
    states = torch.cumsum(outer, dim=2) + state0[:, :, None]            # every S_t
    o = torch.einsum("bhtd,bhtde->bhte", q.to(acc), states)
    final = states[:, :, -1] if q.shape[2] > 0 else state0
    return o.to(q.dtype), final


def quadratic(q, k, v, initial_state=None):
    """The masked form ((Q K^T) * M) V + Q S_0: O(T^2) time and memory, like softmax attention."""
    acc = accumulation_dtype(q.dtype)
    state0 = _start_state(q, v, initial_state, acc)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    T = q.shape[2]
    scores = qa @ ka.transpose(-1, -2)                                   # (B, H, T, T)
    hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # j > t: not yet seen
    # Selected, not multiplied by a 0/1 mask: 0 * inf is NaN, and a non-finite k_j would reach
    # the outputs of tokens before j. (A non-finite v_j still does, through the product's 0 * inf:
    # see "Non-finite values" in the module docstring.)
    o = scores.masked_fill(hidden, 0.0) @ va + qa @ state0
    final = state0 + ka.transpose(-1, -2) @ va
    return o.to(q.dtype), final
