"""GPU figures: timed live (``time_ms``) or recorded by ``benchmarks/gpu_check.py``, one
recording at a time.

Timings belong in benchmarks and notebooks, never in tests. On a GPU, ``time_ms`` is the
median of ``triton.testing.do_bench`` (CUDA events, warm-up excluded). Under the CPU
interpreter it is the median wall time of a few runs: useful to compare growth with T,
meaningless as GPU performance.
"""

from __future__ import annotations

import json
import statistics
import time
from importlib import resources
from typing import Any

from .. import _device


def time_ms(fn, *, warmup: int = 25, rep: int = 100, cpu_repeats: int = 3) -> float:
    """Median milliseconds of ``fn()``. ``warmup``/``rep`` are milliseconds on the GPU."""
    if not _device.INTERPRETED:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()  # first call compiles / rewrites the kernel
    samples = []
    for _ in range(cpu_repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def load_recorded(name: str = "h200") -> dict:
    """The figures recorded on a GPU by ``benchmarks/gpu_check.py``.

    Returns ``{"env": {...}, "rows": [...]}``; ``env`` names the card, versions and date,
    and each row is ``{"shape": [B, H, T, D, E], "impl": str, "mode": "fwd" | "fwd+bwd",
    "dtype": str, "ms": float | None, "rel_err": float | None, "config": str | None}``, with
    "run" (``env["commands"]`` says how it was made) and, in later runs, "gpu_ms" (the same
    call replayed from a CUDA graph: GPU time alone) and "rounds_ms" (the timings of the
    alternating rounds whose median is "ms").
    """
    text = resources.files("ttx_tutorial.course").joinpath("data", f"{name}.json").read_text()
    return json.loads(text)


def recording_name(env: dict[str, Any], command: str) -> str:
    """How a recording is named: date, GPU, versions and the command that made it."""
    return (f"{env['date']} {env['gpu']}, torch {env['torch']}, triton {env['triton']}: "
            f"{command}")


def rows_of_one_recording(recorded: dict[str, Any], **match: Any) -> tuple[str, list[dict[str, Any]]]:
    """The rows of ``recorded`` (from ``load_recorded``) whose fields
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
