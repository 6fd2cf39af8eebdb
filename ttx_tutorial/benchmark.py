"""Timing helpers and the GPU figures recorded by ``benchmarks/gpu_check.py``.

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

from . import _device


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
    text = resources.files("ttx_tutorial").joinpath("data", f"{name}.json").read_text()
    return json.loads(text)
