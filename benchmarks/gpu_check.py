"""The GPU checks ``python -m ttx_tutorial.bench`` does not make: configs, precision, host cost.

    python benchmarks/gpu_check.py --out DIR --parts tune,precision --methods chunked,scan

Parts (``--parts``, comma-separated, default tune,precision):
  tune       every candidate config of each kernel (its TUNING_CANDIDATES) at the reference
             shapes, through the kernel file's public function; with --tune-backward, forward+backward too
  precision  float32 tl.dot error with TF32 and with IEEE inputs (notebook 04)
  overhead   where a call's time goes: each public layer of the chunked path (API with the
             method named and with "auto", the kernel file's function, the entry the API calls)
             and fla timed with do_bench, on the host alone, and as a replayed CUDA graph (GPU
             time only); plus a cProfile of the API's host path
  trace      per shape, ours (the method ``auto`` picks) and fla's best kernel, forward and
             forward+backward: host time per call, the host time of the costliest host
             operations, and the GPU time of every kernel from torch.profiler (a Chrome trace
             each, in --out)

Timing against T, the side-by-side table of every method and peer, and the copy ceiling are
``python -m ttx_tutorial.bench``'s. Timings are medians of ``triton.testing.do_bench``; inputs
are bfloat16 with q, k ~ N(0, 1)/sqrt(D) and v ~ N(0, 1), layout (B, H, T, D) (fla gets
(B, T, H, D), transposed outside the timed region, called with scale=1.0, normalize=False).
Output: ``<gpu>.json`` in ``--out``, in ``ttx_tutorial/course/data``'s format, every row naming its
recording: date, GPU, versions and this command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from ttx_tutorial.testing import random_inputs, reference, relative_error  # noqa: E402
from ttx_tutorial.course.figures import recording_name  # noqa: E402
from ttx_tutorial.bench import REFERENCE_SHAPES, graph_ms, host_us, parse_shapes  # noqa: E402

KERNEL_METHODS = ["recurrent", "chunked", "scan"]


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


def kernel_function(method):
    """The kernel file's entry for checked inputs, the function the API calls (it takes ``config``)."""
    return ttx_tutorial.method_info(method).function


def kernel_file(method):
    """The kernel file behind a Triton method: the module of the function the API calls."""
    return sys.modules[kernel_function(method).__module__]


class Recorder:
    """Collects rows and rewrites the results file after each one, so a run cut short keeps them."""

    def __init__(self, path, env):
        self.rows = []
        self.path = path
        self.env = env
        # Every row names its recording by date, GPU, versions and command, as in ttx_tutorial/course/data.
        self.recording = recording_name(env, env["command"])

    def save(self):
        self.path.write_text(json.dumps({"env": self.env, "recordings": {self.recording: {}},
                                         "rows": self.rows}, indent=1))

    def add(self, shape, impl, mode, dtype, ms, rel_err=None, config=None, part=""):
        row = {"shape": list(shape), "impl": impl, "mode": mode, "dtype": dtype,
               "ms": None if ms is None else round(ms, 5),
               "rel_err": None if rel_err is None else float(f"{rel_err:.3e}"),
               "config": config, "part": part, "recording": self.recording}
        self.rows.append(row)
        self.save()
        err = "" if rel_err is None else f"  err {rel_err:.1e}"
        ms_text = "   n/a" if ms is None else f"{ms:9.4f}"
        print(f"[{part}] {impl:28s} {mode:8s} {str(tuple(shape)):26s} {ms_text} ms{err}  {config or ''}",
              flush=True)


def make_inputs(shape, dtype=torch.bfloat16, requires_grad=False, seed=0):
    B, H, T, D, E = shape
    return random_inputs(B, H, T, D, E, dtype=dtype, device="cuda", seed=seed, requires_grad=requires_grad)


def forward_error(fn, q, k, v):
    """Relative error of fn's output on batch 0 and up to two heads against float64."""
    heads = slice(0, min(2, q.shape[1]))
    ref, _ = reference(q[:1, heads], k[:1, heads], v[:1, heads], device="cuda", chunk=2048)
    return relative_error(fn(q, k, v)[:1, heads], ref)


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


def part_tune(rec, methods, shapes, configs=None, backward=False):
    """Each method's default against its TUNING_CANDIDATES (or the ``--configs`` given for it);
    with ``backward``, forward+backward too (a config applies to every launch of the call)."""
    best = {}
    for method in methods:
        module = kernel_file(method)
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


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    offs_m, offs_k, offs_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :])
    c = tl.dot(a, b, input_precision=INPUT_PRECISION)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], c)


def part_overhead(rec, fla, shapes):
    """Each public layer of the chunked forward, timed three ways (see the module docstring)."""
    import cProfile
    import pstats

    chunked = kernel_file("chunked")
    entry = kernel_function("chunked")
    for shape in shapes:
        q, k, v = make_inputs(shape)
        layers = {
            "api": lambda: ttx_tutorial.causal_product(q, k, v, "chunked"),
            "api_auto": lambda: ttx_tutorial.causal_product(q, k, v),
            "kernel_function": lambda: chunked.chunked_causal_product(q, k, v),
            "run_validated": lambda: entry(q, k, v, None),
            "empty_x2": lambda: (torch.empty_like(v), torch.empty(*shape[:2], shape[3], shape[4], device="cuda")),
        }
        if "fla_fused_chunk" in fla:
            qt, kt, vt = to_fla_layout(q, k, v)
            layers["fla_fused_chunk"] = lambda: fla["fla_fused_chunk"](qt, kt, vt, scale=1.0, normalize=False)
        for name, fn in layers.items():
            fn()
            ms = median_ms(fn)
            host = host_us(fn, 200)
            try:
                graph = None if name == "empty_x2" else graph_ms(fn)  # allocations alone: no kernel
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
                json.dumps({"host_us": round(host_us(step, 200), 1)}), "overhead")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            ttx_tutorial.causal_product(q, k, v, "chunked")
        profile.disable()
        torch.cuda.synchronize()
        print(f"[overhead] cProfile of 200 API calls at {shape}, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


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
                host = host_us(call, 100)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        flush.zero_()
                        call()
                    torch.cuda.synchronize()
                trace_name = f"trace_{name}_{mode.replace('+', '_')}_{'x'.join(map(str, shape[:4]))}.json"
                prof.export_chrome_trace(str(out / trace_name))
                kernels, host_ops = {}, {}
                for event in prof.key_averages():
                    if event.device_type == DeviceType.CPU and event.count:
                        # Host time by operation (autograd Functions, aten ops, launches), per call.
                        host_ops[event.key[:60]] = round(event.self_cpu_time_total / 10, 1)
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
                host_ops = dict(sorted(host_ops.items(), key=lambda item: -item[1])[:8])
                print(f"[trace] {name} {mode} {shape}: do_bench {ms:.4f} ms, host {host:.1f} us/call, "
                      f"costliest host operations us/call {host_ops}, GPU {gpu_total:.1f} us/call incl. flush")
                for kernel, (count, us) in sorted(kernels.items(), key=lambda item: -item[1][1]):
                    print(f"    {us:9.1f} us  x{count}  {kernel}")
                rec.add(shape, f"trace_{name}", mode, "bf16", ms, None,
                        json.dumps({"host_us": round(host, 1), "host_ops_us": host_ops,
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
    parser.add_argument("--parts", default="tune,precision")
    parser.add_argument("--methods", default=",".join(KERNEL_METHODS))
    parser.add_argument("--no-fla", action="store_true", help="leave fla out even when it is installed")
    parser.add_argument("--configs", default=None,
                        help='JSON {method: [config, ...]}: try these in "tune" instead of TUNING_CANDIDATES')
    parser.add_argument("--tune-backward", action="store_true", help="time forward+backward in tune too")
    parser.add_argument("--shapes", default="", help="e.g. '8,16,4096,64;1,8,65536,64' (default: the reference shapes)")
    args = parser.parse_args()
    if not ttx_tutorial.on_gpu():
        sys.exit("gpu_check.py needs a CUDA GPU (ttx_tutorial is in interpreter mode)")

    parts = set(args.parts.split(","))
    unknown = parts - {"tune", "precision", "overhead", "trace"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; timing against T, the side-by-side shapes and "
                     "the copy ceiling are python -m ttx_tutorial.bench's")
    methods = [m for m in args.methods.split(",") if m]
    shapes = parse_shapes(args.shapes, "--shapes") if args.shapes else REFERENCE_SHAPES
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "date": datetime.date.today().isoformat(),
           "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:])}
    fla = {} if args.no_fla else load_fla()
    env["fla"] = version("fla-core") if fla else None
    print(json.dumps(env))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "h200" if "H200" in env["gpu"] else env["gpu"].replace(" ", "_").lower()
    rec = Recorder(out / f"{name}.json", env)
    started = time.time()
    torch.manual_seed(0)
    if "precision" in parts:
        part_precision(rec)
    if "overhead" in parts:
        part_overhead(rec, fla, [(1, 8, 256, 64, 64), (8, 16, 4096, 64, 64)])
    if "tune" in parts:
        part_tune(rec, methods, shapes, json.loads(args.configs) if args.configs else None,
                  args.tune_backward)
    if "trace" in parts:
        part_trace(rec, fla, shapes, out)
    env["seconds"] = round(time.time() - started, 1)
    rec.save()
    print(f"\nwrote {rec.path} ({len(rec.rows)} rows, {env['seconds']} s)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
