"""Causal linear attention as models use it: feature map, normaliser, projections, generation.

"Transformers are RNNs" (Katharopoulos et al., 2020) replace softmax(q.k) by phi(q).phi(k) for a
positive feature map phi, and normalise by the sum of the weights:

    out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)
    S_t = sum_{j<=t} phi(k_j) v_j^T      (D x E)        z_t = sum_{j<=t} phi(k_j)      (D)

eps enters once, added to the denominator phi(q_t)^T z_t after that has been computed, and
nowhere else: it only keeps a zero denominator (relu features of a query with no positive
entry) from dividing by zero.

The normaliser costs no pass of its own. The chunked kernel computes it (method "chunked",
and "auto" where it picks chunked): z_t is carried in float32 next to the state, the
denominator comes from the chunk's masked scores and z, the division happens before the
store, and the backward kernel takes the denominator's gradient in the same walks. The
recurrent kernels compute the normaliser in their walks (method "recurrent"), forward and
backward (two elementwise passes first make the backward's dO_t / (d_t + eps) and the
denominator's gradient).
The scan kernels compute it in their passes (method "scan", and "auto" where it picks scan):
z is summed beside each segment's state, scanned with it and carried through the outputs
pass, which forms the denominator from the chunk's masked scores and z and divides before
the store; the backward's suffix sums and its fused pass make dO_t / (d_t + eps) and the
denominator's gradient themselves (for float32 and wide heads, as chunked's: the plain passes
on dO / (d + eps), then the denominator's terms in one walk over the tokens each). Every kernel takes
features: for "elu" and "relu" the Triton methods map q and k in one launch of
``kernels/feature_map.py``, where PyTorch's ``F.elu(x) + 1`` makes two elementwise passes over
each. The chunked backward takes the map's derivative as it stores dq and dk (the features are
made outside autograd); the recurrent and scan ones are followed by the map's backward, one more
launch. Callables, the PyTorch references and traced graphs map with PyTorch. The scan kernel file can also map "elu" and "relu" as it loads q and k
(``scan_normalized_attention(feature_map=)``), but on an H200 that made its backward slower
than mapping beforehand (benchmarks/NOTES.md).
While ``torch.compile`` traces, "chunked" and "auto" are one operator, ``ttx_tutorial.ops``'s
normalised product, which runs the chunked kernels on features the graph maps; "recurrent"
and "scan" there take the ones column.
The other methods append a column of ones to v instead: the product then carries z_t as the
last column of its float32 state, and its last output column is phi(q_t)^T z_t. Either way the
state of the normalised attention is (B, H, D, E + 1) float32: S in the first E columns, z in
the last.

With the ones column, float16 inputs run the product in float32: phi(q_t)^T z_t grows like t
(about D * t for the default feature map), past float16's largest value 65504 for long
sequences, and the product's output has the input dtype. The chunked, recurrent and scan
kernels keep the denominator in float32 and store only the normalised output, so float16
stays float16 there.
bfloat16 shares float32's range and needs no such care.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from ._device import DEVICE
from ._validation import KERNEL_DTYPES, KERNEL_INDEX_LIMIT, check_inputs
from .api import AUTO, MAX_HEAD_DIM, METHODS, _checked_product, choose_method, method_info
from .kernels import chunked as _chunked
from .kernels import feature_map as _feature_map
from .kernels import recurrent as _recurrent
from .kernels import scan as _scan
from .kernels import step as _step


def _elu_plus_one(x):
    return F.elu(x) + 1


def _identity(x):
    return x


#: Named feature maps: "elu" (elu(x) + 1, the paper's, always positive), "relu" (non-negative,
#: zero for a whole query can leave only eps in the denominator), "identity" (signed: a
#: normalised identity map can divide by a denominator near zero; meant for normalize=False).
FEATURE_MAPS = {"elu": _elu_plus_one, "relu": F.relu, "identity": _identity}


def feature_map_function(feature_map):
    """The callable for a name of :data:`FEATURE_MAPS`, or ``feature_map`` itself if callable."""
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in FEATURE_MAPS:
        return FEATURE_MAPS[feature_map]
    raise ValueError(f"feature_map must be one of {tuple(FEATURE_MAPS)} or a callable, got {feature_map!r}")


#: The kernel files' own check of eps, one message everywhere.
_check_eps = _chunked._check_eps


def _compute_dtype(dtype, normalize):
    """The dtype the product runs in: float32 for float16 normalised by a ones column (module docstring)."""
    return torch.float32 if normalize and dtype == torch.float16 else dtype


#: The kernel files that compute the normaliser in their kernels, by method.
_NORMALIZING_KERNEL_FILES = {"chunked": _chunked, "recurrent": _recurrent, "scan": _scan}


def _normalizing_kernel(method, q, k, v, initial_state, cu_seqlens=None):
    """The kernel file whose kernels compute the normaliser, or None: "recurrent" and "scan" (not
    while torch.compile traces: there they keep the ones column of the product's operator),
    "chunked", or the kernel file of the method "auto" picks (while torch.compile traces, "auto"
    always: its operator chooses at run time). Checks the inputs (as the kernel file does, with
    the normalised state's (B, H, D, E + 1) layout) before "auto" looks at them. Packed sequences
    (``cu_seqlens``) have their normaliser in recurrent's and scan's kernels only: "chunked", and
    "auto" where it picks chunked, then take the ones column of the product."""
    if method in ("recurrent", "scan") and not torch.compiler.is_compiling():
        _NORMALIZING_KERNEL_FILES[method].check_inputs(q, k, v, initial_state, method, cu_seqlens=cu_seqlens,
                                                       normalized=True)
        return _NORMALIZING_KERNEL_FILES[method]
    if method not in ("chunked", AUTO):
        return None
    if cu_seqlens is not None:
        wide = v.shape[-1] + 1 > MAX_HEAD_DIM  # a ones column would not fit beside v
        if method == "chunked" or torch.compiler.is_compiling():
            if wide:
                raise ValueError(
                    f"packed sequences: method {method!r} normalises them through a column of ones appended "
                    f"to v, so E + 1 <= {MAX_HEAD_DIM}; E = {v.shape[-1]} runs with 'recurrent' or 'scan'"
                    + (" (eagerly: under torch.compile they take the ones column too)"
                       if torch.compiler.is_compiling() else ""))
            return None
        _scan.check_inputs(q, k, v, initial_state, method, cu_seqlens=cu_seqlens, normalized=True)
        choice = choose_method(q, v, cu_seqlens)
        if choice == "chunked" and wide:  # the kernels that normalise packed sequences themselves
            choice = "scan"
        return None if choice == "chunked" else _NORMALIZING_KERNEL_FILES[choice]
    if torch.compiler.is_compiling():
        # The API's checks, which the compiler can trace (the kernel file asks Triton's settings
        # for the device). The state's last column, z, was checked by the caller: the rest is S's.
        check_inputs(q, k, v, None if initial_state is None else initial_state[..., :-1], method=method,
                     dtypes=KERNEL_DTYPES, max_head_dim=_chunked.MAX_HEAD_DIM, expected_device=DEVICE.type,
                     index_limit=KERNEL_INDEX_LIMIT)
        return _chunked
    _chunked.check_inputs(q, k, v, initial_state, method, normalized=True)
    return _NORMALIZING_KERNEL_FILES[method if method == "chunked" else choose_method(q, v, normalized=True)]


def _mapped(feature, x, name):
    """feature(x), which the kernel reads as it reads x: same shape, same dtype."""
    phi = feature(x)
    if not isinstance(phi, torch.Tensor) or phi.shape != x.shape or phi.dtype != x.dtype:
        got = (f"{phi.dtype} {tuple(phi.shape)}" if isinstance(phi, torch.Tensor) else type(phi).__name__)
        raise ValueError(f"feature_map must keep the shape and dtype of {name} ({x.dtype} {tuple(x.shape)}), "
                         f"got {got}")
    return phi


def _maps_in_a_kernel(feature_map, q, k):
    """Whether ``kernels/feature_map.py`` maps q and k: a named map it has, tensors it takes, and
    not while torch.compile traces (the compiler fuses PyTorch's map itself)."""
    return (type(feature_map) is str and feature_map in _feature_map.FEATURE_MAPS
            and q.dim() == 4 and q.shape == k.shape and 1 <= q.shape[-1] <= _feature_map.MAX_HEAD_DIM
            and q.dtype in KERNEL_DTYPES and q.dtype == k.dtype
            and q.device.type == DEVICE.type and q.device == k.device and not torch.compiler.is_compiling())


def _features(feature_map, feature, q, k):
    """(phi(q), phi(k)) for the kernels: a named map in one launch of ``kernels/feature_map.py``
    each way, where q and k can take it; PyTorch's operations otherwise (a callable, float64,
    another device, and while torch.compile traces)."""
    if _maps_in_a_kernel(feature_map, q, k):
        with _on_tensors_device(q):
            return _feature_map._run_validated(q, k, feature_map)
    return _mapped(feature, q, "q"), _mapped(feature, k, "k")


def _is_kernel_method(method):
    return method == AUTO or (isinstance(method, str) and method in METHODS and method_info(method).is_triton)


def _on_tensors_device(x):
    """Launch on the tensors' GPU, not the current one."""
    if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


_STEP_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_ON_CUDA = DEVICE.type == "cuda"


#: A feature map by name ("elu", "relu", "identity") or a function applied to q and k.
FeatureMap = str | Callable[[torch.Tensor], torch.Tensor]


def causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: FeatureMap = "elu",
                            normalize: bool = True, eps: float = 1e-6, method: str = AUTO,
                            initial_state: torch.Tensor | None = None, return_state: bool = False,
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal linear attention: out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps).

    Args:
        q, k: (B, H, T, D); v: (B, H, T, E); one dtype, one device (as ``causal_product``).
        feature_map: "elu" (elu + 1, the default), "relu", "identity", or a callable applied
            to q and k elementwise (it must keep their shape).
        normalize: divide by phi(q_t)^T z_t + eps (the default); False returns the plain
            causal product of phi(q), phi(k) and v, and eps is unused.
        eps: added to the denominator, >= 0 (see the module docstring).
        method: any method of :data:`ttx_tutorial.METHODS`, or "auto". "chunked", "recurrent"
            and "scan" (and "auto", which picks one of them) normalise inside the kernels;
            the others append a column of ones to v (see the module docstring).
        initial_state: the state after earlier tokens, float32: (B, H, D, E + 1) when
            normalising (S, then z as the last column), (B, H, D, E) otherwise; None for zeros.
        return_state: also return the state after the last token, in the same layout.
        cu_seqlens: optional (N + 1,) offsets of N sequences packed along T of a batch of one,
            as for ``causal_product``: the states are then one per sequence, (N, H, D, E + 1).
            "recurrent" and "scan" normalise packed sequences inside their kernels; the other
            methods (and "auto" where it picks "chunked") append the column of ones.

    Returns:
        out (B, H, T, E) in the dtype of the inputs (autocast's dtype under autocast), or
        ``(out, state)`` with ``return_state``.
    """
    feature = feature_map_function(feature_map)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be True or False, got {return_state!r}")
    _check_eps(eps)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if v.dim() != 4 or q.dim() != 4:
        name, x = ("v", v) if v.dim() != 4 else ("q", q)
        raise ValueError(f"{name} must have 4 dimensions (B, H, T, {'E' if name == 'v' else 'D'}), "
                         f"got shape {tuple(x.shape)}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if normalize and isinstance(initial_state, torch.Tensor):
        packed = cu_seqlens is not None and cu_seqlens.dim() == 1
        expected = (cu_seqlens.shape[0] - 1 if packed else q.shape[0], q.shape[1], q.shape[-1], v.shape[-1] + 1)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must have shape ({'N sequences' if packed else 'B'}, H, D, E + 1), "
                             f"z as the last column, = {expected}, got {tuple(initial_state.shape)}")
    if not _is_kernel_method(method):
        # The references map q and k with PyTorch before causal_product checks them: checked
        # here first, so that a dtype or device they cannot take is named, not failed inside the map.
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, one of {METHODS} or {AUTO!r}; got {type(method).__name__}")
        info = method_info(method)
        state_s = initial_state[..., :-1] if normalize and isinstance(initial_state, torch.Tensor) else initial_state
        check_inputs(q, k, v, state_s, method=method, dtypes=info.dtypes, max_head_dim=info.max_head_dim,
                     expected_device=None, cu_seqlens=cu_seqlens)
    elif normalize and torch.compiler.is_compiling() and method in ("recurrent", "scan") \
            and v.shape[-1] + 1 > MAX_HEAD_DIM:
        raise ValueError(
            f"under torch.compile, method {method!r} normalises through a column of ones appended to v, "
            f"so E + 1 <= {MAX_HEAD_DIM}: E = {v.shape[-1]} runs eagerly, or compiled with 'chunked' or 'auto'")

    cast = ops.autocast_dtype(q)
    out_dtype = q.dtype if cast is None else cast
    # Off for the product: it would cast float32 back to autocast's float16 (module docstring).
    no_autocast = torch.autocast(q.device.type, enabled=False) if cast is not None else contextlib.nullcontext()
    kernel_file = _normalizing_kernel(method, q, k, v, initial_state, cu_seqlens) if normalize else None
    if kernel_file is not None:
        q, k, v = q.to(out_dtype), k.to(out_dtype), v.to(out_dtype)
        if initial_state is not None:
            initial_state = initial_state.float()
        with no_autocast:
            if kernel_file is _chunked and _maps_in_a_kernel(feature_map, q, k):
                # The chunked backward takes the map's derivative as it stores dq and dk: the
                # features are made outside autograd, and the gradients go to q and k themselves.
                with _on_tensors_device(q):
                    with torch.no_grad():
                        phi_q, phi_k = _feature_map._run_validated(q, k, feature_map)
                    out, state = _chunked._run_normalized_validated(q, k, v, initial_state, eps,
                                                                    features=(feature_map, phi_q, phi_k))
                return (out, state) if return_state else out
            phi_q, phi_k = _features(feature_map, feature, q, k)
            if torch.compiler.is_compiling():  # one graph node, see ttx_tutorial.ops
                out, state, _ = ops.normalized_causal_product_op(phi_q, phi_k, v, initial_state, float(eps), method)
            else:
                packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
                with _on_tensors_device(q):
                    out, state = kernel_file._run_normalized_validated(phi_q, phi_k, v, initial_state, eps, **packed)
        return (out, state) if return_state else out

    compute_dtype = _compute_dtype(out_dtype, normalize)
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    with no_autocast:
        if _is_kernel_method(method):
            phi_q, phi_k = _features(feature_map, feature, q, k)
        else:  # the PyTorch references keep PyTorch's map: the kernels are checked against them
            phi_q, phi_k = _mapped(feature, q, "q"), _mapped(feature, k, "k")
        if normalize:
            ones = v.new_ones((*v.shape[:-1], 1))
            v = torch.cat([v, ones], dim=-1)  # the product's last column is phi(q_t)^T z_t
        # normalized: the kernels keep float32's products at 3xTF32 for a product divided by its
        # last column (the kernel files' float32_precision).
        o, state = _checked_product(phi_q, phi_k, v, method, cu_seqlens, initial_state, normalized=normalize)
        if normalize:
            o = o[..., :-1] / (o[..., -1:] + eps)
    out = o.to(out_dtype)
    return (out, state) if return_state else out


def _check_step_inputs(q, k, v, state, normalize):
    """The PyTorch path's checks, as the step kernel's (whose dtypes and device it does not need)."""
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("state", state)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be (B, H, D) of one shape and v (B, H, E) with the same B, H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    expected = (*q.shape, v.shape[-1] + normalize)
    if tuple(state.shape) != expected or state.dtype != torch.float32 or state.device != q.device:
        layout = "(B, H, D, E + 1) with z as its last column" if normalize else "(B, H, D, E)"
        raise ValueError(f"state must be float32 {layout} = {expected} on {q.device}, got {state.dtype} "
                         f"{tuple(state.shape)} on {state.device}")


def _takes_step_kernel(q, v) -> bool:
    """Whether the step kernel runs this step: its dtypes, on its device, heads up to its widest.
    Anything but tensors of at least one dimension goes to its checks too, which name it."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() and v.dim()):
        return True
    return (q.dtype in _STEP_KERNEL_DTYPES and q.is_cuda is _KERNEL_ON_CUDA
            and max(q.shape[-1], v.shape[-1]) <= _step.MAX_HEAD_DIM)


def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, *,
                          feature_map: FeatureMap = "elu", normalize: bool = True, eps: float = 1e-6,
                          ) -> torch.Tensor:
    """One token of causal linear attention, O(1) in the sequence length; updates ``state`` in place.

    q, k: (B, H, D); v: (B, H, E); state: (B, H, D, E + 1) float32 when normalising ((S, z), as
    :func:`causal_linear_attention` returns it), (B, H, D, E) otherwise, contiguous. Adds
    phi(k) [v, 1]^T to the state, then returns phi(q)^T S / (phi(q)^T z + eps) as (B, H, E) in
    the dtype of q. Inference only: a RuntimeError when autograd would need a gradient (train
    with :func:`causal_linear_attention`).

    One launch of ``ttx_tutorial.kernels.step`` (the interpreter in CPU mode) for float32,
    float16 and bfloat16 tensors on the kernels' device with D and E up to 256; named feature
    maps are computed in the kernel, a callable one by PyTorch first. Other dtypes (float64),
    wider heads and tensors on another device take a PyTorch path of a few operations. Either
    way no host synchronisation and a fixed memory footprint: a CUDA graph can capture it. While
    torch.compile traces, the kernel path is the operator
    ``torch.ops.ttx_tutorial.linear_attention_step`` (``ttx_tutorial.ops``).
    """
    if _takes_step_kernel(q, v):
        if type(feature_map) is not str:  # a callable: mapped here, the kernel takes them as they are
            feature = feature_map_function(feature_map)
            q, k, feature_map = feature(q), feature(k), "identity"
        if torch.compiler.is_compiling():  # one graph node, see ttx_tutorial.ops; checked as it runs
            _step._check_no_gradient(q, k, v, state)
            return ops.linear_attention_step_op(q, k, v, state, feature_map, normalize, eps)
        return _step.step_update(q, k, v, state, feature_map=feature_map, normalize=normalize, eps=eps)
    # The PyTorch path: the same update and product, in float32 like the state.
    _check_step_inputs(q, k, v, state, normalize)
    _step._check_no_gradient(q, k, v, state)
    _check_eps(eps)
    feature = feature_map_function(feature_map)
    phi_q, phi_k = feature(q).float(), feature(k).float()
    v = v.float()
    if normalize:
        S, z = state[..., :-1], state[..., -1]
        S.add_(phi_k.unsqueeze(-1) * v.unsqueeze(-2))
        z.add_(phi_k)
        numerator = torch.einsum("bhd,bhde->bhe", phi_q, S)
        out = numerator / ((phi_q * z).sum(-1, keepdim=True) + eps)
    else:
        state.add_(phi_k.unsqueeze(-1) * v.unsqueeze(-2))
        out = torch.einsum("bhd,bhde->bhe", phi_q, state)
    return out.to(q.dtype)


class CausalLinearAttention(nn.Module):
    """Causal self-attention with linear attention inside: (batch, seq, dim) in and out.

    Projects x to q, k, v of ``heads`` heads of ``head_dim`` (dim // heads by default), runs
    :func:`causal_linear_attention` and projects back. Use it where a causal self-attention
    block goes.

    Generation: ``forward(prompt, return_state=True)`` processes a prompt in parallel (prefill)
    and returns the state (B, H, head_dim, head_dim + 1) float32 next to the output; then
    ``step(x_t, state)`` takes one token (B, dim), updates the state in place and returns the
    token's output (B, dim), in time and memory independent of how many tokens came before
    (:func:`linear_attention_step`: one kernel launch; inference only, so generate under
    ``torch.no_grad()``). ``initial_state(batch)`` gives the empty state to start from without
    a prompt.
    """

    def __init__(self, dim: int, heads: int, *, head_dim: int | None = None, feature_map: FeatureMap = "elu",
                 eps: float = 1e-6, method: str = AUTO, bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or give head_dim")
            head_dim = dim // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        feature_map_function(feature_map)
        _check_eps(eps)
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, one of {METHODS} or {AUTO!r}; got {type(method).__name__}")
        if method != AUTO:
            method_info(method)  # names an unknown method now, not at the first forward
        if _is_kernel_method(method) and head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM} for method {method!r}, got {head_dim}")
        self.heads, self.head_dim = heads, head_dim
        self.feature_map, self.eps, self.method = feature_map, eps, method
        inner = heads * head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(dim, inner, bias=bias, **factory)
        self.k_proj = nn.Linear(dim, inner, bias=bias, **factory)
        self.v_proj = nn.Linear(dim, inner, bias=bias, **factory)
        self.out_proj = nn.Linear(inner, dim, bias=bias, **factory)

    def _heads(self, x):
        """(B, T, heads * head_dim) -> (B, heads, T, head_dim), a view."""
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, *, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, dim) -> (B, T, dim); ``state`` continues from earlier tokens (see class).
        ``cu_seqlens``: N sequences packed along T of a batch of one, x (1, total_T, dim), as
        :func:`causal_linear_attention` takes them; the states are then (N, heads, d, d + 1)."""
        if not isinstance(return_state, bool):
            raise TypeError(f"return_state must be True or False, got {return_state!r}")
        if x.dim() != 3:
            raise ValueError(f"x must have 3 dimensions (batch, seq, dim), got shape {tuple(x.shape)}")
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        o, state = causal_linear_attention(q, k, v, feature_map=self.feature_map, eps=self.eps,
                                           method=self.method, initial_state=state, return_state=True,
                                           cu_seqlens=cu_seqlens)
        y = self.out_proj(o.transpose(1, 2).flatten(2))
        return (y, state) if return_state else y

    def initial_state(self, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The state before any token: zeros (batch, heads, head_dim, head_dim + 1) float32."""
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError(f"batch must be an int, the number of sequences, got {type(batch).__name__}")
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        device = self.q_proj.weight.device if device is None else device
        return torch.zeros(batch, self.heads, self.head_dim, self.head_dim + 1, dtype=torch.float32,
                           device=device)

    def step(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One token x (B, dim) -> its output (B, dim); ``state`` is updated in place. Inference
        only: under autograd the weights require grad and :func:`linear_attention_step` refuses."""
        if x.dim() != 2:
            raise ValueError(f"x must have 2 dimensions (batch, dim) for one token, got shape {tuple(x.shape)}")
        expected = (x.shape[0], self.heads, self.head_dim, self.head_dim + 1)
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor {expected} float32 (forward(..., return_state=True) "
                            f"or initial_state(batch) makes one), got {type(state).__name__}")
        if tuple(state.shape) != expected or state.dtype != torch.float32:
            raise ValueError(f"state must be float32 of shape {expected}, got {state.dtype} {tuple(state.shape)}")
        shape = (x.shape[0], self.heads, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        o = linear_attention_step(q, k, v, state, feature_map=self.feature_map, eps=self.eps)
        return self.out_proj(o.flatten(1))
