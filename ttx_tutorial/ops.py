"""The causal product as a PyTorch operator, for ``torch.compile`` and CUDA graphs.

``torch.compile`` cannot trace the Triton wrappers: they query the device, pick launch
parameters in Python, and under fake tensors (the compiler's shape-only tensors) Triton's CPU
interpreter fails outright. Registered with ``torch.library`` as ``ttx_tutorial::causal_product``,
the product becomes one opaque node of the graph: the compiler learns its output shapes from
the fake implementation below, and runs the real kernels only on real tensors. A compiled model
then has no graph break around it, and ``mode="reduce-overhead"`` can capture it in a CUDA graph.

``ttx_tutorial.causal_product`` routes here by itself while ``torch.compile`` traces it; eager
calls keep calling the kernel wrappers directly (no dispatcher on the way).

The backward is a second operator, ``ttx_tutorial::causal_product_backward``. For "chunked"
and "recurrent" it runs the kernel file's backward on the saved inputs alone, as in eager mode.
The scan method's backward needs states its forward computed, and an operator can only hand
plain tensors from forward to backward, so for "scan" (or "auto" where it chooses scan) it
re-runs the forward kernel under autograd first: one forward pass more than in eager mode.

The normalised attention of ``causal_linear_attention`` ("chunked", or "auto") is a second pair,
``ttx_tutorial::normalized_causal_product`` and its backward, on features (the feature map is
applied before, in the graph). Its forward returns the (B, H, T) float32 denominator beside the
output and the (B, H, D, E + 1) state, so that the backward, the chunked kernel file's, reads
only saved tensors: no second forward, whichever method "auto" chose.

The generation step is a third, ``ttx_tutorial::linear_attention_step``: it updates the state
in place (declared as a mutated argument) and returns the token's output, with no autograd
(the step is inference only), so that a compiled decode loop holds it as one node.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .kernels import chunked, recurrent, step

#: Methods whose backward reads only q, k, v and S_0: their autograd Function's backward runs on
#: the inputs the operator saved, with no second forward pass.
_BACKWARD_FROM_INPUTS = {"chunked": chunked._ChunkedCausalProduct, "recurrent": recurrent._RecurrentCausalProduct}


def _run(q, k, v, initial_state, method, cu_seqlens=None, normalized=False):
    """The kernel wrapper's (o, final_state) for ``method`` ("auto" is resolved here, at run
    time: the device query behind it would break a traced graph). Packed sequences' offsets are
    checked here (once per tensor and version), on real values: the traced call could not read
    them. ``normalized``: the caller divides by the product of v's last column, a column of ones
    (the kernel files' ``_run_validated``)."""
    from ._validation import _check_offsets_once
    from .api import AUTO, choose_method, method_info  # api imports this module

    # An operator cannot tell whether a backward will follow: "auto" takes the forward's choice,
    # here and in the backward operator alike.
    info = method_info(choose_method(q, v, cu_seqlens, gradients=False) if method == AUTO else method)
    packed = {}
    if cu_seqlens is not None:
        _check_offsets_once(cu_seqlens, q.shape[2])
        packed = {"cu_seqlens": cu_seqlens}
    with _on_tensors_device(q):
        return info.function(q, k, v, initial_state, normalized=normalized, **packed)


def _on_tensors_device(x):
    """Launch on the tensors' GPU, not the current one (is_cuda and get_device() are plain
    attribute reads, where x.device builds an object per call)."""
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


@torch.library.custom_op("ttx_tutorial::causal_product", mutates_args=())
def _causal_product_op(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                       method: str, cu_seqlens: Optional[Tensor] = None, normalized: bool = False,
                       ) -> tuple[Tensor, Tensor]:
    with torch.no_grad():  # autograd is the operator's own (register_autograd below)
        o, final_state = _run(q, k, v, initial_state, method, cu_seqlens, normalized)
    # Contiguous, as the fake implementation promises whatever the inputs' strides: eager calls
    # lay o out as v, and under torch.compile the inputs' strides need not be the traced ones.
    o = o.contiguous()
    if initial_state is not None and final_state.data_ptr() == initial_state.data_ptr():
        final_state = final_state.clone()  # T = 0: an operator's outputs must not alias its inputs
    return o, final_state


@_causal_product_op.register_fake
def _(q, k, v, initial_state, method, cu_seqlens=None, normalized=False):
    B, H, T, D = q.shape
    E = v.shape[-1]
    n_states = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # packed: one state per sequence
    return q.new_empty((B, H, T, E), dtype=v.dtype), q.new_empty((n_states, H, D, E), dtype=torch.float32)


class _SavedInputs:
    """What an autograd Function's backward reads from its ctx, for calling it outside autograd."""

    def __init__(self, q, k, v, initial_state, cu_seqlens, normalized):
        self.saved_tensors = (q, k, v, initial_state, cu_seqlens)
        self.needs_input_grad = (True, True, True, initial_state is not None, False, False, False)
        self.config = None
        self.normalized = normalized


@torch.library.custom_op("ttx_tutorial::causal_product_backward", mutates_args=())
def _causal_product_backward_op(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                                grad_o: Tensor, grad_final_state: Optional[Tensor],
                                method: str, cu_seqlens: Optional[Tensor] = None, normalized: bool = False,
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from .api import AUTO, choose_method  # api imports this module

    B, H, _, D = q.shape
    E = v.shape[-1]
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    # "auto" chooses from the shapes and the device, so here as in the forward.
    function = _BACKWARD_FROM_INPUTS.get(choose_method(q, v, cu_seqlens, gradients=False) if method == AUTO
                                         else method)
    if function is not None:
        with torch.no_grad():  # a kernel call, recorded nowhere (the operator has no autograd of its own)
            found = function.backward(_SavedInputs(q, k, v, initial_state, cu_seqlens, normalized), grad_o,
                                      grad_final_state)
    else:
        found = _backward_by_rerunning_forward(q, k, v, initial_state, grad_o, grad_final_state, method,
                                               cu_seqlens, normalized)
    dq, dk, dv = (_laid_out_like(g, x) for g, x in zip(found, (q, k, v)))
    if initial_state is None:  # nothing to differentiate; the schema still returns a tensor, never read
        ds0 = q.new_empty((B, H, D, E), dtype=torch.float32)
    else:
        ds0 = _laid_out_like(found[3].float(), initial_state.float())
    return dq, dk, dv, ds0


def _backward_by_rerunning_forward(q, k, v, initial_state, grad_o, grad_final_state, method, cu_seqlens,
                                   normalized):
    """(dq, dk, dv, dS_0 or None) through autograd on a second forward call (see the module docstring)."""
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        if initial_state is not None:
            inputs.append(initial_state.detach().requires_grad_())
        o, final_state = _run(*inputs[:3], inputs[3] if initial_state is not None else None, method,
                              cu_seqlens, normalized)
        outputs, grads = [o], [grad_o]
        if grad_final_state is not None:
            outputs.append(final_state)
            grads.append(grad_final_state)
        found = torch.autograd.grad(outputs, inputs, grads)
    return (*found, None) if initial_state is None else found


def _laid_out_like(grad, x):
    """``grad`` with the strides of ``empty_like(x)``, as the fake implementation promises.

    Gradients laid out as their inputs keep the backward graph's later operators on the layout
    the compiler expects: with the kernels' contiguous gradients of transposed inputs (a layer's
    heads are views), ``elu_backward``'s fake strides disagree with its real ones (PyTorch 2.13)
    and a traced view fails. The copy costs only inputs that are not contiguous.
    """
    if grad.stride() == x.stride():  # a dense x keeps its strides in empty_like: nothing to allocate
        return grad
    like = torch.empty_like(x)
    return grad if grad.stride() == like.stride() else like.copy_(grad)


@_causal_product_backward_op.register_fake
def _(q, k, v, initial_state, grad_o, grad_final_state, method, cu_seqlens=None, normalized=False):
    B, H, _, D = q.shape
    E = v.shape[-1]
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    ds0 = (q.new_empty((B, H, D, E), dtype=torch.float32) if initial_state is None
           else torch.empty_like(initial_state, dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ds0


def _setup_context(ctx, inputs, output):
    q, k, v, initial_state, method, cu_seqlens, normalized = inputs
    ctx.set_materialize_grads(False)  # an unused S_T's gradient stays None: no zeros to fill and read
    ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
    ctx.method, ctx.normalized = method, normalized


def _backward(ctx, grad_o, grad_final_state):
    if torch.is_grad_enabled():  # create_graph=True: the backward operator has no derivative of its own
        raise RuntimeError(chunked.SECOND_ORDER_REFUSAL)
    q, k, v, initial_state, cu_seqlens = ctx.saved_tensors
    if grad_o is None:  # only the final state was used
        grad_o = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=v.dtype)
    dq, dk, dv, ds0 = _causal_product_backward_op(q, k, v, initial_state, grad_o, grad_final_state,
                                                  ctx.method, cu_seqlens, ctx.normalized)
    return dq, dk, dv, (ds0 if initial_state is not None else None), None, None, None


_causal_product_op.register_autograd(_backward, setup_context=_setup_context)

#: The registered operator, ``torch.ops.ttx_tutorial.causal_product.default``:
#: (q, k, v, initial_state or None, method, cu_seqlens or None, normalized) -> (o, final_state),
#: for a Triton method or "auto"; with cu_seqlens the states are one per packed sequence,
#: (N, H, D, E). normalized (False by default): v's last column is ones, by whose product the
#: caller divides (float32's products then stay 3xTF32, see the kernel files' float32_precision).
causal_product_op = torch.ops.ttx_tutorial.causal_product.default


def _run_normalized(q, k, v, initial_state, eps, method):
    """(out, final_state (B, H, D, E + 1), d + eps (B, H, T) float32) of the normalised attention
    of features q, k, for "chunked" or "auto" (resolved here, at run time, as in :func:`_run`).

    The chunked kernel computes the normaliser in its pass. Where "auto" chooses scan, the
    product runs on v with a column of ones appended, as ``causal_linear_attention`` does
    eagerly (float16 in float32: the denominator grows past float16's range), and its last
    column is the denominator."""
    from .api import AUTO, choose_method, method_info  # api imports this module

    chosen = choose_method(q, v, gradients=False) if method == AUTO else method
    if not method_info(chosen).is_triton:
        raise ValueError(f"method must be a Triton method or {AUTO!r} for the normalised operator, got {method!r}")
    if chosen == "chunked":
        with _on_tensors_device(q):
            return chunked._launch_normalized(*chunked._resolved(q, k, v, initial_state), eps, None)
    compute_dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
    q_c, k_c, v_c = (x.to(compute_dtype) for x in (q, k, v))
    with_ones = torch.cat([v_c, v_c.new_ones((*v.shape[:-1], 1))], dim=-1)
    o, final_state = _run(q_c, k_c, with_ones, initial_state, chosen, normalized=True)
    denominator = o[..., -1].float() + eps
    return (o[..., :-1] / (o[..., -1:] + eps)).to(v.dtype), final_state, denominator.contiguous()


@torch.library.custom_op("ttx_tutorial::normalized_causal_product", mutates_args=())
def _normalized_causal_product_op(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor], eps: float,
                                  method: str) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():  # autograd is the operator's own (register_autograd below)
        out, final_state, denominator = _run_normalized(q, k, v, initial_state, eps, method)
    return out.contiguous(), final_state, denominator  # as the fake promises (see causal_product)


@_normalized_causal_product_op.register_fake
def _(q, k, v, initial_state, eps, method):
    B, H, T, D = q.shape
    E = v.shape[-1]
    return (q.new_empty((B, H, T, E), dtype=v.dtype), q.new_empty((B, H, D, E + 1), dtype=torch.float32),
            q.new_empty((B, H, T), dtype=torch.float32))


class _SavedNormalizedInputs:
    """The ctx ``_ChunkedNormalizedAttention.backward`` reads, for calling it outside autograd."""

    def __init__(self, q, k, v, initial_state, o, denominator):
        self.saved_tensors = (q, k, v, initial_state, o, denominator)
        self.needs_input_grad = (True, True, True, initial_state is not None, False, False)
        self.config = None
        self.feature_map = "identity"  # the operator takes features: the graph maps them


@torch.library.custom_op("ttx_tutorial::normalized_causal_product_backward", mutates_args=())
def _normalized_causal_product_backward_op(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                                           o: Tensor, denominator: Tensor, grad_o: Tensor,
                                           grad_final_state: Optional[Tensor],
                                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # The chunked kernel file's backward reads only the inputs, the output and the denominator,
    # whichever method computed them: no second forward.
    with _on_tensors_device(q):
        with torch.no_grad():  # a kernel call, recorded nowhere (the operator has no autograd of its own)
            found = chunked._ChunkedNormalizedAttention.backward(
                _SavedNormalizedInputs(q, k, v, initial_state, o, denominator), grad_o, grad_final_state)
    dq, dk, dv = (_laid_out_like(g, x) for g, x in zip(found, (q, k, v)))
    if initial_state is None:  # nothing to differentiate; the schema still returns a tensor, never read
        B, H, _, D = q.shape
        ds0 = q.new_empty((B, H, D, v.shape[-1] + 1), dtype=torch.float32)
    else:
        ds0 = _laid_out_like(found[3].float(), initial_state.float())
    return dq, dk, dv, ds0


@_normalized_causal_product_backward_op.register_fake
def _(q, k, v, initial_state, o, denominator, grad_o, grad_final_state):
    B, H, _, D = q.shape
    ds0 = (q.new_empty((B, H, D, v.shape[-1] + 1), dtype=torch.float32) if initial_state is None
           else torch.empty_like(initial_state, dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ds0


def _normalized_setup_context(ctx, inputs, output):
    q, k, v, initial_state, _, _ = inputs
    o, _, denominator = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(denominator)  # saved for the backward, not a result to differentiate
    ctx.save_for_backward(q, k, v, initial_state, o, denominator)


def _normalized_backward(ctx, grad_o, grad_final_state, _):
    if torch.is_grad_enabled():  # create_graph=True: the backward operator has no derivative of its own
        raise RuntimeError(chunked.SECOND_ORDER_REFUSAL)
    q, k, v, initial_state, o, denominator = ctx.saved_tensors
    if grad_o is None:  # only the final state was used
        grad_o = torch.zeros_like(o)
    dq, dk, dv, ds0 = _normalized_causal_product_backward_op(q, k, v, initial_state, o, denominator, grad_o,
                                                             grad_final_state)
    return dq, dk, dv, (ds0 if initial_state is not None else None), None, None


_normalized_causal_product_op.register_autograd(_normalized_backward, setup_context=_normalized_setup_context)

#: ``torch.ops.ttx_tutorial.normalized_causal_product.default``: (q, k, v, initial_state or None,
#: eps, method) -> (out, final_state, denominator) for features q, k (the feature map applied):
#: out_t = q_t^T S_t / (q_t^T z_t + eps), the state (B, H, D, E + 1) float32 with z last, and the
#: (B, H, T) float32 denominator q_t^T z_t + eps (not differentiable) that the backward reads.
#: method: "chunked" or "auto"; the other Triton methods run the product with a ones column.
normalized_causal_product_op = torch.ops.ttx_tutorial.normalized_causal_product.default


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast gives ``x`` (None when autocast is off on its device or leaves it alone).

    PyTorch's attention under autocast computes in autocast's dtype whatever floating dtype its
    inputs have, float64 excepted; the causal product follows the same rule."""
    device_type = x.device.type
    if device_type == "meta":  # autocast has no state for it; the input checks name it
        return None
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@torch.library.custom_op("ttx_tutorial::linear_attention_step", mutates_args=("state",))
def _linear_attention_step_op(q: Tensor, k: Tensor, v: Tensor, state: Tensor, feature_map: str,
                              normalize: bool, eps: float) -> Tensor:
    with _on_tensors_device(q):
        return step.step_update(q, k, v, state, feature_map=feature_map, normalize=normalize, eps=eps)


@_linear_attention_step_op.register_fake
def _(q, k, v, state, feature_map, normalize, eps):
    return q.new_empty((*q.shape[:2], v.shape[-1]))


#: The registered step, ``torch.ops.ttx_tutorial.linear_attention_step.default``:
#: (q, k, v, state, feature_map, normalize, eps) -> o, with ``state`` updated in place.
linear_attention_step_op = torch.ops.ttx_tutorial.linear_attention_step.default
