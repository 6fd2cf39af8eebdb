"""Which elements does each program read and write?  Record it from an interpreter run, then draw it.

:func:`record` runs a ``@triton.jit`` kernel once through Triton's CPU interpreter, in CPU mode
and in GPU mode alike, and notes for every ``tl.load`` and ``tl.store`` the program that made
it, the kernel line, and the element offsets of its active lanes (lanes switched off by the
mask are kept apart, never counted as touched). :func:`draw` turns a recording into a picture
of each tensor's elements coloured by the program that touched them: tiles, tails and masks
become visible. It is a course tool in the spirit of triton-viz, small enough to read, and not
imported by ``import ttx_tutorial``.

How it works. The interpreter executes every ``tl.load``/``tl.store`` through two methods of
its builder, ``create_masked_load(ptrs, mask, ...)`` and ``create_masked_store(ptrs, value,
mask, ...)``, with the lanes' byte addresses and the mask as NumPy arrays; unmasked loads and
stores and Triton 3.9's tensor descriptors go through them too. For the length of one launch the recorder
wraps those two methods, and turns each address back into an offset in the tensor argument
that holds it. Atomics take another path, so a kernel that uses them is refused rather than
half recorded. Afterwards the interpreter's builder and ``triton.language`` are put back
exactly as they were (Triton's interpreter itself leaves ``triton.language`` rebound after a
kernel calls a ``@triton.jit`` helper).

In GPU mode ``@triton.jit`` makes ``JITFunction``\\ s; the recorder runs the kernel's Python
function in an ``InterpretedFunction`` instead, and for the launch swaps every ``JITFunction``
the kernel can reach (its helpers, ``tl.zeros``, ``tl.sum``, ...) for an interpreted twin.

Tensors must be on the CPU: the interpreter runs on the host, and the recorder maps addresses
to the tensors it was given. Tested with Triton 3.9, in CPU mode and in GPU mode (forced with
``TTX_TUTORIAL_DEVICE=cuda``, no GPU needed); written for Triton 3.6 too, using only what both
interpreters have. A first launch of a tiny probe kernel checks that the installed interpreter
reports loads and stores as described, and raises a clear ``RuntimeError`` if it does not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import linecache
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interpreter_module
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import _device  # noqa: F401  (sets TRITON_INTERPRET before the probe kernel is decorated)
from .compiler import _language_objects  # what the interpreter rebinds; one definition for both tools

__all__ = ["Access", "Recording", "TensorInfo", "UnsupportedKernel", "draw", "record", "run_interpreted"]

#: Largest number of lanes one recording keeps; the recorder is for small teaching launches.
MAX_LANES = 1_000_000
#: Largest number of element cells one picture draws (each is a matplotlib patch).
MAX_DRAWN_CELLS = 20_000

_BUILDER_METHODS = ("create_masked_load", "create_masked_store")
#: Builder methods that touch memory without going through the two above.
_UNRECORDED_METHODS = ("create_atomic_rmw", "create_atomic_cas")


class UnsupportedKernel(ValueError):
    """The kernel does what the recorder cannot follow exactly: atomics, accesses not aligned to
    their elements, more lanes than ``max_lanes``."""


@dataclass(frozen=True)
class TensorInfo:
    """What the recorder knows of one tensor argument of the launch."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    element_size: int
    data_ptr: int
    #: memory the tensor spans, in elements from its first one: offsets 0 .. span - 1. In a view
    #: with padded rows not every offset of the span is an element (see :meth:`is_element`).
    span: int

    def holds(self, addresses: np.ndarray) -> np.ndarray:
        """Which byte addresses fall within the tensor's span."""
        start = self.data_ptr
        return (addresses >= start) & (addresses < start + self.span * self.element_size)

    @functools.cached_property
    def _element_offsets(self) -> np.ndarray:
        offsets = np.zeros(1, dtype=np.int64)
        for size, stride in zip(self.shape, self.stride):
            offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
        return np.unique(offsets)

    def is_element(self, offsets) -> np.ndarray:
        """Which offsets address an element of the tensor (not padding, not past either end)."""
        return np.isin(np.asarray(offsets, dtype=np.int64), self._element_offsets)

    @property
    def row_length(self) -> int | None:
        """Elements per drawn row: the row stride of a row-major tensor of two or more dimensions
        (padding included), else None (drawn as one row of memory)."""
        if len(self.shape) < 2 or self.stride[-1] != 1:
            return None
        if any(inner * size > outer for inner, size, outer in zip(self.stride[1:], self.shape[1:], self.stride[:-1])):
            return None
        return self.stride[-2]


@dataclass(frozen=True)
class Access:
    """One ``tl.load`` or ``tl.store`` by one program, charged to one tensor argument."""

    program: tuple[int, int, int]
    kind: str  # "load" or "store"
    #: the argument name, or None for lanes that fall in no tensor argument (see ``addresses``)
    tensor: str | None
    #: element offsets of the active lanes, from the tensor's first element, in lane order
    offsets: tuple[int, ...]
    #: offsets of the lanes the mask switched off: computed by the kernel, never touched
    masked_offsets: tuple[int, ...]
    #: the active offsets that are no element of the tensor: past either end, or padding
    #: between rows of a view; reads of garbage, writes over a neighbour
    out_of_bounds: tuple[int, ...]
    #: the kernel's line number in its file, and that line's text
    line: int | None
    source: str
    #: for ``tensor=None`` only: the raw byte addresses of the active lanes
    addresses: tuple[int, ...] = ()


@dataclass
class Recording:
    """Every access of one launch, in the order the interpreter made them."""

    kernel_name: str
    grid: tuple[int, int, int]
    tensors: dict[str, TensorInfo]
    accesses: list[Access] = field(default_factory=list)

    def programs(self) -> list[tuple[int, int, int]]:
        """Every program of the grid, in the interpreter's launch order."""
        gx, gy, gz = self.grid
        return [(x, y, z) for x in range(gx) for y in range(gy) for z in range(gz)]

    def program_number(self, program) -> int:
        """A program's place in launch order (pid 0 varies slowest, as the interpreter walks)."""
        x, y, z = _as_program(program)
        _, gy, gz = self.grid
        return (x * gy + y) * gz + z

    def select(self, tensor=None, kind=None, program=None) -> list[Access]:
        """The accesses matching every criterion given (None matches all)."""
        if kind not in (None, "load", "store"):
            raise ValueError(f"kind must be 'load', 'store' or None, got {kind!r}")
        if tensor is not None and tensor not in self.tensors:
            raise ValueError(f"tensor must be one of the tensor arguments {list(self.tensors)}, got {tensor!r}")
        wanted = None if program is None else _as_program(program)
        return [a for a in self.accesses
                if (tensor is None or a.tensor == tensor) and (kind is None or a.kind == kind)
                and (wanted is None or a.program == wanted)]

    def offsets(self, tensor, kind=None, program=None) -> tuple[int, ...]:
        """The active offsets of ``tensor`` touched by the matching accesses, in order."""
        return tuple(o for a in self.select(tensor, kind, program) for o in a.offsets)

    def out_of_bounds(self, tensor=None, kind=None, program=None) -> tuple[int, ...]:
        return tuple(o for a in self.select(tensor, kind, program) for o in a.out_of_bounds)

    def summary(self) -> str:
        """One line per program and tensor: which offsets it loaded and stored (ranges as a-b)."""
        lines = [f"{self.kernel_name}, grid {self.grid}"]
        for program in self.programs():
            for name in self.tensors:
                for kind in ("load", "store"):
                    chosen = self.select(name, kind, program)
                    if not chosen:
                        continue
                    touched = sorted({o for a in chosen for o in a.offsets})
                    masked = sorted({o for a in chosen for o in a.masked_offsets} - set(touched))
                    outside = sorted({o for a in chosen for o in a.out_of_bounds})
                    text = f"program {_program_label(program, self.grid)}: {kind} {name} {_ranges(touched)}"
                    if masked:
                        text += f", masked off {_ranges(masked)}"
                    if outside:
                        text += f", OUT OF BOUNDS {_ranges(outside)}"
                    lines.append(text)
        stray = [a for a in self.accesses if a.tensor is None]
        if stray:
            lines.append(f"{len(stray)} accesses fell outside every tensor argument")
        return "\n".join(lines)


def _as_program(program) -> tuple[int, int, int]:
    if isinstance(program, (int, np.integer)) and not isinstance(program, bool):
        return (int(program), 0, 0)
    if isinstance(program, tuple) and 1 <= len(program) <= 3 and all(isinstance(p, int) for p in program):
        return tuple(program) + (0,) * (3 - len(program))
    raise TypeError(f"program must be an int or a tuple of up to 3 ints, got {program!r}")


def _grid_rank(grid) -> int:
    """How many grid axes are in use: 1 for (4, 1, 1), 2 for (2, 3, 1)."""
    return max([1] + [axis + 1 for axis, size in enumerate(grid) if size > 1])


def _program_label(program, grid) -> str:
    rank = _grid_rank(grid)
    return str(program[0]) if rank == 1 else str(tuple(program[:rank]))


def _ranges(values) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7'."""
    if not values:
        return "none"
    parts, start, previous = [], values[0], values[0]
    for value in list(values[1:]) + [None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = value
    return ", ".join(parts)


# --------------------------------------------------------------------------- putting Triton back

_MISSING = object()


class _Edits:
    """Attribute and dict changes, undone in reverse order."""

    def __init__(self):
        self._undo = []

    def set_attr(self, obj, name, value):
        self._undo.append(("attr", obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    def set_item(self, mapping, name, value):
        self._undo.append(("item", mapping, name, mapping.get(name, _MISSING)))
        mapping[name] = value

    def undo(self):
        while self._undo:
            how, target, name, old = self._undo.pop()
            if how == "attr":
                if old is _MISSING:
                    delattr(target, name)
                else:
                    setattr(target, name, old)
            elif old is _MISSING:
                del target[name]
            else:
                target[name] = old


def snapshot_language() -> list[tuple[object, dict]]:
    """The namespaces of triton.language's modules and classes, to compare or restore later."""
    return [(obj, dict(vars(obj))) for obj in _language_objects()]


def _restore_language(snapshot):
    for obj, before in snapshot:
        now = vars(obj)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)
        if isinstance(obj, type):  # a module may gain submodules on import; keep those
            for name in set(now) - set(before):
                delattr(obj, name)


def _interpreted(kernel, edits: _Edits) -> InterpretedFunction:
    """The kernel as an InterpretedFunction; in GPU mode, with every JITFunction it can reach
    (its helpers and triton.language's own, such as tl.zeros) swapped for an interpreted twin."""
    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")
    # Triton imports gluon on a launch's first tensor argument, and gluon checks then that
    # triton.language's functions are JITFunctions: import it before any is swapped.
    with contextlib.suppress(ImportError):
        importlib.import_module("triton.experimental.gluon")
    twins = {}

    def twin(jit_fn):  # keyed by id: hashing a JITFunction walks its dependencies, swapped or not
        if id(jit_fn) not in twins:
            twins[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
        return twins[id(jit_fn)]

    # Module globals are plain dicts; a class's namespace is read-only, so it is set attribute-wise.
    pending = [(kernel.fn.__globals__, None)] + [(vars(obj), obj) for obj in _language_objects()]
    seen = set()
    while pending:
        namespace, cls = pending.pop()
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction):
                if isinstance(cls, type):
                    edits.set_attr(cls, name, twin(value))
                else:
                    edits.set_item(namespace, name, twin(value))
                pending.append((value.fn.__globals__, None))
    return twin(kernel)


# --------------------------------------------------------------------------- recording


def _tensor_arguments(kernel_fn, args, kwargs) -> dict[str, TensorInfo]:
    try:
        bound = inspect.signature(kernel_fn).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"arguments do not match {kernel_fn.__name__}: {error}") from None
    tensors = {}
    for name, value in bound.arguments.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type != "cpu":
            raise ValueError(f"{name} is on {value.device}: record runs the kernel in Triton's interpreter "
                             f"on the host, so pass CPU tensors (e.g. {name}.cpu())")
        span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
        tensors[name] = TensorInfo(name, tuple(value.shape), tuple(value.stride()), value.numel(),
                                   value.element_size(), value.data_ptr(), span if value.numel() else 0)
    return tensors


class _Recorder:
    def __init__(self, recording: Recording, code, max_lanes: int):
        self.recording = recording
        self.code = code  # the interpreted kernel's code object, to find the calling line
        self.max_lanes = max_lanes
        self.lanes_left = max_lanes
        self.builder = _interpreter_module.interpreter_builder

    def _line(self):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        if frame is None:
            return None, ""
        return frame.f_lineno, linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()

    def note(self, kind, ptrs, mask):
        addresses = np.ravel(np.asarray(ptrs.data)).astype(np.uint64)
        active = np.ravel(np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)))
        self.lanes_left -= addresses.size
        if self.lanes_left < 0:
            raise UnsupportedKernel(f"the launch touches more than max_lanes={self.max_lanes:,} lanes; record is for "
                                    f"small launches: shrink the grid or the blocks")
        program = tuple(int(i) for i in self.builder.grid_idx)
        line, source = self._line()
        # One access comes from one pointer expression, so it belongs to one tensor: the one that
        # holds most of its active lanes (most of its lanes when none is active; the first such
        # argument when tensors share memory). Its other active lanes are out of bounds, given
        # as offsets from that tensor: a read of garbage, a write over a neighbour.
        infos = list(self.recording.tensors.values())
        held = np.array([info.holds(addresses) for info in infos]).reshape(len(infos), addresses.size)
        votes = (held & active).sum(axis=1) if active.any() else held.sum(axis=1)
        if not votes.any():
            self.recording.accesses.append(Access(program, kind, None, (), (), (), line, source,
                                                  addresses=tuple(addresses[active].tolist())))
            return
        info = infos[int(np.argmax(votes))]
        delta = addresses.astype(np.int64) - np.int64(info.data_ptr)
        if (delta % info.element_size).any():
            raise UnsupportedKernel(f"line {line}: an access to {info.name} is not aligned to its "
                                    f"{info.element_size}-byte elements")
        offsets = delta // info.element_size
        outside = ~info.is_element(offsets)
        self.recording.accesses.append(Access(
            program, kind, info.name, tuple(offsets[active].tolist()), tuple(offsets[~active].tolist()),
            tuple(offsets[active & outside].tolist()), line, source))

    def wrappers(self):
        original_load = self.builder.create_masked_load
        original_store = self.builder.create_masked_store

        def create_masked_load(ptrs, mask, *rest, **kwargs):
            self.note("load", ptrs, mask)
            return original_load(ptrs, mask, *rest, **kwargs)

        def create_masked_store(ptrs, value, mask, *rest, **kwargs):
            self.note("store", ptrs, mask)
            return original_store(ptrs, value, mask, *rest, **kwargs)

        def refuse_atomic(*args, **kwargs):
            line, source = self._line()
            raise UnsupportedKernel(f"record cannot follow atomic operations (line {line}: {source})")

        wrappers = {"create_masked_load": create_masked_load, "create_masked_store": create_masked_store}
        wrappers.update({name: refuse_atomic for name in _UNRECORDED_METHODS
                         if hasattr(self.builder, name)})
        return wrappers


def _check_interface():
    builder = getattr(_interpreter_module, "interpreter_builder", None)
    missing = [name for name in _BUILDER_METHODS if not callable(getattr(builder, name, None))]
    if builder is None or missing or not callable(getattr(builder, "set_grid_idx", None)):
        raise RuntimeError(
            f"triton {triton.__version__}'s interpreter has no module-level interpreter_builder with "
            f"{', '.join(_BUILDER_METHODS)} and a grid: ttx_tutorial.course.trace was written for the "
            f"interpreters of Triton 3.6 to 3.9 and cannot record with this one")


def run_interpreted(kernel, grid, *args, **kwargs):
    """Run ``kernel[grid](*args, **kwargs)`` in Triton's interpreter, in CPU mode and GPU mode
    alike, and leave ``triton.language`` as it was (every name keeps its object; the interpreter
    itself adds its own globals, once per process, to the module of each function it rewrites):
    for ``print`` and ``breakpoint()`` inside a kernel, which only the interpreter runs. Tensors
    on a GPU are copied to the host and back."""
    edits = _Edits()
    language = snapshot_language()
    try:
        _interpreted(kernel, edits)[grid](*args, **kwargs)
    finally:
        edits.undo()
        _restore_language(language)


def _run(kernel, grid, args, kwargs, max_lanes) -> Recording:
    _check_interface()
    edits = _Edits()
    language = snapshot_language()
    try:
        interpreted = _interpreted(kernel, edits)
        tensors = _tensor_arguments(interpreted.fn, args, kwargs)
        recording = Recording(interpreted.__name__, (0, 0, 0), tensors)
        # The interpreter runs a rewritten copy of the kernel (assignments and comparisons wrapped);
        # the line of an access is found by looking for the code object that actually runs.
        running = interpreted.rewrite() if hasattr(interpreted, "rewrite") else interpreted.fn
        recorder = _Recorder(recording, running.__code__, max_lanes)
        for name, wrapper in recorder.wrappers().items():
            edits.set_attr(recorder.builder, name, wrapper)
        try:
            interpreted[grid](*args, **kwargs)
        except Exception as error:  # the interpreter wraps what the kernel raised in its own error
            if isinstance(error.__cause__, UnsupportedKernel):
                raise UnsupportedKernel(str(error.__cause__)) from None
            raise
        recording.grid = tuple(int(g) for g in recorder.builder.grid_dim)
        return recording
    finally:
        edits.undo()
        _restore_language(language)


@triton.jit
def _probe_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs + 1, tl.load(x_ptr + offs, mask=offs < 1), mask=offs < 1)


_PROBE_PASSED = False


def _probe():
    """Record a kernel whose accesses are known, once per process, before trusting any recording."""
    global _PROBE_PASSED
    if _PROBE_PASSED:
        return
    x, y = torch.ones(2), torch.zeros(2)
    recording = _run(_probe_kernel, (1,), (x, y), {"BLOCK": 2}, MAX_LANES)
    seen = [(a.kind, a.tensor, a.offsets, a.masked_offsets) for a in recording.accesses]
    expected = [("load", "x_ptr", (0,), (1,)), ("store", "y_ptr", (1,), (2,))]
    if seen != expected or y.tolist() != [0.0, 1.0]:
        raise RuntimeError(f"triton {triton.__version__}'s interpreter did not report a known kernel's "
                           f"loads and stores as ttx_tutorial.course.trace expects ({seen} instead of "
                           f"{expected}); it was written for Triton 3.6 to 3.9")
    _PROBE_PASSED = True


def record(kernel, grid, *args, max_lanes: int = MAX_LANES, **kwargs) -> Recording:
    """Run ``kernel[grid](*args, **kwargs)`` in Triton's interpreter and record its loads and stores.

    Args:
        kernel: a ``@triton.jit`` function (run interpreted whatever the mode).
        grid: the launch grid, as for ``kernel[grid]``: a tuple of up to three ints, or a
            function of the meta-parameters returning one.
        args, kwargs: the kernel's arguments; tensors must be CPU tensors. The kernel really
            runs: outputs are written, and so is anything an unmasked store reaches.
        max_lanes: refuse launches that touch more lanes than this (recordings live in memory).

    Returns a :class:`Recording`. Raises ``TypeError``/``ValueError`` for bad arguments,
    :class:`UnsupportedKernel` (a ``ValueError``) for kernels with atomics, and ``RuntimeError``
    if the installed Triton's interpreter does not work as this module expects.
    """
    if isinstance(max_lanes, bool) or not isinstance(max_lanes, int) or max_lanes < 1:
        raise ValueError(f"max_lanes must be a positive int, got {max_lanes!r}")
    _probe()
    return _run(kernel, grid, args, kwargs, max_lanes)


# --------------------------------------------------------------------------- drawing


def draw(recording: Recording, tensors=None, *, columns=None, title=None):
    """One panel per tensor and kind (loads, stores), each element coloured by the program that
    touched it and numbered with that program's place in launch order. Hatched cells were
    computed by a program but masked off, and are hatched in that program's colour; red-edged
    cells lie outside the tensor and were touched anyway; black cells were touched by several
    programs. The legend lists only the kinds of cell the picture shows.

    Args:
        recording: from :func:`record`.
        tensors: argument names to draw, in order (default: every tensor that was touched).
        columns: elements per row. Default: the row stride of a row-major tensor of two or more
            dimensions (a matrix is drawn as a matrix, with the padding of a view's rows
            blank), else one row of memory offsets. Cells are memory offsets either way.
        title: the figure's title (default: the kernel's name and grid).

    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if not isinstance(recording, Recording):
        raise TypeError(f"recording must come from ttx_tutorial.course.trace.record, got {type(recording).__name__}")
    names = [name for name in recording.tensors if recording.select(name)] if tensors is None else list(tensors)
    unknown = [name for name in names if name not in recording.tensors]
    if unknown:
        raise ValueError(f"tensors {unknown} are not tensor arguments of the launch: {list(recording.tensors)}")
    if columns is not None and (isinstance(columns, bool) or not isinstance(columns, int) or columns < 1):
        raise ValueError(f"columns must be a positive int, got {columns!r}")
    panels = [(name, kind) for name in names for kind in ("load", "store") if recording.select(name, kind)]
    if not panels:
        raise ValueError("nothing to draw: the launch touched none of these tensors")

    cells = sum(max([recording.tensors[name].span - 1, *recording.offsets(name, kind)]) + 1
                for name, kind in panels)  # at least: each panel runs from offset 0 to its highest
    if cells > MAX_DRAWN_CELLS:
        raise ValueError(f"{cells:,} cells to draw, more than {MAX_DRAWN_CELLS:,}: record a smaller launch "
                         f"or pass fewer tensors")

    programs = recording.programs()
    palette = plt.get_cmap("tab10" if len(programs) <= 10 else "tab20").colors
    colour_of = {p: palette[i % len(palette)] for i, p in enumerate(programs)}

    layouts = []
    for name, kind in panels:
        info = recording.tensors[name]
        owners, masked = {}, {}
        for access in recording.select(name, kind):
            for offset in access.offsets:
                owners.setdefault(offset, set()).add(access.program)
            for offset in access.masked_offsets:
                masked.setdefault(offset, set()).add(access.program)
        low = min([0, *owners, *masked])
        high = max([info.span - 1, *owners, *masked])
        as_matrix = info.row_length is not None
        width = columns or (info.row_length if as_matrix else high - low + 1)
        first_row = low // width if (columns or as_matrix) else 0
        shift = 0 if (columns or as_matrix) else -low  # a single row starts at the lowest offset
        rows = (high + shift) // width - first_row + 1
        layouts.append((name, kind, info, owners, masked, low, high, width, first_row, shift, rows))

    heights = [layout[-1] for layout in layouts]
    widest = max(layout[7] for layout in layouts)
    figure, axes = plt.subplots(len(layouts), 1, squeeze=False, layout="constrained",
                                gridspec_kw={"height_ratios": heights},
                                figsize=(min(14.0, 2.5 + 0.42 * widest), 0.8 + sum(0.42 * h + 0.45 for h in heights)))
    # The legend names only what some panel shows, so a reader does not look for red cells that are not there.
    shared = hatched = untouched = outside = False
    for ax, (name, kind, info, owners, masked, low, high, width, first_row, shift, rows) in zip(axes[:, 0], layouts):
        every_offset = np.arange(low, high + 1)
        for offset, inside in zip(every_offset.tolist(), info.is_element(every_offset).tolist()):
            row, x = divmod(offset + shift, width)
            y = row - first_row
            if offset in owners:
                who = owners[offset]
                shared |= len(who) > 1
                outside |= not inside
                face = colour_of[next(iter(who))] if len(who) == 1 else "black"
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="white" if inside else "red",
                                       lw=1 if inside else 2.5))
                if len(who) == 1:
                    ax.text(x + 0.5, y + 0.5, str(recording.program_number(next(iter(who)))),
                            ha="center", va="center", fontsize=7, color="white")
            elif offset in masked:
                hatched = True
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor="white", hatch="////",
                                       edgecolor=colour_of[next(iter(masked[offset]))], lw=0.5))
            elif inside:
                untouched = True
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor="0.9", edgecolor="white", lw=1))
        ax.set(xlim=(-0.1, width + 0.1), ylim=(rows + 0.1, -0.1), xticks=[], yticks=[], aspect="equal")
        ax.spines[:].set_visible(False)
        shape = " x ".join(map(str, info.shape))
        ax.set_title(f"{name} ({shape}), {kind}s", fontsize=9, loc="left")

    def legend_label(program):
        number, label = recording.program_number(program), _program_label(program, recording.grid)
        return f"program {label}" if str(number) == label else f"{number}: program {label}"

    handles = [Patch(facecolor=colour_of[p], label=legend_label(p)) for p in programs[:len(palette)]]
    if hatched:
        handles.append(Patch(facecolor="white", hatch="////", edgecolor="0.3",
                             label="masked off (hatched in\nthe program's colour)"))
    if untouched:
        handles.append(Patch(facecolor="0.9", label="not touched"))
    if outside:
        handles.append(Patch(facecolor="white", edgecolor="red", lw=2.5, label="outside the tensor"))
    if shared:
        handles.append(Patch(facecolor="black", label="several programs"))
    figure.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    grid = recording.grid[:_grid_rank(recording.grid)]
    figure.suptitle(title or f"{recording.kernel_name}, grid {grid}", fontsize=10)
    return figure
