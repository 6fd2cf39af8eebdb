"""Context parallelism: one causal product over a sequence split across the ranks of a process group.

Each rank of a ``torch.distributed`` process group holds a contiguous slice of the sequence,
rank order being sequence order: rank r holds tokens [t_r, t_{r+1}), slices of any length,
empty ones included. The state before rank r's first token is

    P_r = S_0 + sum_{j<r} L_j        with    L_j = K_j^T V_j = sum_{t in slice j} k_t v_t^T,

so a rank needs from the others only their (D x E) states L_j, never their tokens. Each rank
computes its own L_r in float32 with batched matmuls over chunks of its tokens (no causal
product: the order of the tokens inside a slice does not matter to their sum), the ranks
exchange these states, every rank sums the ones before it into P_r, and runs the ordinary
single-device :func:`ttx_tutorial.causal_product` on its slice from P_r. The state after the whole sequence,
S_T = S_0 + sum_j L_j, comes out of the same exchange on every rank.

Backward mirrors it. L_j reaches P_r of every later rank r > j and S_T of every rank, so its
gradient is the suffix sum over later ranks of dP_r (each rank's local backward gives its
dP_r as the gradient of its product's initial state) plus the sum over all ranks of dS_T:
one more exchange of (D x E) tensors, then local sums. The local backward does the rest.

Why an all_gather of the states rather than a ring that passes the running prefix from rank
to rank: both cost P - 1 steps of one state on the critical path, but the all_gather is a
single collective that NCCL and gloo implement well and that cannot deadlock on the order of
point-to-point calls; it gives every rank S_T without a further broadcast, and its mirror in
the backward is again one all_gather. Its price: each rank sends (P - 1) * B*H*D*E float32
values per exchange (a ring would send B*H*D*E), independent of T and tiny next to the
slice's own activations for the few ranks one node holds (128 KiB a rank at B*H = 8,
D = E = 64 on two GPUs). :func:`communication_bytes` gives the formula and
:func:`count_communication` measures it.

Every rank calls :func:`causal_product` with the same B, H, D, E, dtype and ``return_state``.
When gradients flow into k, v or the initial state on any rank, every rank's output requires a
gradient (the start of a slice depends on the earlier ones) and every rank runs the backward
through it: the exchanges are collectives. Before the first exchange the ranks compare those
properties (one small all_gather), so that a mismatch, or bad input on any rank, raises the
same error on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _device, api
from ._validation import KERNEL_DTYPES, KERNEL_INDEX_LIMIT, REFERENCE_DTYPES, check_inputs

__all__ = ["Traffic", "causal_product", "communication_bytes", "count_communication"]

#: Dtype codes exchanged between ranks to compare the inputs' dtypes (position in this tuple).
_DTYPE_CODES = REFERENCE_DTYPES
#: What each rank tells the others before the first exchange, in this order (int64 values).
_SUMMARY_FIELDS = ("B", "H", "D", "E", "dtype", "return_state", "grad_enabled", "needs_backward", "refused")


@dataclass
class Traffic:
    """What this rank sent through :func:`causal_product`'s collectives while counting."""

    bytes_sent: int = 0
    collectives: int = 0


_open_counts: list[Traffic] = []


@contextlib.contextmanager
def count_communication():
    """Within the block, count what this rank sends in :func:`causal_product`'s collectives,
    forward and backward. Yields a :class:`Traffic`.

    An all_gather of n bytes a rank counts (P - 1) * n sent: every other rank must receive those
    n bytes, as NCCL's and gloo's ring algorithms send them.
    """
    traffic = Traffic()
    _open_counts.append(traffic)
    try:
        yield traffic
    finally:
        _open_counts.remove(traffic)


def communication_bytes(B: int, H: int, D: int, E: int, world_size: int, *, dtype=torch.float32,
                        return_state: bool = False, backward: bool = False,
                        check_ranks: bool = True) -> int:
    """Bytes each rank sends in one :func:`causal_product` call (forward, plus its backward with
    ``backward=True``: a backward that reaches k, v or the initial state).

    The forward exchanges one (B, H, D, E) state a rank (float32; float64 for float64 inputs),
    preceded with ``check_ranks`` by a summary of 9 int64 values; the backward exchanges the
    gradient of the state before each slice, and with ``return_state`` that of the final state
    too. Each all_gather of n bytes a rank sends (P - 1) * n. Independent of T.
    """
    others = world_size - 1
    state = B * H * D * E * (8 if dtype == torch.float64 else 4)
    sent = others * state
    if check_ranks:
        sent += others * len(_SUMMARY_FIELDS) * 8
    if backward:
        sent += others * state * (2 if return_state else 1)
    return sent


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """(P, *tensor.shape): every rank's ``tensor``, in rank order."""
    tensor = tensor.contiguous()  # collectives send contiguous buffers
    world_size = dist.get_world_size(group)
    gathered = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    # The list form: every backend implements it, on every torch version this package supports.
    dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
    for traffic in _open_counts:
        traffic.bytes_sent += (world_size - 1) * tensor.numel() * tensor.element_size()
        traffic.collectives += 1
    return gathered


#: Elements of k or v taken at a time to sum a slice's state: float32 copies stay near 64 MB.
_UPCAST_ELEMENTS = 2**24


def _token_chunks(k, v):
    B, H, T, D = k.shape
    step = max(1, _UPCAST_ELEMENTS // (B * H * max(D, v.shape[-1], 1)))
    return [slice(start, start + step) for start in range(0, T, step)]


@functools.lru_cache(maxsize=None)  # a probe: asked once per device and dtype
def _tensor_cores_accumulate_to_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` takes 16-bit operands here (CUDA, in
    the PyTorch versions that offer it)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        probe = torch.ones(1, 1, 1, dtype=dtype, device=device)
        return torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _product_in(a, b, dtype):
    """a @ b over the last two dimensions, in ``dtype``. 16-bit operands go to the tensor cores
    with float32 accumulation where PyTorch offers it: their products are exact in float32, so
    the result is what the upcast operands give, without float32 copies or float32 arithmetic."""
    if dtype == torch.float32 and _tensor_cores_accumulate_to_float32(a.device, a.dtype):
        product = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=dtype)
        return product.view(*a.shape[:-2], a.shape[-2], b.shape[-1])
    return a.to(dtype) @ b.to(dtype)


class _SliceState(torch.autograd.Function):
    """L = K^T V = sum_t k_t v_t^T over this rank's slice, in ``state_dtype``, a chunk of tokens at
    a time: k and v are saved as they are, and any upcast copies stay small (a long slice is
    what context parallelism is for)."""

    @staticmethod
    def forward(ctx, k, v, state_dtype):
        ctx.save_for_backward(k, v)
        ctx.state_dtype = state_dtype
        B, H, _, D = k.shape
        state = torch.zeros(B, H, D, v.shape[-1], dtype=state_dtype, device=k.device)
        for part in _token_chunks(k, v):
            state += _product_in(k[:, :, part].transpose(-2, -1), v[:, :, part], state_dtype)
        return state

    @staticmethod
    def backward(ctx, grad_state):
        # PyTorch operations only: with create_graph=True autograd records them, second order included.
        k, v = ctx.saved_tensors
        # dk_t = G v_t and dv_t = G^T k_t, G the state's gradient. bfloat16 inputs take G in
        # bfloat16 (float32's range; the gradients are bfloat16 anyway); float16's range could
        # not hold G, a sum over every later token, so float16 and float32 compute in float32.
        if k.dtype == torch.bfloat16:
            grad_state, compute_dtype = grad_state.to(torch.bfloat16), torch.bfloat16
        else:
            compute_dtype = ctx.state_dtype
        grad_k = torch.empty_like(k) if ctx.needs_input_grad[0] else None
        grad_v = torch.empty_like(v) if ctx.needs_input_grad[1] else None
        for part in _token_chunks(k, v):
            if grad_k is not None:
                grad_k[:, :, part] = v[:, :, part].to(compute_dtype) @ grad_state.transpose(-2, -1)
            if grad_v is not None:
                grad_v[:, :, part] = k[:, :, part].to(compute_dtype) @ grad_state
        return grad_k, grad_v, None


class _StatesAcrossRanks(torch.autograd.Function):
    """This rank's contribution to the state in; the sum of the earlier ranks' contributions
    out, and with ``with_total`` the sum of all of them."""

    @staticmethod
    def forward(ctx, own, group, with_total):
        ctx.group, ctx.with_total = group, with_total
        gathered = _all_gather(own, group)
        rank = dist.get_rank(group)
        before = gathered[:rank].sum(dim=0)  # zeros on rank 0
        if not with_total:
            return before
        # Summed in the same order on every rank: every rank gets the same bits.
        return before, gathered.sum(dim=0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_before, grad_total=None):
        rank = dist.get_rank(ctx.group)
        if not ctx.with_total:
            gathered = _all_gather(grad_before, ctx.group)
            return gathered[rank + 1:].sum(dim=0), None, None
        gathered = _all_gather(torch.stack((grad_before, grad_total)), ctx.group)
        # Own state reaches the start of every later slice, and the final state of every rank.
        grad_own = gathered[rank + 1:, 0].sum(dim=0) + gathered[:, 1].sum(dim=0)
        return grad_own, None, None


def _group_of(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed has no process group: call "
                         "torch.distributed.init_process_group first (torchrun sets its variables)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (the default group), "
                        f"got {type(group).__name__}")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of group: only its members call causal_product")
    return group


def _devices_of(group) -> list[str]:
    """Device types the group's backends can exchange, e.g. ["cpu", "cuda"] for gloo."""
    return [entry.split(":")[0] for entry in str(dist.get_backend_config(group)).split(",")]


def _summary_device(group) -> torch.device:
    """Where the ranks exchange their summaries: the CPU when a backend of the group takes CPU
    tensors (no wait for the GPU), otherwise this process's current GPU. Chosen from the group
    alone, so that every rank uses the same backend."""
    devices = _devices_of(group)
    if "cpu" in devices:
        return torch.device("cpu")
    if devices[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(devices[0])


def _check_local(q, k, v, initial_state, return_state, method, group, rank):
    """The single-device checks of ``ttx_tutorial.causal_product`` plus the distributed ones."""
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be True or False, got {return_state!r}")
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, one of {api.METHODS} or {api.AUTO!r}; got {type(method).__name__}")
    if method == api.AUTO:
        check_inputs(q, k, v, initial_state, method=method, dtypes=KERNEL_DTYPES,
                     max_head_dim=api.MAX_HEAD_DIM, expected_device=_device.DEVICE.type,
                     index_limit=KERNEL_INDEX_LIMIT)
    else:
        info = api.method_info(method)
        check_inputs(q, k, v, initial_state, method=method, dtypes=info.dtypes,
                     max_head_dim=info.max_head_dim,
                     expected_device=_device.DEVICE.type if info.is_triton else None,
                     index_limit=KERNEL_INDEX_LIMIT if info.is_triton else None)
    devices = _devices_of(group)
    if q.device.type not in devices:
        raise ValueError(f"the group's backend ({dist.get_backend_config(group)}) exchanges tensors on "
                         f"{', '.join(devices)}; q, k, v are on {q.device}. Use gloo for CPU tensors, "
                         "NCCL for CUDA tensors")
    if initial_state is not None and rank != 0:
        raise ValueError(f"initial_state is the state before the whole sequence's first token, which "
                         f"rank 0 holds: pass it on rank 0 and None on the others (this is rank {rank})")


def _summary(q, v, return_state, needs_backward, refused) -> list[int]:
    if refused:
        return [0] * (len(_SUMMARY_FIELDS) - 1) + [1]
    B, H, _, D = q.shape
    return [B, H, D, v.shape[-1], _DTYPE_CODES.index(q.dtype), int(return_state),
            int(torch.is_grad_enabled()), int(needs_backward), 0]


def _agree(summary: list[int], own_refusal, group, device) -> bool:
    """Raise on every rank unless no rank refused its inputs and all ranks' summaries agree
    (a rank that refused raises its own error). Returns whether gradients flow into k, v or
    the initial state on any rank: then every rank takes part in the backward's exchange."""
    gathered = _all_gather(torch.tensor(summary, dtype=torch.int64, device=device), group).tolist()
    if own_refusal is not None:
        raise own_refusal
    rows = [dict(zip(_SUMMARY_FIELDS, row)) for row in gathered]
    refused = [rank for rank, row in enumerate(rows) if row["refused"]]
    if refused:
        raise ValueError(f"rank(s) {refused} of the group refused their inputs (their own errors say why); "
                         "every rank stops here so that none waits in a collective")

    def listed(describe):
        return ", ".join(f"rank {rank}: {describe(row)}" for rank, row in enumerate(rows))

    def disagree(describe, what, error=ValueError):
        if len({describe(row) for row in rows}) > 1:
            raise error(f"the ranks disagree on {what} ({listed(describe)}); every rank holds a slice of "
                        "the same sequences and heads and calls causal_product alike")

    disagree(lambda row: (row["B"], row["H"], row["D"], row["E"]), "(B, H, D, E)")
    disagree(lambda row: str(_DTYPE_CODES[row["dtype"]]).replace("torch.", ""), "the dtype of q, k, v",
             TypeError)
    disagree(lambda row: bool(row["return_state"]), "return_state")
    needing = [rank for rank, row in enumerate(rows) if row["needs_backward"]]
    without = [rank for rank, row in enumerate(rows) if not row["grad_enabled"]]
    if needing and without:
        raise ValueError(f"rank(s) {without} run without gradients (torch.no_grad or inference mode) while "
                         f"gradients flow into k, v or initial_state on rank(s) {needing}: the backward's "
                         "exchange needs every rank, so every rank runs with gradients enabled")
    return bool(needing)


def causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   initial_state: torch.Tensor | None = None, return_state: bool = False,
                   method: str = api.AUTO, *, check_ranks: bool = True,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal linear attention over a sequence split across the ranks of ``group``.

    Args:
        q, k: (B, H, T_r, D) tensors; v: (B, H, T_r, E): this rank's slice of the sequence, the
            slices in rank order making up the whole sequence (T_r may differ between ranks and
            be 0). Views are fine (e.g. ``q[:, :, start:stop]``). One dtype on every rank; on
            CUDA under NCCL, on the CPU under gloo.
        group: the process group (the default group when None).
        initial_state: S_0, the state before the whole sequence's first token, (B, H, D, E),
            used in float32: pass it on rank 0 and None on every other rank. Its gradient
            arrives on rank 0, complete.
        return_state: also return S_T, the state after the last token of the whole sequence,
            (B, H, D, E) float32 (float64 for float64 inputs), the same on every rank. Its
            gradients from every rank's loss add up, as for any tensor every rank holds.
        method: the single-device method each rank runs on its slice (see
            :func:`ttx_tutorial.causal_product`); "auto" lets each rank choose for its slice.
        check_ranks: compare B, H, D, E, dtype, ``return_state`` and gradient requirements
            across ranks before the first exchange (one all_gather of 9 int64 values a rank,
            and on NCCL-only groups a wait for the GPU to read them back). False skips it:
            mismatched ranks then fail inside the collectives or wait in them, and gradients
            must reach k, v or initial_state on every rank or on none.

    Returns:
        This rank's o, (B, H, T_r, E) in the inputs' dtype, or ``(o, S_T)`` with ``return_state``.
        When gradients flow into k, v or initial_state on any rank, o requires a gradient on every
        rank, and every rank must run the backward through its outputs (its loss must depend on
        them): the backward's exchange is a collective.

    Raises:
        ValueError / TypeError: bad input on any rank, or ranks that disagree, raise on every
        rank (with ``check_ranks``); ValueError without a process group ("call
        torch.distributed.init_process_group first").
    """
    group = _group_of(group)
    rank = dist.get_rank(group)
    refusal = None
    try:
        _check_local(q, k, v, initial_state, return_state, method, group, rank)
    except (TypeError, ValueError) as error:
        if not check_ranks:
            raise
        refusal = error
    needs_backward = refusal is None and torch.is_grad_enabled() and (
        k.requires_grad or v.requires_grad or (initial_state is not None and initial_state.requires_grad))
    exchange_gradients = needs_backward
    if check_ranks:
        exchange_gradients = _agree(_summary(q, v, return_state, needs_backward, refusal is not None),
                                    refusal, group, _summary_device(group))
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # L_r: this slice's tokens summed into one state; the order inside the slice does not matter.
    own = _SliceState.apply(k, v, state_dtype)
    if exchange_gradients and not own.requires_grad:
        # Another rank's k, v or S_0 needs the gradient of this rank's starting state: join the
        # backward's exchange through a leaf whose own gradient nobody reads.
        own = own.detach().requires_grad_()
    if initial_state is not None:  # rank 0: S_0 enters every later start and the final state
        initial_state = initial_state.to(state_dtype)
        own = own + initial_state
    if return_state:
        before, final_state = _StatesAcrossRanks.apply(own, group, True)
    else:
        before = _StatesAcrossRanks.apply(own, group, False)
    start = before if initial_state is None else before + initial_state
    o = api.causal_product(q, k, v, method, initial_state=start)
    return (o, final_state) if return_state else o
