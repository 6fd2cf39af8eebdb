"""Check and time every method on a CUDA GPU in one run; write the figures the notebooks show.

    python benchmarks/gpu_check.py                  # everything, results in benchmarks/results/
    python benchmarks/gpu_check.py --out DIR --parts shapes,sweep --methods chunked,scan

Parts (``--parts``, comma-separated, default all):
  ceilings   device-to-device copy bandwidth (the memory floor of a forward pass)
  tune       every candidate config of each kernel (its TUNING_CANDIDATES) at the issue shapes;
             with --tune-backward, forward+backward too
  shapes     the issue shapes: each method and fla side by side, forward and forward+backward,
             with the relative error of each forward against a float64 reference
  sweep      time versus T at (B, H, D, E) = (1, 8, 64, 64) for every method and softmax SDPA
  precision  float32 tl.dot error with TF32 and with IEEE inputs (notebook 04)
  overhead   where a call's time goes: each layer of the chunked path (API, kernel function,
             raw launch) and fla timed with do_bench, on the host alone, and as a replayed
             CUDA graph (GPU time only); plus a cProfile of the API's host path
  trace      per shape, ours (the method ``auto`` picks) and fla's best kernel, forward and
             forward+backward: host time per call, the host time of each wrapper function, and
             the GPU time of every kernel from torch.profiler (a Chrome trace each, in --out)

Timings are medians of ``triton.testing.do_bench``; inputs are bfloat16 with
q, k ~ N(0, 1)/sqrt(D) and v ~ N(0, 1), layout (B, H, T, D) (fla gets (B, T, H, D), transposed
outside the timed region, called with scale=1.0, normalize=False). Output: ``h200.json`` (or
``<gpu>.json``) in ``ttx_tutorial/data``'s format, plus a table printed last. Every row names its
recording: date, GPU, versions and this command line. To show new figures in the notebooks, add the
recording and its rows to ``ttx_tutorial/data/h200.json`` and drop the rows of the Triton methods
that it re-measures (a figure shows one recording; tests/test_recorded_data.py checks the file).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from ttx_tutorial.testing import random_inputs, reference, relative_error  # noqa: E402
from ttx_tutorial.notebook import recording_name  # noqa: E402

ISSUE_SHAPES = [(8, 16, 4096, 64, 64), (8, 16, 4096, 128, 128), (1, 8, 65536, 64, 64),
                (2, 16, 16384, 128, 128)]  # (B, H, T, D, E)
KERNEL_METHODS = ["recurrent", "chunked", "scan"]
SWEEP_T = [2**p for p in range(8, 17, 2)]  # 256, 1024, 4096, 16384, 65536
REFERENCE_LIMITS = {"loop": 2048, "cumsum": 16384, "quadratic": 32768}  # largest T timed (memory/time)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def median_ms(fn, warmup=25, rep=100, leaves=None):
    """Median ms of do_bench; ``leaves``: tensors whose .grad is cleared before each call."""
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=leaves, return_mode="median"))


def load_fla():
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn
    except Exception as exc:  # fla is optional: record why it is missing
        print(f"fla not available: {exc!r}")
        return {}
    return {"fla_chunk": chunk_linear_attn, "fla_fused_chunk": fused_chunk_linear_attn}


def kernel_module(method):
    return importlib.import_module(ttx_tutorial.method_info(method).target.split(":")[0])


def kernel_function(method):
    return ttx_tutorial.method_info(method).load()


class Recorder:
    """Collects rows and rewrites the results file after each one, so a run cut short keeps them."""

    def __init__(self, path, env):
        self.rows = []
        self.path = path
        self.env = env
        # Every row names its recording by date, GPU, versions and command, as in ttx_tutorial/data.
        self.recording = recording_name(env, env["command"])

    def save(self):
        self.path.write_text(json.dumps({"env": self.env, "recordings": {self.recording: {}},
                                         "rows": self.rows}, indent=1))

    def add(self, shape, impl, mode, dtype, ms, rel_err=None, config=None, part="", gpu_ms=None, rounds_ms=None):
        row = {"shape": list(shape), "impl": impl, "mode": mode, "dtype": dtype,
               "ms": None if ms is None else round(ms, 5),
               "rel_err": None if rel_err is None else float(f"{rel_err:.3e}"),
               "config": config, "part": part, "recording": self.recording}
        if gpu_ms is not None:
            row["gpu_ms"] = round(gpu_ms, 5)
        if rounds_ms is not None:
            row["rounds_ms"] = [round(x, 5) for x in rounds_ms]
        self.rows.append(row)
        self.save()
        err = "" if rel_err is None else f"  err {rel_err:.1e}"
        config = config or ("rounds " + " ".join(f"{x:.4f}" for x in rounds_ms) if rounds_ms else "")
        ms_text = "   n/a" if ms is None else f"{ms:9.4f}"
        gpu_text = "" if gpu_ms is None else f" (graph {gpu_ms:.4f})"
        print(f"[{part}] {impl:28s} {mode:8s} {str(tuple(shape)):26s} {ms_text} ms{gpu_text}{err}  {config or ''}",
              flush=True)


def make_inputs(shape, dtype=torch.bfloat16, requires_grad=False, seed=0):
    B, H, T, D, E = shape
    return random_inputs(B, H, T, D, E, dtype=dtype, device="cuda", seed=seed, requires_grad=requires_grad)


def forward_error(fn, q, k, v):
    """Relative error of fn's output on a slice (batch 0, up to 2 heads) against float64."""
    return output_error(fn(q, k, v), q, k, v)


def output_error(o, q, k, v, fla_layout=False):
    """Relative error of an output (B, H, T, E), or (B, T, H, E) from fla, on batch 0 and up to
    two heads, against float64."""
    if fla_layout:
        o = o.transpose(1, 2)
    heads = slice(0, min(2, q.shape[1]))
    ref, _ = reference(q[:1, heads], k[:1, heads], v[:1, heads], device="cuda", chunk=2048)
    return relative_error(o[:1, heads], ref)


def graph_or_none(fn, leaves=()):
    """GPU time of fn from a replayed CUDA graph, or None where fn cannot be captured. ``leaves``:
    tensors whose .grad fn fills; they start the capture without one, so that the graph writes
    fresh gradients as ``do_bench(grad_to_none=...)`` does, instead of adding into old ones."""
    def fresh_gradients():
        for leaf in leaves:
            leaf.grad = None

    try:
        return _graph_ms(fn, before_capture=fresh_gradients)
    except Exception as exc:  # e.g. a host sync inside fn
        print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})")
        torch.cuda.synchronize()
        return None


def time_forward(rec, shape, impl, fn, part, config=None):
    """Time fn(q, k, v) -> o forward on fresh inputs, with its error against float64; record it."""
    q, k, v = make_inputs(shape)
    err = forward_error(fn, q, k, v)
    ms = median_ms(lambda: fn(q, k, v))
    rec.add(shape, impl, "fwd", "bf16", ms, err, config, part)
    return ms


def to_fla_layout(*tensors):
    """(B, H, T, D) tensors as fla takes them, (B, T, H, D) and contiguous: made outside timings."""
    return tuple(x.transpose(1, 2).contiguous() for x in tensors)


def forward_and_step(fn, inputs, grad_out):
    """The two calls a benchmark times: fn's forward, and forward+backward into ``leaves`` (fresh
    copies of the inputs that require gradients; the caller clears their .grad between calls)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]

    def forward():
        return fn(*inputs)

    def step():
        fn(*leaves).backward(grad_out)

    return forward, step, leaves


def ours(method, config=None):
    """The public API, or the kernel function itself with an explicit config (tuning)."""
    if config is None:
        return lambda q, k, v: ttx_tutorial.causal_product(q, k, v, method)
    fn = kernel_function(method)
    return lambda q, k, v: fn(q, k, v, None, config=config)[0]


def fla_wrapped(fla_fn):
    """fla on its own (B, T, H, D) layout: callers transpose outside the timed region."""
    def run(q, k, v):
        return fla_fn(q, k, v, scale=1.0, normalize=False)[0]

    return run


def part_ceilings(rec, env):
    n = 1 << 28  # 1 GiB of float32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    env["copy_TBps"] = round(2 * src.numel() * 4 / (ms * 1e-3) / 1e12, 3)
    print(f"device-to-device copy: {env['copy_TBps']} TB/s (read + write)")  # the 2 GiB go with the frame


def part_tune(rec, methods, shapes, configs=None, backward=False):
    """Each method's default against its TUNING_CANDIDATES (or the ``--configs`` given for it);
    with ``backward``, forward+backward too (a config applies to every launch of the call)."""
    best = {}
    for method in methods:
        module = kernel_module(method)
        candidates = list(getattr(module, "TUNING_CANDIDATES", []))
        if configs is not None:
            candidates = configs.get(method, [])
        for shape in shapes:
            timings = []
            for config in [None] + candidates:
                try:
                    label = json.dumps(config) if config else "default"
                    ms = time_forward(rec, shape, method, ours(method, config), "tune", config=label)
                    timings.append((ms, config))
                    if backward:
                        q, k, v = make_inputs(shape)
                        grad_out = torch.randn_like(v)
                        _, step, leaves = forward_and_step(ours(method, config), (q, k, v), grad_out)
                        step_ms = median_ms(step, leaves=leaves)
                        rec.add(shape, method, "fwd+bwd", "bf16", step_ms, None, label, "tune")
                    print(f"[tune] {method} {shape} {label}: fwd {ms:.4f} ms"
                          + (f", fwd+bwd {step_ms:.4f} ms" if backward else ""))
                except Exception as exc:
                    print(f"[tune] {method} {shape} {config}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            if timings:
                best[(method, shape)] = min(timings, key=lambda t: t[0])
    print("\nbest forward config per (method, shape):")
    for (method, shape), (ms, config) in best.items():
        print(f"  {method:10s} {str(shape):24s} {ms:8.4f} ms  {config or 'default'}")


def part_shapes(rec, methods, shapes, fla, rounds=3):
    """Each method and each fla kernel side by side at each shape. ``do_bench`` of one call is
    host-bound at small sizes, and the host's speed drifts within a run (by up to 30 % here), so
    the timings alternate between the contenders for ``rounds`` rounds and each row keeps the
    median over rounds (the rounds themselves go to ``rounds_ms``). GPU time comes from one
    graph replay each."""
    for shape in shapes:
        q, k, v = make_inputs(shape)
        grad_out = torch.randn(*shape[:3], shape[4], device="cuda", dtype=q.dtype)
        contenders = {method: (ours(method), (q, k, v), grad_out) for method in methods}
        fla_q, fla_k, fla_v, fla_grad_out = to_fla_layout(q, k, v, grad_out)
        for name, fla_fn in fla.items():
            contenders[name] = (fla_wrapped(fla_fn), (fla_q, fla_k, fla_v), fla_grad_out)
        steps, errors, graphs = {}, {}, {}
        for name, (fn, inputs, g) in contenders.items():
            forward, step, leaves = forward_and_step(fn, inputs, g)
            try:
                errors[name] = output_error(forward(), q, k, v, fla_layout=name.startswith("fla"))
                step()
            except Exception as exc:
                print(f"[shapes] {name} {shape}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            steps[name] = {"fwd": (forward, None), "fwd+bwd": (step, leaves)}
            graphs[name] = {"fwd": graph_or_none(forward), "fwd+bwd": graph_or_none(step, leaves)}
        timings = {(name, mode): [] for name in steps for mode in ("fwd", "fwd+bwd")}
        for _ in range(rounds):
            for name in steps:
                for mode, (call, leaves) in steps[name].items():
                    timings[name, mode].append(float(do_bench(call, warmup=25, rep=100, grad_to_none=leaves,
                                                              return_mode="median")))
        for (name, mode), values in timings.items():
            rec.add(shape, name, mode, "bf16", statistics.median(values), errors[name] if mode == "fwd" else None,
                    None, "shapes", gpu_ms=graphs[name][mode], rounds_ms=values)


def part_sweep(rec, methods, fla):
    for T in SWEEP_T:
        shape = (1, 8, T, 64, 64)
        q, k, v = make_inputs(shape)
        for name in ("loop", "cumsum", "quadratic"):
            if T <= REFERENCE_LIMITS[name]:
                fn = ttx_tutorial.method_info(name).load()
                rep = 20 if name == "loop" else 100
                rec.add(shape, name, "fwd", "bf16", median_ms(lambda: fn(q, k, v)[0], warmup=5, rep=rep),
                        None, None, "sweep")
        for method in methods:
            fn = ours(method)
            rec.add(shape, method, "fwd", "bf16", median_ms(lambda: fn(q, k, v)), None, None, "sweep")
        sdpa = torch.nn.functional.scaled_dot_product_attention
        rec.add(shape, "sdpa_softmax", "fwd", "bf16",
                median_ms(lambda: sdpa(q, k, v, is_causal=True)), None, None, "sweep")
        for name, fla_fn in fla.items():
            run = fla_wrapped(fla_fn)
            qt, kt, vt = to_fla_layout(q, k, v)
            rec.add(shape, name, "fwd", "bf16", median_ms(lambda: run(qt, kt, vt)), None, None, "sweep")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    offs_m, offs_k, offs_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :])
    c = tl.dot(a, b, input_precision=INPUT_PRECISION)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], c)


def _host_us(fn, calls=200):
    """Microseconds of host time per call: enqueue `calls` calls, then wait for the GPU once."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _graph_ms(fn, before_capture=None):
    """Median ms of fn replayed from a CUDA graph: the GPU's time with no host in the way."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def part_overhead(rec, fla, shapes):
    """Each layer of the chunked forward, timed three ways (see the module docstring)."""
    import cProfile
    import pstats

    chunked = kernel_module("chunked")
    for shape in shapes:
        q, k, v = make_inputs(shape)
        B, H, T, D, E = shape
        # The wrapper's own choice for this GPU, so the raw launch runs the same compiled kernel.
        multiprocessors, shared_memory = chunked._device_limits(q.device)
        config = chunked.default_config(D, E, q.dtype, heads=B * H, multiprocessors=multiprocessors,
                                        shared_memory=shared_memory)
        o = torch.empty_like(v)
        sf = torch.empty(B, H, D, E, device="cuda", dtype=torch.float32)
        grid = (B * H * triton.cdiv(E, config["BLOCK_E"]),)
        raw_args = (q, k, v, o, sf, sf, T, H, D, E, 0, 0, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                    *sf.stride(), *sf.stride())
        raw_kwargs = dict(BLOCK_D=chunked._block(D), BLOCK_E=config["BLOCK_E"],
                          CHUNK=config["CHUNK"], INTERPRETED=False, num_warps=config["num_warps"],
                          num_stages=config["num_stages"])
        layers = {
            "api": lambda: ttx_tutorial.causal_product(q, k, v, "chunked"),
            "api_auto": lambda: ttx_tutorial.causal_product(q, k, v),
            "kernel_function": lambda: chunked.chunked_causal_product(q, k, v),
            "launch": lambda: chunked._launch(q, k, v, None, reverse=False, config=None),
            "raw_kernel": lambda: chunked.chunked_kernel[grid](*raw_args, **raw_kwargs),
            "empty_x2": lambda: (torch.empty_like(v), torch.empty_like(sf)),
        }
        if "fla_fused_chunk" in fla:
            qt, kt, vt = to_fla_layout(q, k, v)
            layers["fla_fused_chunk"] = lambda: fla["fla_fused_chunk"](qt, kt, vt, scale=1.0, normalize=False)
        for name, fn in layers.items():
            fn()
            ms = median_ms(fn)
            host = _host_us(fn)
            try:
                graph = None if name == "empty_x2" else _graph_ms(fn)  # allocations alone: no kernel
            except Exception as exc:  # some layers allocate or sync in ways a graph refuses
                print(f"[overhead] {name}: no graph ({type(exc).__name__}: {str(exc)[:120]})")
                graph = None
            rec.add(shape, f"overhead_{name}", "fwd", "bf16", ms, None,
                    json.dumps({"host_us": round(host, 1), "graph_ms": graph and round(graph, 5)}), "overhead")
        qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
        grad_out = torch.randn_like(v)
        step = lambda: ttx_tutorial.causal_product(qg, kg, vg, "chunked").backward(grad_out)  # noqa: E731
        step()
        rec.add(shape, "overhead_api_fwd_bwd", "fwd+bwd", "bf16", median_ms(step), None,
                json.dumps({"host_us": round(_host_us(step), 1)}), "overhead")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            ttx_tutorial.causal_product(q, k, v, "chunked")
        profile.disable()
        torch.cuda.synchronize()
        print(f"[overhead] cProfile of 200 API calls at {shape}, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def _timed_functions(module, names, totals):
    """Wrap module.<name> for each name so that each call adds its host seconds to totals[name];
    returns a function that restores the originals. Works across threads (autograd runs the
    backward on its own), unlike cProfile."""
    originals = {name: getattr(module, name) for name in names}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return timed

    for name, fn in originals.items():
        setattr(module, name, wrap(name, fn))
    return lambda: [setattr(module, name, fn) for name, fn in originals.items()] and None


# The wrapper functions of each kernel file whose host time the trace part reports.
TRACED_FUNCTIONS = {"chunked": ("_launch", "_launch_backward"),
                    "scan": ("_launch", "_segment_starts", "_segment_outputs")}


def part_trace(rec, fla, shapes, out):
    """Where the time of one call goes, for ours and fla's best kernel at each shape."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda")  # do_bench's L2 flush
    for shape in shapes:
        q, k, v = make_inputs(shape)
        method = ttx_tutorial.choose_method(q, v)
        grad_out = torch.randn(*shape[:3], shape[4], device="cuda", dtype=q.dtype)
        impls = {method: (ours(method), (q, k, v), grad_out)}
        fla_name = "fla_fused_chunk" if shape[2] <= 4096 and shape[3] <= 64 else "fla_chunk"
        if fla_name in fla:
            *fla_inputs, fla_grad_out = to_fla_layout(q, k, v, grad_out)
            impls[fla_name] = (fla_wrapped(fla[fla_name]), fla_inputs, fla_grad_out)
        for name, (fn, inputs, g) in impls.items():
            forward, step, leaves = forward_and_step(fn, inputs, g)

            def fresh_step(step=step, leaves=leaves):  # many calls in a row: clear .grad each time
                for leaf in leaves:
                    leaf.grad = None
                step()

            for mode, call in (("fwd", forward), ("fwd+bwd", fresh_step)):
                call()
                ms = median_ms(call)
                totals = {}
                restore = _timed_functions(kernel_module(method), TRACED_FUNCTIONS.get(method, ()), totals) \
                    if name == method else (lambda: None)
                calls = 100
                host = _host_us(call, calls)
                restore()
                parts = {key: round(seconds / calls * 1e6, 1) for key, seconds in totals.items()}
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        flush.zero_()
                        call()
                    torch.cuda.synchronize()
                trace_name = f"trace_{name}_{mode.replace('+', '_')}_{'x'.join(map(str, shape[:4]))}.json"
                prof.export_chrome_trace(str(out / trace_name))
                kernels = {}
                for event in prof.key_averages():
                    # Kernels only: a CPU op (an autograd Function, aten::fill_) also reports the
                    # device time of the kernels it launched, which would count them twice.
                    if event.device_type != DeviceType.CUDA or not event.count:
                        continue
                    device_us = getattr(event, "self_device_time_total", None)
                    if device_us is None:
                        device_us = event.self_cuda_time_total
                    # Names are cut to 60 characters, so two template kernels can share one.
                    count, us = kernels.get(event.key[:60], (0, 0.0))
                    kernels[event.key[:60]] = (count + event.count // 10, round(us + device_us / 10, 1))
                gpu_total = sum(us for _, us in kernels.values())
                print(f"[trace] {name} {mode} {shape}: do_bench {ms:.4f} ms, host {host:.1f} us/call, wrapper us/call {parts}, "
                      f"GPU {gpu_total:.1f} us/call incl. flush")
                for kernel, (count, us) in sorted(kernels.items(), key=lambda item: -item[1][1]):
                    print(f"    {us:9.1f} us  x{count}  {kernel}")
                rec.add(shape, f"trace_{name}", mode, "bf16", ms, None,
                        json.dumps({"host_us": round(host, 1), "wrappers_us": parts,
                                    "kernels_us": {key: us for key, (_, us) in kernels.items()}}), "trace")


def part_precision(rec):
    """One float32 [64, 64] x [64, 64] tl.dot per input precision against float64 (notebook 04)."""
    size = 64
    torch.manual_seed(0)
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    ref = a.double() @ b.double()
    for precision in ("tf32", "tf32x3", "ieee"):
        c = torch.empty(size, size, device="cuda")
        _dot_kernel[(1,)](a, b, c, size, size, size, precision)
        rec.add((1, 1, size, size, size), f"dot_precision_{precision}", "fwd", "fp32", None,
                relative_error(c, ref), f"input_precision={precision}", "precision")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--parts", default="ceilings,tune,shapes,sweep,precision")
    parser.add_argument("--methods", default=",".join(KERNEL_METHODS))
    parser.add_argument("--no-fla", action="store_true", help="leave fla out even when it is installed")
    parser.add_argument("--configs", default=None,
                        help='JSON {method: [config, ...]}: try these in "tune" instead of TUNING_CANDIDATES')
    parser.add_argument("--tune-backward", action="store_true", help="time forward+backward in tune too")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds in the shapes part")
    parser.add_argument("--shapes", default="", help="e.g. '8,16,4096,64;1,8,65536,64' (default: the issue shapes)")
    args = parser.parse_args()
    if not ttx_tutorial.on_gpu():
        sys.exit("gpu_check.py needs a CUDA GPU (ttx_tutorial is in interpreter mode)")

    parts = set(args.parts.split(","))
    methods = [m for m in args.methods.split(",") if m]
    shapes = ISSUE_SHAPES
    if args.shapes:  # B,H,T,D[,E]
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
        shapes = [s if len(s) == 5 else s + (s[3],) for s in shapes]
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "date": datetime.date.today().isoformat(),
           "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:])}
    fla = {} if args.no_fla else load_fla()
    env["fla"] = importlib.import_module("fla").__version__ if fla else None
    print(json.dumps(env))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "h200" if "H200" in env["gpu"] else env["gpu"].replace(" ", "_").lower()
    rec = Recorder(out / f"{name}.json", env)
    started = time.time()
    torch.manual_seed(0)
    if "ceilings" in parts:
        part_ceilings(rec, env)
    if "precision" in parts:
        part_precision(rec)
    if "overhead" in parts:
        part_overhead(rec, fla, [(1, 8, 256, 64, 64), (8, 16, 4096, 64, 64)])
    if "tune" in parts:
        part_tune(rec, methods, shapes, json.loads(args.configs) if args.configs else None,
                  args.tune_backward)
    if "shapes" in parts:
        part_shapes(rec, methods, shapes, fla, args.rounds)
    if "sweep" in parts:
        part_sweep(rec, methods, fla)
    if "trace" in parts:
        part_trace(rec, fla, shapes, out)
    env["seconds"] = round(time.time() - started, 1)
    rec.save()
    print(f"\nwrote {rec.path} ({len(rec.rows)} rows, {env['seconds']} s)")
    summary(rec.rows, env)


def summary(rows, env):
    """The issue shapes, best of ours against the best fla, forward and forward+backward: first as
    ``do_bench`` of one call (host included), then as GPU time alone (CUDA-graph replay)."""
    floor_bytes = lambda s: 2 * (2 * s[0] * s[1] * s[2] * s[3] + 2 * s[0] * s[1] * s[2] * s[4])  # noqa: E731
    table = [r for r in rows if r["part"] == "shapes" and r["ms"] is not None]
    if not table:
        return
    for key, title in (("ms", "do_bench, one call"), ("gpu_ms", "GPU time, CUDA-graph replay")):
        print(f"\n{title}\n{'shape':24s} {'mode':8s} " + " ".join(f"{m:>10s}" for m in KERNEL_METHODS)
              + f" {'fla best':>10s} {'speedup':>8s} {'floor':>7s}")
        for shape in dict.fromkeys(tuple(r["shape"]) for r in table):
            for mode in ("fwd", "fwd+bwd"):
                cells = {r["impl"]: r.get(key) for r in table if tuple(r["shape"]) == shape and r["mode"] == mode}
                cells = {impl: ms for impl, ms in cells.items() if ms is not None}
                fla_best = min((ms for impl, ms in cells.items() if impl.startswith("fla")), default=math.nan)
                our_best = min((cells[m] for m in KERNEL_METHODS if m in cells), default=math.nan)
                floor = floor_bytes(shape) / (env.get("copy_TBps", 4.27) * 1e12) * 1e3 if mode == "fwd" else math.nan
                print(f"{str(shape):24s} {mode:8s} " + " ".join(f"{cells.get(m, math.nan):10.4f}" for m in KERNEL_METHODS)
                      + f" {fla_best:10.4f} {fla_best / our_best:8.2f} {floor:7.4f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
