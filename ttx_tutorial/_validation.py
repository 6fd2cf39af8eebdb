"""Checks on the arguments of ``causal_product``: clear errors instead of compiler tracebacks."""

from __future__ import annotations

import weakref

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
#: The Triton kernels address elements inside one (batch, head) slice with 32-bit integers.
KERNEL_INDEX_LIMIT = 2**31 - 1


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_dense(name, x):
    """Sparse, nested and other non-strided tensors have no (B, H, T, D) strides to walk."""
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor; pad it first")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
                        "convert it with .to_dense()")


def check_cu_seqlens(q, cu_seqlens):
    """cu_seqlens: the (N + 1,) int32/int64 offsets of N sequences packed along dimension 2 of a
    batch of one, as fla and flash-attention take them: 0 first, non-decreasing, total_T last
    (empty sequences allowed). The values are read back to the host once per tensor and version
    (``_check_offsets_once``), except while ``torch.compile`` traces (the operator checks them
    when it runs, ``check_offsets``)."""
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
    if not torch.compiler.is_compiling():
        _check_offsets_once(cu_seqlens, q.shape[2])


#: id -> (weak reference, version counter, total_T) of offsets tensors already checked.
_CHECKED_OFFSETS = {}


def _read_back_stalls(cu_seqlens) -> bool:
    """Whether reading the offsets' values waits for a device (any but the CPU)."""
    return cu_seqlens.device.type != "cpu"


def _check_offsets_once(cu_seqlens, total_T):
    """``check_offsets``, skipped on a GPU for the very tensor checked before, unmodified since
    (its version counter unchanged) and against the same total_T. A model's layers share one
    packed batch's offsets: one read back for all of them, where a read back at every call would
    stall the host until the GPU has caught up. The version counter misses writes that PyTorch
    does not record (through ``.data``, or a NumPy or DLPack view of the same memory): offsets on
    the CPU, whose read stalls nothing, are therefore checked at every call. Inference tensors
    have no version counter: always checked."""
    if not _read_back_stalls(cu_seqlens):
        check_offsets(cu_seqlens, total_T)
        return
    try:
        stamp = (cu_seqlens._version, total_T)
    except RuntimeError:  # an inference-mode tensor
        check_offsets(cu_seqlens, total_T)
        return
    checked = _CHECKED_OFFSETS.get(id(cu_seqlens))
    if checked is not None and checked[0]() is cu_seqlens and checked[1:] == stamp:
        return
    check_offsets(cu_seqlens, total_T)
    if len(_CHECKED_OFFSETS) >= 256:  # ids of dead tensors: drop them all now and then
        _CHECKED_OFFSETS.clear()
    _CHECKED_OFFSETS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), *stamp)


def check_offsets(cu_seqlens, total_T):
    """The values of cu_seqlens (see ``check_cu_seqlens``), in one read back to the host."""
    first, last, decreasing = torch.stack(
        [cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] < cu_seqlens[:-1]).sum()]).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {decreasing} offsets below the one before")
    if last != total_T:
        raise ValueError(f"cu_seqlens must end at total_T = {total_T} (dimension 2 of q), got {last}")


def check_inputs(q, k, v, initial_state, *, method, dtypes, max_head_dim, expected_device,
                 index_limit=None, cu_seqlens=None):
    """Validate q, k, v and the initial state for one method.

    ``dtypes``: the floating dtypes the method accepts. ``max_head_dim``: the largest D and
    E it supports (None: no limit). ``expected_device``: the device type the method runs
    on ("cpu", "cuda"), or None when any device works. ``index_limit``: the largest element
    offset inside one (batch, head) slice the method can address (None: no limit).
    ``cu_seqlens``: None, or the offsets of sequences packed along T (``check_cu_seqlens``);
    the states are then (N, H, D, E), one per sequence.
    """
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
    if q.dtype not in dtypes:
        raise TypeError(
            f"method {method!r} supports dtypes {_dtype_names(dtypes)}; q, k, v are {q.dtype}"
        )
    device = q.device  # read once: each read builds a new torch.device
    if k.device != device or v.device != device:
        raise ValueError(
            f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    if expected_device is not None and device.type != expected_device:
        where = "Triton's CPU interpreter" if expected_device == "cpu" else "the GPU"
        raise ValueError(
            f"method {method!r} runs on {where} in this session, so q, k, v must be on "
            f"{expected_device!r}; they are on {q.device}. Move them with .to({expected_device!r})"
        )
    if device.type == "meta":
        raise ValueError(f"q, k and v are on the meta device, which holds no values: method {method!r} "
                         "needs tensors with data")
    D, E = q.shape[-1], v.shape[-1]
    if D < 1 or E < 1:
        raise ValueError(f"D and E must be at least 1, got D={D} (q, k) and E={E} (v)")
    if max_head_dim is not None and (D > max_head_dim or E > max_head_dim):
        raise ValueError(
            f"method {method!r} supports D and E up to {max_head_dim}; got D={D} (q, k) and E={E} (v). "
            "Split the head dimension or use a reference method"
        )
    if index_limit is not None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.is_contiguous() and x.numel() <= index_limit + 1:
                continue  # a dense tensor's heads end within its elements: no offset can be larger
            _, _, length, width = x.shape
            _, _, stride_t, stride_last = x.stride()
            last_offset = (length - 1) * abs(stride_t) + (width - 1) * abs(stride_last)
            if length > 0 and last_offset > index_limit:
                raise ValueError(
                    f"method {method!r} indexes one (batch, head) slice with 32-bit offsets: {name} spans "
                    f"{last_offset + 1} elements per head (T={x.shape[2]}), above the limit of "
                    f"{index_limit + 1}. Split the sequence and chain the pieces with initial_state"
                )
    if cu_seqlens is not None:
        check_cu_seqlens(q, cu_seqlens)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}")
        _check_dense("initial_state", initial_state)
        if cu_seqlens is None:
            layout, expected = "(B, H, D, E)", (*q.shape[:2], D, E)
        else:  # one state per packed sequence
            layout, expected = "(N, H, D, E) with cu_seqlens", (cu_seqlens.shape[0] - 1, q.shape[1], D, E)
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must have shape {layout} = {expected}, got {tuple(initial_state.shape)}"
            )
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state must be a floating-point tensor, got {initial_state.dtype}")
        if initial_state.device != device:
            raise ValueError(
                f"initial_state must be on the same device as q ({q.device}), got {initial_state.device}"
            )
