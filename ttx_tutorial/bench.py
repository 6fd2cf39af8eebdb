"""Time every method of ``causal_product``, and its peers where they are installed.

    python -m ttx_tutorial.bench                      # the reference shapes and the sweep over T (GPU sizes)
    python -m ttx_tutorial.bench --quick              # small sizes: minutes on a GPU, seconds on a CPU
    python -m ttx_tutorial.bench --shapes '8,16,4096,64;1,8,65536,64' --sweep '' --dtypes bfloat16

Two parts: "shapes", the reference grid of (B, H, T, D, E) (``--shapes``), and "sweep", T in
powers of two at one (B, H, D, E) (``--sweep``), which the notebooks draw against T (in
bfloat16 and forward: ``--dtypes bfloat16 --modes fwd`` records just that). Every (shape, dtype, mode) point times each contender forward ("fwd") and forward+backward
("fwd+bwd") through public functions only: ``ttx_tutorial.causal_product`` for every method
of ``ttx_tutorial.METHODS``, and as peers, when importable, fla's ``chunk_linear_attn``,
``fused_chunk_linear_attn`` and ``fused_recurrent_linear_attn`` (``scale=1.0,
normalize=False``, on its (B, T, H, D) layout, transposed outside the timed region),
fast-transformers' ``causal_dot_product`` (float32 only) and PyTorch's causal
``scaled_dot_product_attention`` (softmax attention: where linear attention starts to pay).
float32 runs under PyTorch's setting (``torch.get_float32_matmul_precision()``, "highest" by
default); ``--float32-settings high`` also times chunked and scan, whose float32 products follow
it, under "high" (TF32, as fla's float32), as rows named ``chunked@high`` and ``scan@high`` that
``bench.md`` sets against the peers in a table of their own.
Each row reports:

- ``ms``: one call, the median of ``triton.testing.do_bench`` (CPU mode: the median wall time
  of a few calls; it says how the interpreter scales, nothing about a GPU);
- ``host_us``: the host's time per call in a loop that never waits for the GPU (what Python,
  the launcher and autograd cost; a call is host-bound when this exceeds ``gpu_ms``; in CPU
  mode, where the host does everything, the mean of the timed calls);
- ``gpu_ms``: the call replayed from a CUDA graph, the GPU's time alone (GPU mode only; none
  for fast-transformers, whose kernels launch on the legacy default stream, outside the capture);
- ``rel_err``: forward rows, ||o - ref|| / ||ref|| against float64 on batch 0 and up to two
  heads (for softmax attention, against float64 softmax attention on the last 256 queries);
- ``float32_products``: float32 rows of chunked and scan, the products PyTorch's setting gave
  their tensor cores (the kernel file's ``float32_precision()``: "bf16x3_manual", the split into
  bfloat16 parts that "highest" takes where it runs right, "tf32x3" or "tf32"); None elsewhere;
- ``floor_ms`` and ``bandwidth_TBps``: the bytes the operation must move at least (read q, k,
  v, write o; the backward also reads q, k, v and the output gradient and writes three
  gradients) over the device-to-device copy bandwidth measured at the start of the same run,
  and those bytes over ``ms``.

A point a contender cannot take (a dtype it refuses, a reference that would not fit in
memory) is skipped and says why in ``note``; a failure is reported there too, and the run goes on.
fla's kernels autotune on their first call at each new point: 20 to 50 s a row on an H200.
Triton keeps the configurations they pick in its cache (``TRITON_CACHE_DIR``; fla's
``FLA_CACHE_RESULTS``, on by default), so a second run on the same machine, or on one given
that cache's ``*.autotune.json`` files, times the same rows in about a second each.
The grid is a list of ``triton.testing.Benchmark`` (x: T, lines: contenders) walked here
rather than by ``Mark.run``, which needs pandas and keeps one number per point.

Output in ``--out``: ``bench.csv``, ``bench.json`` (the environment and every row; rewritten
after each row while the run lasts, with ``"complete": false``), ``bench.md`` (the reference
shapes as Markdown tables, one per dtype, in the README's form) and PNG plots, per part and
dtype: time per call against T (the sweep) or per shape, and the achieved bandwidth against the
copy ceiling. ``--record FILE`` merges the rows into a recorded-data file (the
format of ``ttx_tutorial/course/data/h200.json``) as one recording named by date, device, versions and
command, see ``record`` in this module.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.testing

import ttx_tutorial
from ttx_tutorial import _device, api
from ttx_tutorial.kernels import chunked, scan
from ttx_tutorial.testing import random_inputs, reference, relative_error

#: (B, H, T, D, E) of the reference grid.
REFERENCE_SHAPES = ((8, 16, 4096, 64, 64), (8, 16, 4096, 128, 128), (2, 16, 16384, 128, 128),
                    (1, 8, 65536, 64, 64))
#: The sweep the notebooks draw: (B, H, D, E) and the sequence lengths T.
SWEEP = ((1, 8, 64, 64), tuple(2**p for p in range(8, 17)))
#: ``--quick``: on a GPU, sizes that run in a few minutes; in CPU mode, sizes the interpreter
#: runs in seconds (one shape with T not a multiple of 16 and D != E: tails are masked).
QUICK_SHAPES = {"gpu": ((4, 8, 1024, 64, 64), (1, 8, 8192, 128, 128)),
                "cpu": ((1, 2, 16, 16, 16), (1, 1, 20, 8, 16))}
QUICK_SWEEP = {"gpu": ((1, 8, 64, 64), (256, 1024, 4096)), "cpu": ((1, 1, 16, 16), (8, 16))}
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: How recorded rows name dtypes.
DTYPE_LABELS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PEERS = ("fla_chunk", "fla_fused_chunk", "fla_fused_recurrent", "fast_transformers_cuda", "sdpa_softmax")
#: The loop reference takes T Python steps a call: longer sequences take minutes a point.
LOOP_MAX_T = 4096
#: Timed calls per point in CPU mode, after the first (which compiles): the median of three.
CPU_CALLS = 3
#: Queries whose softmax attention is checked against float64 (all of them when T is smaller).
SOFTMAX_CHECKED_QUERIES = 256


@dataclass(frozen=True)
class Contender:
    """One line of the benchmark: a function of (q, k, v) returning o."""

    name: str
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    dtypes: tuple[torch.dtype, ...]
    time_major: bool = False  # fla: (B, T, H, D) in and out
    softmax: bool = False  # another function: checked against float64 softmax attention
    #: Why a CUDA graph cannot hold its calls, or None: a graph then times nothing of them.
    no_graph: str | None = None
    #: A ``torch.set_float32_matmul_precision`` setting its calls run under, or None: the run's.
    float32_setting: str | None = None


def method_contenders(names: Iterable[str]) -> list[Contender]:
    def through_api(name):
        return lambda q, k, v: ttx_tutorial.causal_product(q, k, v, name)

    return [Contender(name, through_api(name), tuple(ttx_tutorial.method_info(name).dtypes))
            for name in names]


#: Settings of ``torch.set_float32_matmul_precision`` that ``--float32-settings`` takes.
FLOAT32_SETTINGS = ("highest", "high", "medium")


def setting_contenders(names: Iterable[str], settings: Iterable[str]) -> list[Contender]:
    """For each setting, the methods among ``names`` whose float32 products follow PyTorch's
    setting (chunked and scan), named ``METHOD@SETTING``, float32 only."""
    return [replace(contender, name=f"{contender.name}@{setting}", dtypes=(torch.float32,), float32_setting=setting)
            for setting in settings
            for contender in method_contenders(name for name in names if name in _FLOAT32_PRECISION_OF)]


def method_of(impl: str) -> str:
    """The method or peer a row's ``impl`` times: ``chunked@high`` times chunked."""
    return impl.split("@")[0]


def _setting_of(impl: str) -> str | None:
    """The float32 setting a row of ours ran under (``chunked@high``: "high"), None for the run's."""
    return impl.split("@")[1] if "@" in impl else None


def peer_contenders(names: Iterable[str]) -> tuple[list[Contender], dict[str, str]]:
    """The peers that can run here, and why each other one cannot."""
    found, missing = [], {}
    for name in names:
        try:
            found.append(_peer(name))
        except Exception as exc:  # noqa: BLE001  optional: say why it is left out
            missing[name] = _reason(exc)
    return found, missing


def _peer(name: str) -> Contender:
    if name == "sdpa_softmax":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return Contender(name, lambda q, k, v: sdpa(q, k, v, is_causal=True),
                         (torch.float32, torch.float16, torch.bfloat16), softmax=True)
    if _device.INTERPRETED:
        raise RuntimeError("GPU kernels: not run in CPU mode")
    if name == "fast_transformers_cuda":
        from fast_transformers.causal_product import causal_dot_product

        return Contender(name, causal_dot_product, (torch.float32,),
                         no_graph="its kernels launch on the legacy default stream, outside a graph's capture")
    from fla.ops import linear_attn

    function = {"fla_chunk": linear_attn.chunk_linear_attn,
                "fla_fused_chunk": linear_attn.fused_chunk_linear_attn,
                "fla_fused_recurrent": linear_attn.fused_recurrent_linear_attn}[name]
    return Contender(name, lambda q, k, v: function(q, k, v, scale=1.0, normalize=False)[0],
                     (torch.float32, torch.float16, torch.bfloat16), time_major=True)


# --- timing ----------------------------------------------------------------------------------

def timed_calls(fn: Callable[[], object], leaves: list[torch.Tensor]) -> tuple[float, float]:
    """(ms, host_us) of ``fn()``: the median of ``do_bench`` (``leaves``' gradients cleared
    before each call), and :func:`host_us`, its gradients accumulating as in a training loop.
    In CPU mode all work is the host's: both come from the same few calls."""
    if _device.INTERPRETED:
        samples = []
        for _ in range(CPU_CALLS):
            for leaf in leaves:
                leaf.grad = None
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples), statistics.mean(samples) * 1e3
    ms = float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median"))
    return ms, host_us(fn, calls=max(3, min(100, int(50 / max(ms, 1e-3)))))  # few calls when slow


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds of host time per call: ``calls`` calls enqueued without waiting for the GPU,
    which is waited for once at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_ms(fn: Callable[[], object], leaves: Iterable[torch.Tensor] = ()) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: the GPU's time, no host in the
    way. The leaves start the capture without gradients, so that the graph writes fresh ones as
    ``do_bench(grad_to_none=...)`` lets each call do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up allocator and autotuners outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_TBps(quick: bool) -> float:
    """Device-to-device copy, bytes read + written per second: the ceiling of a memory-bound kernel."""
    elements = (1 << 26 if quick else 1 << 28) if not _device.INTERPRETED else 1 << 22
    source = torch.randn(elements, device=_device.DEVICE)
    destination = torch.empty_like(source)
    ms, _ = timed_calls(lambda: destination.copy_(source), [])
    return 2 * source.numel() * source.element_size() / (ms * 1e-3) / 1e12


def floor_bytes(shape: tuple[int, ...], dtype: torch.dtype, mode: str) -> int:
    """The bytes an implementation must move at least: the forward reads q, k, v and writes o;
    the backward reads q, k, v and dO and writes dQ, dK, dV."""
    B, H, T, D, E = shape
    per_token = 2 * D + 2 * E
    if mode == "fwd+bwd":
        per_token += (2 * D + 2 * E) + (2 * D + E)
    return B * H * T * per_token * torch.empty((), dtype=dtype).element_size()


def too_large(name: str, shape: tuple[int, ...], mode: str) -> str | None:
    """Why a reference would not finish or fit at this point, or None."""
    B, H, T, D, E = shape
    backward = 2 if mode == "fwd+bwd" else 1
    if name == "loop":
        if T > LOOP_MAX_T:
            return f"skipped: loop takes T Python steps a call, timed up to T = {LOOP_MAX_T}"
        needed = (T if backward == 2 else 3) * B * H * D * E * 4  # the backward keeps every state
    elif name == "cumsum":
        needed = 3 * backward * B * H * T * D * E * 4  # every k_t v_t^T, their cumulative sum, S_t
    elif name == "quadratic":
        needed = 3 * backward * B * H * T * T * 4  # the T x T scores, their mask and product
    else:
        return None
    available = _available_memory()
    if needed > available / 2:
        return (f"skipped: {name} needs about {needed / 2**30:.1f} GiB, more than half of the "
                f"{available / 2**30:.1f} GiB free")
    return None


def _available_memory() -> int:
    """Free bytes: the GPU's, or in CPU mode the host's available pages."""
    if not _device.INTERPRETED:
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# --- one point -------------------------------------------------------------------------------

class Point:
    """The inputs of one (shape, dtype) and their float64 references, shared by all contenders."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
        B, H, T, D, E = shape
        self.shape, self.dtype = shape, dtype
        self.q, self.k, self.v = random_inputs(B, H, T, D, E, dtype=dtype, seed=seed)
        self.grad_out = torch.randn(B, H, T, E, dtype=dtype, device=self.q.device)
        self._references = {}

    def inputs(self, contender: Contender) -> tuple[torch.Tensor, ...]:
        """q, k, v and the output gradient in the contender's layout, made outside any timing."""
        tensors = (self.q, self.k, self.v, self.grad_out)
        if contender.time_major:
            return tuple(x.transpose(1, 2).contiguous() for x in tensors)
        return tensors

    def error(self, contender: Contender, o: torch.Tensor) -> float:
        if contender.time_major:
            o = o.transpose(1, 2)
        heads = slice(0, min(2, self.shape[1]))
        if contender.softmax:
            queries = slice(max(0, self.shape[2] - SOFTMAX_CHECKED_QUERIES), None)
            return relative_error(o[:1, :1, queries], self._reference("softmax"))
        return relative_error(o[:1, heads], self._reference("linear"))

    def _reference(self, kind: str) -> torch.Tensor:
        if kind not in self._references:
            heads = slice(0, min(2, self.shape[1]))
            q, k, v = (x[:1, heads] for x in (self.q, self.k, self.v))
            if kind == "linear":
                self._references[kind] = reference(q, k, v, device=q.device, chunk=2048)[0]
            else:
                self._references[kind] = _softmax_reference(q[:, :1], k[:, :1], v[:, :1])
        return self._references[kind]


def _softmax_reference(q, k, v):
    """Causal softmax attention (PyTorch's default scale) in float64, for the last queries."""
    T = q.shape[2]
    first = max(0, T - SOFTMAX_CHECKED_QUERIES)
    q, k, v = (x.double() for x in (q[:, :, first:], k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(first, T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > rows, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


#: The methods whose float32 products follow PyTorch's setting: their kernel file's
#: ``float32_precision`` (recurrent multiplies on CUDA cores, in float32 whatever the setting).
_FLOAT32_PRECISION_OF = {"chunked": chunked.float32_precision, "scan": scan.float32_precision}


@contextlib.contextmanager
def _float32_setting(setting: str | None):
    """PyTorch's float32 matmul setting ``setting`` inside the block (None: unchanged)."""
    previous = torch.get_float32_matmul_precision()
    if setting is not None:
        torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def measure(point: Point, contender: Contender, mode: str, copy_TBps: float) -> dict:
    """One row: see the module docstring for its fields. A contender with a float32 setting runs
    under it: forward, backward, the graph's capture and the products named."""
    with _float32_setting(contender.float32_setting):
        return _measure(point, contender, mode, copy_TBps)


def _measure(point: Point, contender: Contender, mode: str, copy_TBps: float) -> dict:
    row = {"shape": list(point.shape), "impl": contender.name, "mode": mode,
           "dtype": DTYPE_LABELS[point.dtype], "ms": None, "host_us": None, "gpu_ms": None,
           "rel_err": None, "float32_products": None, "floor_ms": None, "bandwidth_TBps": None, "note": None}
    products_of = _FLOAT32_PRECISION_OF.get(method_of(contender.name))
    if point.dtype == torch.float32 and products_of is not None:
        row["float32_products"] = products_of()
    if point.dtype not in contender.dtypes:
        row["note"] = f"skipped: {contender.name} takes {', '.join(DTYPE_LABELS.get(d, str(d)) for d in contender.dtypes)}"
        return row
    row["note"] = too_large(contender.name, point.shape, mode)
    if row["note"]:
        return row
    q, k, v, grad_out = point.inputs(contender)
    try:
        if mode == "fwd":
            leaves = []

            def call():
                return contender.call(q, k, v)

            row["rel_err"] = float(f"{point.error(contender, call()):.3e}")
        else:
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

            def call():
                contender.call(*leaves).backward(grad_out)

            call()
        row["ms"], row["host_us"] = timed_calls(call, leaves)
        if contender.no_graph is not None:
            row["note"] = f"no CUDA graph: {contender.no_graph}"
        elif not _device.INTERPRETED:
            try:
                row["gpu_ms"] = graph_ms(call, leaves)
            except Exception as exc:  # a host sync or an allocation a graph refuses
                row["note"] = f"no CUDA graph: {_reason(exc)}"
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001  one failing contender must not end the run
        row["note"] = f"failed: {_reason(exc)}"
        row["ms"] = row["host_us"] = None
        if not _device.INTERPRETED:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return row
    floor = floor_bytes(point.shape, point.dtype, mode)
    row["floor_ms"] = floor / (copy_TBps * 1e12) * 1e3
    row["bandwidth_TBps"] = floor / (row["ms"] * 1e-3) / 1e12
    return row


def _reason(exc: Exception) -> str:
    """An exception in one short line."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line[:160]}"


# --- the grid --------------------------------------------------------------------------------

def benchmarks(shapes, sweep, dtypes, modes, contenders) -> list[triton.testing.Benchmark]:
    """One ``Benchmark`` per (part, B, H, D, E, dtype, mode): x is T, one line per contender.
    ``args["part"]`` is "shapes" for the reference grid and "sweep" for the sweep over T."""
    groups = {}
    for B, H, T, D, E in shapes:
        groups.setdefault(("shapes", B, H, D, E), []).append(T)
    if sweep is not None:
        (B, H, D, E), lengths = sweep
        groups[("sweep", B, H, D, E)] = list(lengths)
    names = [c.name for c in contenders]
    grid = []
    for (part, B, H, D, E), lengths in groups.items():
        for dtype in dtypes:
            for mode in modes:
                label = f"{part}_{B}x{H}xTx{D}x{E}_{DTYPE_LABELS[dtype]}_{mode.replace('+', '_')}"
                grid.append(triton.testing.Benchmark(
                    x_names=["T"], x_vals=lengths, line_arg="contender", line_vals=names,
                    line_names=names, plot_name=label, xlabel="T", ylabel="ms", x_log=True, y_log=True,
                    args={"part": part, "B": B, "H": H, "D": D, "E": E, "dtype": dtype, "mode": mode}))
    return grid


def run(grid: list[triton.testing.Benchmark], contenders: list[Contender], copy_TBps: float,
        seed: int = 0, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every point of ``grid``; ``on_row(rows so far)`` after each one."""
    by_name = {c.name: c for c in contenders}
    points = {}

    @triton.testing.perf_report(grid)
    def bench_point(T, contender, part, B, H, D, E, dtype, mode):
        key = (B, H, T, D, E, dtype)
        if key not in points:
            points.clear()  # one (shape, dtype) alive at a time: the large ones fill the GPU
            _empty_cache()
            points[key] = Point((B, H, T, D, E), dtype, seed)
        row = measure(points[key], by_name[contender], mode, copy_TBps)
        row["part"] = part
        return row

    work = [(bench, T, name) for bench in bench_point.benchmarks for T in bench.x_vals for name in bench.line_vals]
    # Grouped by (shape, dtype), so that a point's inputs are made once for all its modes and
    # contenders; shapes and dtypes in the order given, so that a run cut short by a time limit
    # has measured the first ones named.
    def shape_of(item):
        bench, T, _ = item
        return bench.args["part"], bench.args["B"], bench.args["H"], T, bench.args["D"], bench.args["E"]

    shape_order = {key: i for i, key in enumerate(dict.fromkeys(map(shape_of, work)))}
    dtype_order = {dtype: i for i, dtype in enumerate(dict.fromkeys(b.args["dtype"] for b in grid))}
    work.sort(key=lambda item: (shape_order[shape_of(item)], dtype_order[item[0].args["dtype"]]))
    rows = []
    bar, write = _progress(work, "bench")
    for bench, T, name in bar:
        row = bench_point.fn(T=T, contender=name, **bench.args)
        rows.append(row)
        write(_row_line(row))
        if on_row is not None:
            on_row(rows)
    points.clear()
    return rows


def _empty_cache():
    if not _device.INTERPRETED:
        torch.cuda.empty_cache()


def _progress(items: list, label: str):
    """(iterator, print function): tqdm's bar when it is installed, else a counter line on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _counter(items, label), print
    return tqdm(items, desc=label, file=sys.stderr), tqdm.write


def _counter(items, label):
    for count, item in enumerate(items, start=1):
        sys.stderr.write(f"[{label} {count}/{len(items)}] ")
        sys.stderr.flush()
        yield item


def _row_line(row: dict) -> str:
    def number(value, fmt):
        return format(value, fmt) if value is not None else "-"

    return (f"{row['part']:6s} {str(tuple(row['shape'])):24s} {row['dtype']:4s} {row['mode']:7s} "
          f"{row['impl']:22s} {number(row['ms'], '10.4f')} ms  host {number(row['host_us'], '9.1f')} us  "
          f"GPU {number(row['gpu_ms'], '9.4f')} ms  err {number(row['rel_err'], '.1e')}"
          + (f"  ({row['note']})" if row["note"] else ""))


def summary(rows: list[dict]) -> str:
    """Per point of the reference grid: our fastest Triton method against the fastest peer of
    the same function (softmax attention excluded), fastest per call; each with its GPU and host
    time."""
    triton_methods = [name for name in ttx_tutorial.METHODS if ttx_tutorial.method_info(name).is_triton]
    header = f"{'ms':>9s} {'GPU ms':>9s} {'host us':>8s}"
    lines = [f"{'(B, H, T, D, E)':24s} {'dtype':5s} {'mode':7s} {'ours':>10s} {header} {'peer':>19s} {header} "
             f"{'peer/ours':>9s}"]
    measured = [r for r in rows if r["part"] == "shapes" and r["ms"] is not None]
    for shape, dtype, mode in dict.fromkeys((tuple(r["shape"]), r["dtype"], r["mode"]) for r in measured):
        here = [r for r in measured if (tuple(r["shape"]), r["dtype"], r["mode"]) == (shape, dtype, mode)]
        ours = min((r for r in here if r["impl"] in triton_methods), key=lambda r: r["ms"], default=None)
        peer = min((r for r in here if r["impl"] in PEERS and r["impl"] != "sdpa_softmax"),
                   key=lambda r: r["ms"], default=None)

        def cells(row, width):
            if row is None:
                return f"{'-':>{width}s} {'-':>9s} {'-':>9s} {'-':>8s}"
            gpu = f"{row['gpu_ms']:9.4f}" if row["gpu_ms"] is not None else f"{'-':>9s}"
            return f"{row['impl']:>{width}s} {row['ms']:9.4f} {gpu} {row['host_us']:8.1f}"

        ratio = f"{peer['ms'] / ours['ms']:9.2f}" if ours and peer else f"{'-':>9s}"
        lines.append(f"{str(shape):24s} {dtype:5s} {mode:7s} {cells(ours, 10)} {cells(peer, 19)} {ratio}")
    return "\n".join(lines)


# --- output ----------------------------------------------------------------------------------

CSV_FIELDS = ("part", "shape", "dtype", "mode", "impl", "ms", "host_us", "gpu_ms", "rel_err",
              "float32_products", "floor_ms", "bandwidth_TBps", "note")


def write_outputs(out: Path, env: dict, rows: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"env": env, "complete": True, "rows": rows}, indent=1))
    with open(out / "bench.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "shape": "x".join(map(str, row["shape"]))})
    (out / "bench.md").write_text(markdown_tables(rows))
    measured = [row for row in rows if row["ms"] is not None]
    return [out / "bench.json", out / "bench.csv", out / "bench.md"] + (plot(out, env, measured) if measured else [])


def _cell(row: dict | None, best: bool) -> str:
    if row is None or row["ms"] is None:
        return "-"
    text = f"**{row['ms']:.3f}**" if best else f"{row['ms']:.3f}"
    return text if row["gpu_ms"] is None else f"{text} ({row['gpu_ms']:.3f})"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if numerator is None or denominator is None else f"{numerator / denominator:.2f}"


def markdown_tables(rows: list[dict]) -> str:
    """The "shapes" rows as one Markdown table per dtype, as the README shows them: per shape and
    mode, every contender's ms per call (GPU ms of a graph replay in parentheses), our fastest
    method in bold, and "peers / ours": the fastest linear-attention peer's time over our fastest
    method's (per call; GPU time in parentheses). Softmax attention is left out: another function."""
    tables = []
    shape_rows = [r for r in rows if r["part"] == "shapes" and r["impl"] != "sdpa_softmax"]
    # A table per dtype, and per float32 setting that timed rows of ours (not only skipped ones).
    tables_of = dict.fromkeys((r["dtype"], _setting_of(r["impl"])) for r in shape_rows
                              if _setting_of(r["impl"]) is None or r["ms"] is not None)
    for dtype, setting in tables_of:
        # Rows of our methods under this setting (METHOD@SETTING; none: the run's), and the peers.
        selected = [r for r in shape_rows if r["dtype"] == dtype
                    and (_setting_of(r["impl"]) == setting or method_of(r["impl"]) not in ttx_tutorial.METHODS)]
        impls = list(dict.fromkeys(r["impl"] for r in selected))
        ours = [impl for impl in impls
                if method_of(impl) in ttx_tutorial.METHODS and api.method_info(method_of(impl)).is_triton]
        peers = [impl for impl in impls if method_of(impl) not in ttx_tutorial.METHODS]
        title = f"{dtype}:" if setting is None else f"{dtype}, torch.set_float32_matmul_precision({setting!r}):"
        lines = [title, "", "| (B, H, T, D, E) | mode | " + " | ".join(impls) + " | peers / ours |",
                 "|---" * (len(impls) + 3) + "|"]
        for shape in dict.fromkeys(tuple(r["shape"]) for r in selected):
            for mode in MODES:
                by_impl = {r["impl"]: r for r in selected if tuple(r["shape"]) == shape and r["mode"] == mode}
                if not by_impl:
                    continue

                def fastest(names, key):
                    times = [by_impl[n][key] for n in names if n in by_impl and by_impl[n][key] is not None]
                    return min(times) if times else None

                best_ours = fastest(ours, "ms")
                cells = [_cell(by_impl.get(impl), impl in ours and by_impl.get(impl) is not None
                               and by_impl[impl]["ms"] == best_ours) for impl in impls]
                ratio = _ratio(fastest(peers, "ms"), best_ours)
                gpu_ratio = _ratio(fastest(peers, "gpu_ms"), fastest(ours, "gpu_ms"))
                ratio = ratio if gpu_ratio == "-" else f"{ratio} ({gpu_ratio})"
                lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + f" | {ratio} |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n"


def plot(out: Path, env: dict, rows: list[dict]) -> list[Path]:
    """Per (part, dtype): time per call, and achieved bandwidth against the copy ceiling, one
    panel per mode; one colour per contender. The sweep is drawn against T, the reference shapes
    side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colours = {impl: plt.get_cmap("tab20")(i % 20) for i, impl in enumerate(impls)}
    written = []
    for part, dtype in dict.fromkeys((r["part"], r["dtype"]) for r in rows):
        shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows if r["part"] == part))
        modes = [mode for mode in MODES if any(r["mode"] == mode for r in rows)]
        for quantity, ylabel in (("ms", "milliseconds per call"), ("bandwidth_TBps", "TB/s (minimum bytes / time)")):
            figure, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
            for axis, mode in zip(axes[0], modes):
                selected = [r for r in rows if (r["part"], r["dtype"], r["mode"]) == (part, dtype, mode)
                            and r[quantity] is not None]
                for impl in impls:
                    points = sorted((r["shape"][2] if part == "sweep" else shapes.index(tuple(r["shape"])),
                                     r[quantity]) for r in selected if r["impl"] == impl)
                    if points:
                        axis.plot(*zip(*points), "o-" if part == "sweep" else "o", color=colours[impl],
                                  label=impl, lw=2.2 if impl in ttx_tutorial.METHODS else 1)
                if quantity == "bandwidth_TBps":
                    axis.axhline(env["copy_TBps"], color="black", ls="--", label="device copy")
                if part == "sweep":
                    B, H, _, D, E = shapes[0]
                    lengths = sorted({shape[2] for shape in shapes})
                    axis.set_xscale("log", base=2)
                    axis.set_xticks(lengths, [str(T) for T in lengths])
                    axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                    axis.set(xlabel=f"sequence length T, (B, H, D, E) = {(B, H, D, E)}")
                else:
                    axis.set_xticks(range(len(shapes)), [",".join(map(str, s)) for s in shapes], fontsize=7)
                    axis.set(xlim=(-0.5, len(shapes) - 0.5), xlabel="(B, H, T, D, E)")
                axis.set(yscale="log", ylabel=ylabel, title=f"{part}, {dtype}, {mode}")
                axis.grid(True, which="both", alpha=0.3)
                if selected:
                    axis.legend(fontsize=7)
            figure.text(0.01, -0.01, env["recording"], fontsize=6)
            name = "time" if quantity == "ms" else "bandwidth"
            path = out / f"{name}_{part}_{dtype}.png"
            figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
    return written


# --- recorded data ---------------------------------------------------------------------------

def recorded_key(row: dict) -> tuple:
    """What identifies a measurement across recordings (as tests/test_recorded_data.py compares)."""
    return (row["part"], tuple(row["shape"]), row["impl"], row["mode"], row["dtype"], row.get("config"))


def figure_rows(recorded: dict) -> list[list[dict]]:
    """The rows each figure of the notebooks reads, selected as the notebook selects them.

    notebooks/03: the recurrent table (per shape it shows and dtype, the newest "shapes"
    recording with recurrent rows there), the peers table, and the sweep of the newest recording
    with a recurrent sweep; notebooks/04: the "precision" rows; notebooks/05: the sweep of the newest recording with a bfloat16 scan
    sweep, one table per recording of "shapes" rows, and the "overhead" rows.
    """
    from ttx_tutorial.course.figures import latest_recording, rows_of_one_recording

    sweep_03 = dict(part="sweep", mode="fwd", shape_prefix=(1, 8), shape_suffix=(64, 64))
    sweep_05 = dict(sweep_03, dtype="bf16")
    selections = [
        lambda shape=shape, dtype=dtype: latest_recording(recorded, part="shapes", impl="recurrent", dtype=dtype,
                                                          shape=list(shape))[1]
        for shape in ((8, 16, 4096, 64, 64), (1, 8, 65536, 64, 64)) for dtype in ("bf16", "fp32")
    ] + [
        lambda: rows_of_one_recording(recorded, part="peers")[1],
        lambda: rows_of_one_recording(
            recorded, recording=latest_recording(recorded, impl="recurrent", **sweep_03)[0], **sweep_03)[1],
        lambda: rows_of_one_recording(recorded, part="precision")[1],
        lambda: rows_of_one_recording(
            recorded, recording=latest_recording(recorded, impl="scan", **sweep_05)[0], **sweep_05)[1],
        lambda: rows_of_one_recording(recorded, part="overhead")[1],
    ]
    selections += [lambda name=name: rows_of_one_recording(recorded, part="shapes", recording=name)[1]
                   for name in recorded["recordings"]]
    figures = []
    for select in selections:
        try:
            figures.append(select())
        except LookupError:  # this figure finds nothing in the file: it prints that it has no rows
            continue
    return figures


def record(path: Path, rows: list[dict], env: dict, note: str | None = None) -> dict:
    """Merge ``rows`` into the recorded-data file at ``path`` as one recording, current rows only.

    The recording is named by date, device, versions and command
    (``ttx_tutorial.course.figures.recording_name``) and listed last (the file lists them oldest
    first); a recording of the same name made before is replaced. A file holds the figures of
    one device: rows of another are refused. An older row measured again
    (same part, shape, method, mode, dtype and config) is dropped, and so is every older row
    that no notebook figure reads any more (:func:`figure_rows`): git history keeps them.
    Rows that were skipped or failed are not recorded.
    """
    from ttx_tutorial.course.figures import recording_name

    name = recording_name(env, env["command"])
    if path.exists():
        recorded = json.loads(path.read_text())
        device = recorded["env"].get("gpu")
        if device not in (None, env["gpu"]):
            raise ValueError(f"--record: {path} holds figures of {device}, this run measured {env['gpu']}: "
                             "record into a file of this device's own")
    else:
        recorded = {"env": {}, "about": "Figures written by python -m ttx_tutorial.bench --record.",
                    "recordings": {}, "rows": []}
    new = [_recorded_row(row, name) for row in rows if row["ms"] is not None]
    if not new:
        raise ValueError(f"nothing to record in {path}: every row was skipped or failed")
    measured = {recorded_key(row) for row in new}
    older = [row for row in recorded["rows"] if row["recording"] != name and recorded_key(row) not in measured]
    recordings = {key: value for key, value in recorded["recordings"].items() if key != name}
    recordings[name] = {"copy_TBps": round(env["copy_TBps"], 3), **({"note": note} if note else {})}
    merged = {**recorded, "env": {key: env[key] for key in ENV_KEYS}, "recordings": recordings,
              "rows": older + new}
    read = {id(row) for rows_read in figure_rows(merged) for row in rows_read}
    merged["rows"] = [row for row in older if id(row) in read] + new
    used = {row["recording"] for row in merged["rows"]}
    merged["recordings"] = {key: value for key, value in recordings.items() if key in used}
    path.write_text(json.dumps(merged, indent=1, ensure_ascii=False) + "\n")
    return merged


def _recorded_row(row: dict, recording: str) -> dict:
    kept = {"shape": row["shape"], "impl": row["impl"], "mode": row["mode"], "dtype": row["dtype"],
            "ms": round(row["ms"], 5), "rel_err": row["rel_err"], "config": None, "part": row["part"],
            "recording": recording, "host_us": round(row["host_us"], 1)}
    if row["gpu_ms"] is not None:
        kept["gpu_ms"] = round(row["gpu_ms"], 5)
    if row.get("float32_products") is not None:
        kept["float32_products"] = row["float32_products"]
    return kept


# --- command line ----------------------------------------------------------------------------

ENV_KEYS = ("gpu", "sms", "torch", "triton", "python", "date", "fla")
#: What a run in CPU mode names as its device.
CPU_DEVICE = "CPU (Triton interpreter)"


def device_name() -> str:
    """The device a run measures, as recordings name it."""
    return CPU_DEVICE if _device.INTERPRETED else torch.cuda.get_device_name(_device.DEVICE)


def environment(command: str, copy_TBps: float) -> dict:
    gpu = device_name()
    sms = None if _device.INTERPRETED else torch.cuda.get_device_properties(_device.DEVICE).multi_processor_count
    try:
        from importlib.metadata import version

        fla = version("fla-core")
    except Exception:  # noqa: BLE001  not installed
        fla = None
    env = {"gpu": gpu, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat(), "fla": fla,
           "command": command, "copy_TBps": copy_TBps}
    from ttx_tutorial.course.figures import recording_name

    env["recording"] = recording_name(env, command)
    return env


def parse_shapes(text: str, option: str) -> tuple[tuple[int, ...], ...]:
    """'B,H,T,D[,E];...' as (B, H, T, D, E) tuples; '' is none."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            numbers = tuple(int(x) for x in item.split(","))
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not B,H,T,D[,E] (integers)") from None
        if len(numbers) not in (4, 5) or min(numbers) < 1:
            raise ValueError(f"{option}: {item!r} must be 4 or 5 positive integers, B,H,T,D[,E]")
        shapes.append(numbers if len(numbers) == 5 else numbers + (numbers[3],))
    return tuple(shapes)


def parse_sweep(text: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """'B,H,D,E:T,T,...' or '' (no sweep)."""
    if not text.strip():
        return None
    dims, _, lengths = text.partition(":")
    try:
        dims = tuple(int(x) for x in dims.split(","))
        lengths = tuple(int(x) for x in lengths.split(","))
    except ValueError:
        raise ValueError(f"--sweep: {text!r} is not B,H,D,E:T,T,... (integers)") from None
    if len(dims) != 4 or not lengths or min(dims + lengths) < 1:
        raise ValueError(f"--sweep: {text!r} must be four positive B,H,D,E, a colon and positive T values")
    return dims, lengths


#: Short dtype names, as the rows and tables label them, accepted by --dtypes too.
DTYPE_ALIASES = {label: str(dtype).replace("torch.", "") for dtype, label in DTYPE_LABELS.items()}


def parse_names(text: str, allowed: Iterable[str], option: str, aliases: dict | None = None) -> list[str]:
    names = [(aliases or {}).get(name, name) for name in (part.strip() for part in text.split(",")) if name]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
    return names


def _plain(text: str) -> str:
    """The module docstring for --help: reST's markup dropped."""
    return re.sub(r":\w+:`([^`]+)`", r"\1", text).replace("``", "`")


def _check_record_file(path: Path) -> None:
    """Refuse, before anything is measured, a --record file this run could not merge into."""
    if not path.parent.is_dir():
        raise ValueError(f"--record: the folder {path.parent} does not exist")
    if not path.exists():
        return
    try:
        recorded = json.loads(path.read_text())
        device = recorded["env"].get("gpu")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--record: {path} is not a recorded-data file ({type(exc).__name__}: {exc})") from None
    if device not in (None, device_name()):
        raise ValueError(f"--record: {path} holds figures of {device}, this run would measure {device_name()}: "
                         "record into a file of this device's own")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m ttx_tutorial.bench", description=_plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (the defaults below shrink)")
    parser.add_argument("--shapes", help="B,H,T,D[,E];... or '' for none (default: the reference shapes, "
                                         + "; ".join(",".join(map(str, shape)) for shape in REFERENCE_SHAPES) + ")")
    parser.add_argument("--sweep", help="B,H,D,E:T,T,... timed over T, or '' for none (default, also when "
                                        "--shapes is given: 1,8,64,64:256,512,...,65536)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated, of " + ", ".join(DTYPES) + " (or fp32, fp16, bf16); default %(default)s")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES)
                        + "; default both")
    parser.add_argument("--methods", default=",".join(ttx_tutorial.METHODS),
                        help="comma-separated, of " + ", ".join(ttx_tutorial.METHODS) + "; default all")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of " + ", ".join(PEERS)
                        + ", or '' for none; default all (those not installed are left out)")
    parser.add_argument("--float32-settings", default="",
                        help="comma-separated, of " + ", ".join(FLOAT32_SETTINGS) + ": also time the methods whose "
                        "float32 products follow torch.set_float32_matmul_precision (chunked, scan) under each, "
                        "as float32 rows named METHOD@SETTING; default none")
    parser.add_argument("--out", default="bench-results", help="directory for CSV, JSON and PNG; default %(default)s")
    parser.add_argument("--record", type=Path, help="merge the rows into this recorded-data JSON file")
    parser.add_argument("--note", help="with --record: what a reader of the recording must know")
    args = parser.parse_args(argv)
    mode = "cpu" if _device.INTERPRETED else "gpu"
    try:
        if args.note is not None and args.record is None:
            raise ValueError("--note goes with --record: it is written into the recording")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out: {args.out} exists and is not a directory")
        if args.record is not None:
            _check_record_file(args.record)
        shapes = parse_shapes(args.shapes, "--shapes") if args.shapes is not None else (
            QUICK_SHAPES[mode] if args.quick else REFERENCE_SHAPES)
        sweep = parse_sweep(args.sweep) if args.sweep is not None else (
            QUICK_SWEEP[mode] if args.quick else SWEEP)
        dtypes = [DTYPES[name] for name in parse_names(args.dtypes, DTYPES, "--dtypes", DTYPE_ALIASES)]
        modes = parse_names(args.modes, MODES, "--modes")
        methods = parse_names(args.methods, ttx_tutorial.METHODS, "--methods")
        peers = parse_names(args.peers, PEERS, "--peers")
        settings = parse_names(args.float32_settings, FLOAT32_SETTINGS, "--float32-settings")
        if settings and torch.float32 not in dtypes:
            raise ValueError("--float32-settings times float32 rows: --dtypes must name float32")
        if settings and not set(methods) & set(_FLOAT32_PRECISION_OF):
            raise ValueError("--float32-settings applies to " + " and ".join(_FLOAT32_PRECISION_OF)
                             + ": --methods names neither")
        if not dtypes or not modes or not (methods or peers):
            raise ValueError("--dtypes, --modes and one of --methods/--peers must name at least one")
        if not shapes and sweep is None:
            raise ValueError("--shapes and --sweep are both empty: nothing to measure")
    except ValueError as exc:
        parser.error(str(exc))
    if _device.INTERPRETED and not args.quick and (args.shapes is None or args.sweep is None):
        print("CPU mode: the default shapes and sweep are GPU sizes, which Triton's interpreter takes minutes "
              "to hours a row to run; for seconds, use --quick, or small --shapes with --sweep ''",
              file=sys.stderr, flush=True)
    # The command as it decides the measurements: where results go does not name a recording.
    measured_args = _without_options(argv, ("--out", "--record", "--note"))
    command = shlex.join(["python", "-m", "ttx_tutorial.bench", *measured_args])
    print(ttx_tutorial.describe(), flush=True)
    found, missing = peer_contenders(peers)
    for name, reason in missing.items():
        print(f"peer {name} left out: {reason}")
    contenders = method_contenders(methods) + setting_contenders(methods, settings) + found
    started = time.perf_counter()
    copy_TBps = copy_bandwidth_TBps(args.quick)
    env = environment(command, copy_TBps)
    print(f"device copy: {copy_TBps:.3f} TB/s (bytes read + written)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def keep_so_far(rows):  # a run cut short keeps what it measured
        (out / "bench.json").write_text(json.dumps({"env": env, "complete": False, "rows": rows}, indent=1))

    rows = run(benchmarks(shapes, sweep, dtypes, modes, contenders), contenders, copy_TBps, on_row=keep_so_far)
    env["seconds"] = round(time.perf_counter() - started, 1)
    written = write_outputs(out, env, rows)
    measured = sum(row["ms"] is not None for row in rows)
    if any(row["part"] == "shapes" for row in rows):
        print("\nfastest of ours against the fastest peer (x ms: peer's ms over ours)\n" + summary(rows))
    print(f"\n{measured} of {len(rows)} rows measured in {env['seconds']} s; wrote "
          + ", ".join(str(path) for path in written))
    if not measured:
        print("nothing was measured: every row was skipped or failed (see the notes above)", file=sys.stderr)
        return 1
    if args.record is not None:
        merged = record(args.record, rows, env, args.note)
        print(f"recorded {measured} rows in {args.record} as {env['recording']!r} "
              f"({len(merged['rows'])} rows, {len(merged['recordings'])} recordings)")
    return 0


def _without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in options:
            skip = True
        elif not item.startswith(tuple(option + "=" for option in options)):
            kept.append(item)
    return kept


if __name__ == "__main__":
    sys.exit(main())
