"""Small helpers for the notebooks: the mode banner, problem sizes that fit the mode, excerpts
of source code, progress for long cells, and the recorded GPU figures, one recording at a time."""

from __future__ import annotations

import inspect
import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import triton

from . import _device

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


def describe() -> str:
    """One line: which mode runs the kernels, and the versions that matter."""
    from . import __version__

    if on_gpu():
        where = f"GPU mode: kernels compiled for CUDA ({_device.REASON})"
    else:
        where = f"CPU mode: Triton interpreter, TRITON_INTERPRET=1 ({_device.REASON})"
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


# --- recorded GPU figures -------------------------------------------------------------------

def recording_name(env: dict[str, Any], command: str) -> str:
    """How a recording is named: date, GPU, versions and the command that made it."""
    return (f"{env['date']} {env['gpu']}, torch {env['torch']}, triton {env['triton']}: "
            f"{command}")


def rows_of_one_recording(recorded: dict[str, Any], **match: Any) -> tuple[str, list[dict[str, Any]]]:
    """The rows of ``recorded`` (from ``ttx_tutorial.benchmark.load_recorded``) whose fields
    equal ``match`` (``shape_prefix=(B, H)`` and ``shape_suffix=(D, E)`` compare parts of the
    shape), as ``(recording name, rows)``.

    A figure must show one recording: rows of two recordings were taken on different code or a
    differently loaded machine, so a selection that spans several raises ``ValueError`` naming
    them; add ``recording=...`` to choose one. No matching row raises ``LookupError``.
    """
    prefix = tuple(match.pop("shape_prefix", ()))
    suffix = tuple(match.pop("shape_suffix", ()))
    rows = [row for row in recorded["rows"]
            if all(row.get(key) == value for key, value in match.items())
            and tuple(row["shape"][:len(prefix)]) == prefix
            and (not suffix or tuple(row["shape"][-len(suffix):]) == suffix)]
    if not rows:
        raise LookupError(f"no recorded row matches {match}")
    names = list(dict.fromkeys(row["recording"] for row in rows))
    if len(names) > 1:
        raise ValueError("these rows come from " + str(len(names)) + " recordings; a figure shows one:\n  "
                         + "\n  ".join(names))
    return names[0], rows


def latest_recording(recorded: dict[str, Any], **match: Any) -> tuple[str, list[dict[str, Any]]]:
    """Like :func:`rows_of_one_recording`, but when the rows span several recordings, those of
    the one listed last in ``recorded["recordings"]`` (the file lists them oldest first)."""
    try:
        return rows_of_one_recording(recorded, **match)
    except ValueError:
        pass
    probe = dict(match)
    prefix, suffix = probe.pop("shape_prefix", ()), probe.pop("shape_suffix", ())
    for name in reversed(list(recorded["recordings"])):
        try:
            return rows_of_one_recording(recorded, recording=name, shape_prefix=prefix,
                                         shape_suffix=suffix, **probe)
        except LookupError:
            continue
    raise LookupError(f"no recorded row matches {match}")


def recording_caption(recorded: dict[str, Any], name: str) -> str:
    """One line that says where a figure's numbers come from."""
    recording = recorded["recordings"][name]
    return f"recorded {name}" + (f" ({recording['note']})" if recording.get("note") else "")
