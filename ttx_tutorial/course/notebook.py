"""Small helpers for the notebooks: the mode banner, problem sizes that fit the mode, excerpts
of source code and progress for long cells (GPU figures: :mod:`ttx_tutorial.course.figures`)."""

from __future__ import annotations

import inspect
import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import triton

from .. import _device

T = TypeVar("T")


def on_gpu() -> bool:
    """True when kernels are compiled for and run on a CUDA GPU."""
    return not _device.INTERPRETED


def size(cpu: T, gpu: T) -> T:
    """Pick a problem size: ``gpu`` on a GPU, the smaller ``cpu`` under the interpreter.

    The interpreter executes each Triton program in NumPy, thousands of times slower
    than a GPU, so notebooks shrink their problems through this one helper.
    """
    return gpu if on_gpu() else cpu


def triton_imported_first() -> bool:
    """Whether CPU mode came too late for Triton: imported before ttx_tutorial set
    TRITON_INTERPRET, Triton's own @jit functions (tl.sum, tl.cumsum, ...) were made for a GPU and
    refuse to run in the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    from triton.runtime.interpreter import InterpretedFunction

    return _device.INTERPRETED and not isinstance(triton.language.standard.sum, InterpretedFunction)


#: What the banner says when Triton was imported before ttx_tutorial.
IMPORTED_FIRST = ("but Triton was imported before ttx_tutorial, so tl.sum and Triton's other own functions will not "
                  "run: restart the kernel and import ttx_tutorial first")


def describe() -> str:
    """One line: which mode runs the kernels, and the versions that matter."""
    from .. import __version__

    if on_gpu():
        where = f"GPU mode: kernels compiled for CUDA ({_device.REASON})"
    else:
        where = f"CPU mode: Triton interpreter, TRITON_INTERPRET=1 ({_device.REASON})"
        if triton_imported_first():
            where += f", {IMPORTED_FIRST}"
    return (f"ttx_tutorial {__version__} | {where} | python {platform.python_version()} | "
            f"torch {torch.__version__} | triton {triton.__version__}")


def banner() -> str:
    """The first output of every notebook: the mode in capitals, what it means for the cells
    below, and :func:`describe`'s line.

    A saved notebook keeps the banner of the machine it last ran on, so the CPU banner also
    tells a learner with a GPU to re-run: until then every output below is a CPU-mode output.
    """
    if on_gpu():
        lines = [f"GPU MODE on {torch.cuda.get_device_name()}: kernels are compiled for this GPU.",
                 "Cells marked 'GPU only' measure live on it."]
    else:
        lines = ["CPU MODE: kernels run in Triton's interpreter, one program after another, on the CPU.",
                 "Problem sizes are small; GPU-only settings (num_warps, num_stages, caches, memory",
                 "ordering) have no effect here, and timings say nothing about a GPU.",
                 "Have an NVIDIA GPU? These outputs were made without one: run all cells again",
                 "(Kernel > Restart Kernel and Run All Cells) and this banner will say GPU MODE."]
    if triton_imported_first():
        lines = ["CPU MODE, BUT TRITON WAS IMPORTED BEFORE ttx_tutorial: tl.sum and Triton's other own",
                 "functions will not run in the interpreter. Restart the kernel and import ttx_tutorial first."]
    rule = "=" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, describe(), rule])


def excerpt(function: Callable[..., Any], start: str, stop: str | None = None) -> str:
    """The lines of ``function``'s source from the one containing ``start`` up to, not
    including, the next one containing ``stop`` (with ``stop=None``: to the function's end).

    A ``@triton.jit`` kernel is read through its ``.fn``. A marker that is missing, or found
    more than once, raises ``ValueError``: a notebook must never print a whole function where
    its text promises a few lines.
    """
    source = inspect.getsource(getattr(function, "fn", function))
    lines = source.splitlines()
    name = getattr(function, "__name__", None) or getattr(getattr(function, "fn", None), "__name__", "?")
    first = _only_line(lines, start, 0, name, "start")
    if stop is None:
        return "\n".join(lines[first:])
    last = next((i for i in range(first + 1, len(lines)) if stop in lines[i]), None)
    if last is None:
        raise ValueError(f"excerpt of {name}: stop marker {stop!r} not found after {start!r}")
    return "\n".join(lines[first:last])


def _only_line(lines: Sequence[str], marker: str, begin: int, name: str, which: str) -> int:
    found = [i for i in range(begin, len(lines)) if marker in lines[i]]
    if not found:
        raise ValueError(f"excerpt of {name}: {which} marker {marker!r} not found")
    if len(found) > 1:
        raise ValueError(f"excerpt of {name}: {which} marker {marker!r} is on {len(found)} lines "
                         f"({', '.join(str(i + 1) for i in found)}); make it unique")
    return found[0]


def progress(items: Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    """Yield ``items`` while rewriting one status line (``label: 3/8``) on stderr, so that a
    long cell shows that it is working. stderr is never compared by the notebook tests."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    count = 0
    for count, item in enumerate(items, start=1):
        sys.stderr.write(f"\r{label}: {count}/{total if total is not None else '?'}")
        sys.stderr.flush()
        yield item
    sys.stderr.write(f"\r{label}: {count}/{total if total is not None else count} done\n")
    sys.stderr.flush()
