"""What every checker shares: guarded buffers, one run of a student's kernel, plain-words diagnoses.

A checker launches the student's kernel itself, on buffers it controls:

* every output sits inside a larger allocation filled with +inf: an element still +inf after
  the launch was never written, and a change in the allocation outside the output is a store
  past its edges (Triton's interpreter does not stop out-of-bounds stores, it just writes);
* every input sits inside an allocation filled with NaN: a load that reads past an input's
  edge brings NaN into the output instead of plausible numbers. Under Triton's interpreter the
  checker also watches every load (``watched_loads``): a lane that loads NaN read past an edge,
  even where the output never uses it (on a GPU such a read can fault), and its address says
  which input (by the kernel's pointer argument) and which end of it; the lanes that a
  mask switches off in a load without ``other=`` get NaN, as a GPU leaves them undefined (the
  interpreter would give zeros, which would hide a missing ``other=0.0``);
* inputs are fresh random numbers for every call, and some cases lay tensors out transposed,
  so a kernel that assumes contiguous rows fails there and only there.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import json
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _device
from ..testing import TOLERANCES, relative_error

#: Elements of padding on each side of a guarded buffer; larger than any block a student uses.
GUARD = 4096
UNWRITTEN = math.inf
OUTSIDE_INPUT = math.nan
BLANK_MARKER = "raise NotImplementedError"


@dataclass
class CheckResult:
    """The outcome of one checker call: ``passed``, and the one-paragraph ``message`` printed."""

    exercise: str
    passed: bool
    message: str
    cases: list = field(default_factory=list)

    def __bool__(self):
        return self.passed

    def __repr__(self):
        return self.message


class Failure(Exception):
    """Raised inside a checker to stop at the first wrong case with its diagnosis."""


def report(exercise: str, passed: bool, message: str, cases=()) -> CheckResult:
    """Print the result and, under the grader, append it to the grader's report file."""
    result = CheckResult(exercise, passed, message, list(cases))
    print(message)
    report_path = os.environ.get("TTX_EXERCISES_REPORT")
    if report_path:
        with open(report_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"exercise": exercise, "passed": passed, "message": message}) + "\n")
    return result


# --------------------------------------------------------------------------- buffers

def guarded(logical_shape, dtype, *, fill, transposed=False, device=None):
    """A tensor of ``logical_shape`` inside a flat allocation of ``GUARD`` extra elements on each
    side, all set to ``fill``. ``transposed`` swaps the last two dimensions in memory, so the
    tensor has the logical shape but not contiguous rows. Returns ``(tensor, allocation)``."""
    device = _device.DEVICE if device is None else device
    physical = list(logical_shape)
    if transposed:
        physical[-1], physical[-2] = physical[-2], physical[-1]
    numel = math.prod(physical)
    allocation = torch.full((numel + 2 * GUARD,), fill, dtype=dtype, device=device)
    tensor = allocation[GUARD:GUARD + numel].view(physical)
    if transposed:
        tensor = tensor.transpose(-1, -2)
    return tensor, allocation


def guarded_copy(values, *, transposed=False, name=None):
    """``values`` copied into a NaN-guarded buffer (see :func:`guarded`). A ``name`` (the kernel's
    pointer argument) lets the watched loads say which input a load overran."""
    tensor, allocation = guarded(values.shape, values.dtype, fill=OUTSIDE_INPUT, transposed=transposed)
    tensor.copy_(values)
    if name is not None:
        LOADS.inputs.append((name, allocation, tensor))
    return tensor


def outside_writes(allocation, tensor) -> int:
    """How many elements of ``allocation`` outside ``tensor`` are no longer +inf."""
    inside = torch.zeros(allocation.shape, dtype=torch.bool, device=allocation.device)
    offset = tensor.storage_offset() - allocation.storage_offset()
    inside.as_strided(tensor.shape, tensor.stride(), offset).fill_(True)
    changed = allocation != UNWRITTEN
    return int((changed & ~inside).sum())


# --------------------------------------------------------------------------- loads, watched

class _LoadCounts:
    """What the watched loads saw since the last ``check_output``."""

    def __init__(self):
        self.read_outside = 0  # active lanes that loaded NaN: a read past an input's edge
        self.undefined = 0     # switched-off lanes of loads without other=, filled with NaN
        self.inputs = []       # (pointer name, allocation, tensor) of the named guarded inputs
        self.overruns = {}     # (pointer name, "before its first" or "past its last"): lanes

    def take(self):
        """The counts since the last call; everything is cleared, the inputs' names too."""
        counts = (self.read_outside, self.undefined)
        self.read_outside = self.undefined = 0
        self.inputs = []
        self.overruns = {}
        return counts

    def take_overruns(self) -> str:
        """Which inputs the reads past an edge overran, in words ("" if none was named)."""
        parts = [f"{name}: {count} {side} element" for (name, side), count in self.overruns.items()]
        self.overruns = {}
        return "; ".join(parts)

    def count_overruns(self, addresses):
        """Attribute the addresses of lanes that loaded guard NaN to the named inputs."""
        for name, allocation, tensor in self.inputs:
            size = allocation.element_size()
            start = allocation.data_ptr()
            inside = (addresses >= start) & (addresses < start + allocation.numel() * size)
            if inside.any():
                before = int((addresses[inside] < tensor.data_ptr()).sum())
                for side, count in (("before its first", before), ("past its last", int(inside.sum()) - before)):
                    if count:
                        key = (name, side)
                        self.overruns[key] = self.overruns.get(key, 0) + count


LOADS = _LoadCounts()
_BFLOAT16_NAN = 0x7FC0  # the interpreter holds bfloat16 as its 16-bit patterns


def _nan_lanes(values, dtype) -> np.ndarray:
    if dtype == tl.bfloat16:
        return (values.astype(np.uint16) & 0x7FFF) > 0x7F80
    if np.issubdtype(values.dtype, np.floating):
        return np.isnan(values)
    return np.zeros(values.shape, dtype=bool)


@contextlib.contextmanager
def watched_loads():
    """Under Triton's interpreter, count into ``LOADS`` the loads that read past an input's edge
    and fill with NaN the lanes a mask switches off in loads without ``other=`` (see the module
    docstring); on a GPU, nothing. Every load of the interpreter goes through its builder's
    ``create_masked_load`` (unmasked ones with a mask of ones), in Triton 3.6 to 3.9."""
    from triton.runtime import interpreter
    builder = getattr(interpreter, "interpreter_builder", None)
    original = getattr(builder, "create_masked_load", None)
    if not _device.INTERPRETED or original is None:
        yield
        return
    TensorHandle = interpreter.TensorHandle

    def create_masked_load(ptrs, mask, other, *rest, **kwargs):
        dtype = ptrs.get_element_ty()
        active = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
        np_dtype = interpreter._get_np_dtype(dtype)
        poison = _BFLOAT16_NAN if dtype == tl.bfloat16 else np.nan if np.issubdtype(np_dtype, np.floating) else None
        if other is None and poison is not None and not active.all():
            other = TensorHandle(np.full(np.shape(ptrs.data), poison, dtype=np_dtype), dtype)
            LOADS.undefined += int((~active).sum())
        loaded = original(ptrs, mask, other, *rest, **kwargs)
        outside = _nan_lanes(np.asarray(loaded.data), dtype) & active
        if outside.any():
            LOADS.read_outside += int(outside.sum())
            LOADS.count_overruns(np.asarray(ptrs.data)[outside].astype(np.uint64))
        return loaded

    own = "create_masked_load" in vars(builder)
    builder.create_masked_load = create_masked_load
    try:
        yield
    finally:
        if own:
            builder.create_masked_load = original
        else:
            del builder.create_masked_load


# --------------------------------------------------------------------------- the student's code

def blank_in(function) -> str | None:
    """``"line N"`` of the first unfilled blank in a kernel's or a function's source, else None."""
    python_function = getattr(function, "fn", function)
    try:
        lines, first = inspect.getsourcelines(python_function)
    except (OSError, TypeError):
        return None
    for number, line in enumerate(lines, start=first):
        if BLANK_MARKER in line.split("#")[0]:
            return f"line {number}"
    return None


def blank_message(exercise: str, name: str, where: str) -> str:
    return (f"✗ {exercise}: {name} still has the blank to fill (`raise NotImplementedError()` at {where} "
            f"of its cell): replace it with your code and run the cell again.")


def require_arguments(kernel, expected, exercise):
    """The kernel must be a @triton.jit function taking exactly ``expected`` (the spec's order)."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        raise TypeError(f"{exercise}: kernel must be a @triton.jit function, got {type(kernel).__name__}")
    if list(names) != list(expected):
        raise Failure(f"the kernel's arguments must be exactly {', '.join(expected)} (in that order); "
                      f"yours are {', '.join(names)}")


def launch_error(error: BaseException) -> str:
    """The first line of what a launch raised, in a form a student can act on. A Triton compiler
    error reads "at LINE:COLUMN:", then the source, then its own message: the line is that message's."""
    text = str(error).strip().splitlines()
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    own = getattr(cause, "error_message", None)
    inner = str(own if own else cause).strip().splitlines()
    line = (inner or text or [type(error).__name__])[0]
    return f"{type(cause).__name__}: {line[:300]}"


def error_chain_text(error: BaseException) -> str:
    """Everything a raised error and the errors it was raised from say, to look for known causes in."""
    texts = []
    while error is not None:
        texts.append(f"{error}\n{getattr(error, 'error_message', None) or ''}")
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """One launch: sizes, dtype and whether inputs (``transposed``; with several, every other one)
    and the output (``output_transposed``, by default as the inputs) are laid out transposed."""

    sizes: dict
    dtype: torch.dtype = torch.float32
    transposed: bool = False
    output_transposed: bool | None = None
    #: With ``transposed``, which inputs of several: the even-numbered (0, 2, ...) or the odd-numbered.
    odd_inputs: bool = False
    #: The inputs' names in order and the output's, to say which tensors a case transposes.
    names: tuple = ()
    output_name: str = "out"

    def input_transposed(self, index: int) -> bool:
        """Whether input number ``index`` is laid out transposed (a single input: index 0)."""
        return self.transposed and (index % 2 == 1) == self.odd_inputs

    @property
    def out_transposed(self) -> bool:
        return self.transposed if self.output_transposed is None else self.output_transposed

    @property
    def any_transposed(self) -> bool:
        return self.transposed or self.out_transposed

    def describe(self) -> str:
        sizes = ", ".join(f"{name}={value}" for name, value in self.sizes.items())
        if self.names:
            transposed = [name for index, name in enumerate(self.names) if self.input_transposed(index)]
            transposed += [self.output_name] if self.out_transposed else []
            layout = f", {' and '.join(transposed)} transposed" if transposed else ""
        else:
            layout = {(True, True): ", transposed tensors", (True, False): ", transposed inputs",
                      (False, True): ", transposed output", (False, False): ""}[(self.transposed, self.out_transposed)]
        return f"{sizes}, {str(self.dtype).replace('torch.', '')}{layout}"


def _unwritten_slices(unwritten, dim_names):
    """"row d 1, 2 (in every sequence, segment, column e)" when whole slices along one dimension
    explain every unwritten element, else None (``dim_names``: one singular name a dimension, None
    for a dimension whose unwritten slices another diagnosis explains better)."""
    for dim, name in enumerate(dim_names):
        if name is None:
            continue
        moved = unwritten.movedim(dim, 0).reshape(unwritten.shape[dim], -1)
        whole = moved.all(dim=1)
        if whole.any() and torch.equal(moved, whole[:, None].expand_as(moved)):
            indices = whole.nonzero().flatten().tolist()
            shown = ", ".join(map(str, indices[:6])) + (", ..." if len(indices) > 6 else "")
            others = ", ".join(n for n in dim_names if n not in (name, None))
            where = f" (in every {others})" if others else ""
            return f"{name} {shown}{where}: every element of {'it' if len(indices) == 1 else 'them'} still holds"
    return None


def check_output(out, allocation, ref, case: Case, *, row_dim: int, row_name="rows", block=None, dim_names=None,
                 passed=(), first_row_hint=None):
    """The diagnoses that need no knowledge of the exercise: stores outside the output, unwritten
    elements, NaN read from outside an input. Returns the relative error when none applies.
    ``dim_names``: a name for each dimension of ``out``, to say which slices were never written;
    ``passed``: the cases already passed; ``first_row_hint``: what to say, in the exercise's
    terms, when the first row alone was never written."""
    n_outside = outside_writes(allocation, out)
    widths = {name: tensor.shape[-1] for name, _, tensor in LOADS.inputs if tensor.dim()}
    one_row_past = bool(LOADS.overruns) and all(side == "past its last" and count == widths.get(name)
                                                for (name, side), count in LOADS.overruns.items())
    overruns = LOADS.take_overruns()
    read_outside, undefined = LOADS.take()
    tail = (block is not None and out.shape[row_dim] % block != 0)
    if n_outside:
        left = out.shape[row_dim] % block if tail else 0
        # Elements in one row of one sequence (the output is (sequences, rows, ...)).
        row_width = out.numel() // max(1, out.shape[0] * out.shape[row_dim])
        if out.numel() and n_outside % max(1, row_width):
            # Not a whole number of rows: a row written past its last column, not a row past the end.
            hint = (f" That is not a whole number of {row_name}: the store's other dimension overruns (a block of "
                    f"columns padded to a power of two): mask it too (its column offsets against their size, such as "
                    f"`offs_d < D` or `offs_e < E`, combined by `&` with any mask on the {row_name}).")
        elif tail:
            hint = (f" The last block has {left} of its {block} {row_name} in the output: its store needs a "
                    f"mask on them, and on every other dimension its block can overrun (`offs < n`, combined "
                    f"with `&` for a 2-D block).")
        else:
            hint = (" A store needs a mask on every dimension its block can overrun (`offs < n`, combined with "
                    "`&` for a 2-D block).")
        # One row past the end of every sequence (only the last sequence's spills outside when
        # sequences lie one after another) or of the whole output.
        one_row = (row_width, out.numel() // max(1, out.shape[row_dim]))
        if out.numel() and n_outside in one_row:
            hint += (f" Exactly one {row_name.rstrip('s')} past the end: is a mask written `<=` where it needs `<`, "
                     f"or does a loop over the {row_name} run one step too many (`range(T + 1)`)?")
        hint += (" (Or the store uses another tensor's strides, adds the program's offset twice, or takes a "
                 "program id from the wrong axis of the grid.)")
        raise Failure(f"wrote {n_outside} element(s) outside the output ({case.describe()}).{hint}")
    if read_outside:
        where = f" ({overruns})" if overruns else ""
        below = (" An offset that can go below zero (such as `offs - 1`) needs its lower bound in the mask too "
                 "(`offs >= 1`)." if "before its first" in overruns else "")
        if one_row_past:
            below = (" Each overran by one row's width: a row too many (a mask written `<=` where it needs `<`) or "
                     "the columns past the last one (no mask on the columns).")
        raise Failure(f"loads read {read_outside} element(s) past the edge of an input{where} ({case.describe()}): "
                      f"the checker surrounds inputs with NaN and saw it loaded, even if the output does not use it "
                      f"(on a GPU such a read can fault). Every load needs a mask on each dimension its block can "
                      f"overrun (`offs < n`, combined with `&` for a 2-D block).{below} (Or the address uses "
                      f"another dimension's or another tensor's stride.)")
    unwritten = out == UNWRITTEN
    interpreted_bfloat16 = case.dtype == torch.bfloat16 and _device.INTERPRETED
    if unwritten.any() and interpreted_bfloat16 and any(c.dtype == torch.float32 for c in passed):
        raise Failure(f"part of the output holds inf ({case.describe()}), the checker's mark for unwritten "
                      f"elements, though the float32 cases passed: most likely Triton's interpreter, which gets "
                      f"arithmetic on bfloat16 values wrong (a GPU does not). Convert bfloat16 loads with "
                      f"`.to(tl.float32)` before any arithmetic (float32 loads need none, which is why those "
                      f"cases passed).")
    # The checker marks unwritten elements with +inf; beside -inf, or (under the interpreter, which
    # watched the loads) NaN that no load explains, the +inf were computed too.
    computed_infinities = bool((out == -UNWRITTEN).any()) or (
        _device.INTERPRETED and bool(torch.isnan(out).any()) and not undefined)
    if unwritten.any() and computed_infinities:
        raise Failure(f"the output holds infinities (+inf is also the checker's mark for unwritten elements) and "
                      f"{'-inf or NaN' if _device.INTERPRETED else '-inf'} although every input is finite "
                      f"({case.describe()}): the arithmetic made them. A masked-off score set to "
                      f"-inf, as softmax attention does before its exp, gives them once it multiplies v: in linear "
                      f"attention a masked-off score is 0.0 (`tl.where(causal, scores, 0.0)`). (Or a value grew "
                      f"past the range of its type: compute in float32.)")
    if unwritten.all() and out.numel():
        raise Failure(f"the output was never written ({case.describe()}): is the tl.store missing, or "
                      f"does it store to another pointer?")
    if unwritten.any() and dim_names is not None and _unwritten_slices(unwritten, dim_names):
        raise Failure(f"part of the output was never written ({case.describe()}): "
                      f"{_unwritten_slices(unwritten, dim_names)} the checker's poison. Does every "
                      f"program add its own offset (its program id times the stride) to the addresses?")
    if unwritten.any() and row_dim < out.dim() - 1:
        # The same columns (the last dimension) unwritten in every row: the rows were all reached, the
        # columns were not.
        per_row = unwritten.reshape(-1, out.shape[-1])
        columns = per_row.all(dim=0)
        if columns.any() and torch.equal(per_row, columns.expand_as(per_row)):
            indices = columns.nonzero().flatten().tolist()
            shown = ", ".join(map(str, indices[:6])) + (", ..." if len(indices) > 6 else "")
            name, verb = ("column", "still holds") if len(indices) == 1 else ("columns", "still hold")
            hint = ""
            if indices == list(range(indices[0], out.shape[-1])):
                which = ("That is the last column" if len(indices) == 1 else
                         f"Those are the last {len(indices)} columns")
                hint = (f" {which}: does the mask on the columns switch on every one (`offs < n` for n columns, "
                        f"not `offs < n - 1`)?")
            raise Failure(f"part of the output was never written ({case.describe()}): {name} {shown} of every "
                          f"{row_name.rstrip('s')} {verb} the checker's poison.{hint}")
    if unwritten.any():
        rows = unwritten.movedim(row_dim, 0).reshape(out.shape[row_dim], -1).any(dim=1)
        missing = rows.nonzero().flatten().tolist()
        shown = ", ".join(map(str, missing[:6])) + (", ..." if len(missing) > 6 else "")
        hint = ""
        if block is not None and missing == list(range(block, out.shape[row_dim])) and block < out.shape[row_dim]:
            hint = (f" Only the first block of {block} {row_name} was written, as if every program wrote the "
                    f"same block: does each program add its own offset (its program id times {block}) to its "
                    f"{row_name}?")
        elif block is not None and missing and missing[0] >= out.shape[row_dim] // block * block:
            hint = (f" Those are the {row_name} of the last, partial block of {block}: it must be computed "
                    f"too, with masked loads and stores.")
        elif missing == [0] and first_row_hint and out.shape[row_dim] > 1:
            hint = first_row_hint
        elif missing and (missing[0] == 0 or missing[-1] == out.shape[row_dim] - 1) \
                and missing == list(range(missing[0], missing[-1] + 1)) and len(missing) < out.shape[row_dim]:
            end = "first" if missing[0] == 0 else "last"
            which = (f"That is the {end} {row_name.rstrip('s')}" if len(missing) == 1 else
                     f"Those are the {end} {len(missing)} {row_name}")
            hint = (f" {which}: does the loop over the {row_name} (or the mask on them) cover every one, from 0 "
                    f"to the last (`for t in range(T)`, `offs < T`)?")
        if not hint and case.dtype == torch.bfloat16 and _device.INTERPRETED:
            hint = (" (Or they were written as inf: Triton's interpreter gets arithmetic on bfloat16 values "
                    "wrong, so convert bfloat16 loads with `.to(tl.float32)` before any arithmetic.)")
        name, verb = (row_name.rstrip("s"), "still holds") if len(missing) == 1 else (row_name, "still hold")
        raise Failure(f"part of the output was never written ({case.describe()}): {name} {shown} "
                      f"{verb} the checker's poison.{hint}")
    if torch.isnan(out).any() and undefined:
        raise Failure(f"the output holds NaN although every input is finite ({case.describe()}): it used lanes "
                      f"that a mask switched off in a load without `other=`, whose values a GPU leaves undefined "
                      f"(the checker fills them with NaN). Give such loads `other=0.0`.")
    if torch.isnan(out).any() and interpreted_bfloat16:
        raise Failure(f"the output holds NaN although every input is finite and every load stayed inside its "
                      f"input ({case.describe()}): Triton's interpreter gets arithmetic on bfloat16 values wrong "
                      f"(a GPU does not). Convert bfloat16 loads with `.to(tl.float32)` before any arithmetic.")
    if torch.isnan(out).any() and _device.INTERPRETED:
        raise Failure(f"the output holds NaN although every input is finite and every load stayed inside its "
                      f"input ({case.describe()}): the arithmetic made it (inf - inf, 0 * inf, or a value past "
                      f"the range of a 16-bit type). Compute in float32 (`.to(tl.float32)` on loads).")
    if torch.isnan(out).any():
        raise Failure(f"the output holds NaN although every input is finite ({case.describe()}): a load "
                      f"without a mask read past the edge of an input (the checker surrounds inputs with NaN). "
                      f"Give every load a mask and `other=0.0`.")
    return relative_error(out, ref)


def precision_failure(case: Case, error: float, passed_cases) -> str | None:
    """A plain-words reason when a 16-bit case fails after the float32 ones passed."""
    if case.dtype == torch.float32 or not any(c.dtype == torch.float32 for c in passed_cases):
        return None
    if case.dtype == torch.bfloat16 and _device.INTERPRETED:
        return (f"float32 inputs pass, bfloat16 give relative error {error:.1e} ({case.describe()}). Some "
                f"arithmetic runs on bfloat16 values: a load not converted with `.to(tl.float32)`, or a value "
                f"(the state, a sum) cast back to 16 bits before it is used again. Keep every value in float32 "
                f"until the final store: on a GPU, sums kept in bfloat16 lose precision as they grow, and on "
                f"the CPU Triton's interpreter computes bfloat16 arithmetic wrongly (it works on the raw bits).")
    return (f"float32 inputs pass, {str(case.dtype).replace('torch.', '')} give relative error {error:.1e} "
            f"({case.describe()}): the sums are kept in 16 bits and lose precision as they grow. Keep every "
            f"sum, and the state, in float32 (`tl.zeros(..., dtype=tl.float32)`, `.to(tl.float32)` before "
            f"elementwise arithmetic) and convert to 16 bits only to store or to feed `tl.dot`.")


def sixteen_bit_error_bound(ref, dtype) -> float:
    """Five times the error of rounding the exact result to ``dtype``: what a kernel that sums in
    float32 stays well within, and a kernel that sums in 16 bits exceeds on long sequences."""
    return max(TOLERANCES[torch.float32], 5 * relative_error(ref.to(dtype), ref))


def success(exercise: str, cases, extra: str = "") -> str:
    dtypes = sorted({str(c.dtype).replace("torch.", "") for c in cases})
    return f"✓ {exercise}: correct on {len(cases)} cases ({', '.join(dtypes)}){extra}."


def dtype_name(dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


_INTERPRETER_BF16_DOT_OK: bool | None = None


def interpreter_bf16_dot_ok() -> bool:
    """Whether bfloat16 ``tl.dot`` gives right values here: always on a GPU; on the CPU, asked
    of the installed interpreter once (Triton 3.9's multiplies the raw bits and is wrong)."""
    global _INTERPRETER_BF16_DOT_OK
    if not _device.INTERPRETED:
        return True
    if _INTERPRETER_BF16_DOT_OK is None:
        from ._probe import bf16_dot_error
        _INTERPRETER_BF16_DOT_OK = bf16_dot_error() < 1e-2
    return _INTERPRETER_BF16_DOT_OK


#: Said on success when the interpreter failed the bfloat16 tl.dot probe, so bfloat16 was skipped.
BF16_DOT_NOTE = " bfloat16 skipped: this interpreter's bfloat16 tl.dot is wrong (just checked), a GPU can check it"
