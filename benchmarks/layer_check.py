"""Time normalised causal linear attention, its compiled form and one generation step.

    python benchmarks/layer_check.py results.json                 # GPU: the figures below
    python benchmarks/layer_check.py results.json --rounds 1      # CPU mode: tiny sizes, to try it

Rows (bfloat16; (B, H, T, D = E) = (8, 16, 4096, 64) on a GPU, (1, 2, 64, 16) in CPU mode):
  plain            causal_product(q, k, v), forward and forward+backward
  normalised       causal_linear_attention(q, k, v): elu + 1 features; "auto" picks chunked at
                   both sizes, whose kernels compute the normaliser beside the state, forward
                   and backward; and with feature_map="identity" on features mapped beforehand
                   (what fla's kernels take)
  fla_fused_chunk  fla's fused_chunk_linear_attn(normalize=True) on the same mapped features,
                   (B, T, H, D) layout made outside the timings; skipped when fla is missing
  layer            CausalLinearAttention(H * D, H) on x (B, T, H * D): projections, elu + 1
                   features, the normalised kernels and the output projection, as in a model
  compiled_*       torch.compile(mode="reduce-overhead", fullgraph=True) of plain, normalised
                   (its own operator, the kernels' normaliser, no ones column) and the layer:
                   the time of a call against the GPU's busy time in it (torch.profiler). The
                   bare operators' q, k, v come from outside the graph, which CUDA graph trees
                   copy into static buffers at every call; inside the layer only x is copied and
                   the weights are static, as in a model
  step             linear_attention_step (one launch of kernels/step.py) at (B, H, D, E) =
                   (8, 16, 64, 64) ((2, 2, 16, 16) in CPU mode), elu features, normalised
  step_pytorch     the same step as PyTorch operations (state update, product, normaliser)
  step_host        the step's wrappers alone: linear_attention_step with the kernel launch
                   replaced by a no-op (checks, output allocation, launch plan), per call
Each row: "ms" (median of triton.testing.do_bench of one call, host included; the median wall
time in CPU mode) and, on a GPU, "gpu_ms" (the same call replayed from a CUDA graph, or for the
compiled rows the kernels' busy time). The step rows' "ms" is instead the wall time of 2000
calls in a row divided by 2000, with one synchronisation at the end, the least of five such
loops: what a generation loop sees (do_bench empties the L2 cache before each call, and the
host's work for the next call hides behind that). Every fwd+bwd call takes its gradients with torch.autograd.grad and drops
them: nothing outlives the call, as compiled CUDA graphs require (each replay reuses its
output memory; a gradient accumulated into .grad would be read after the next replay
overwrote it: a known PyTorch limitation, github.com/pytorch/pytorch/issues/169545). Ours and fla alternate for --rounds rounds (the host's speed drifts within a
run); the median round is kept. "ratios" compares the rows the targets name. The JSON also
records the date, GPU, versions and this command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import bench  # noqa: E402
from ttx_tutorial.course.figures import time_ms  # noqa: E402
from ttx_tutorial.kernels import step as step_kernels  # noqa: E402
from ttx_tutorial.testing import random_inputs, relative_error  # noqa: E402

ON_GPU = ttx_tutorial.on_gpu()


def graph_ms(fn):
    """Median ms of fn replayed from a CUDA graph: the GPU's time alone (the bench's definition)."""
    return bench.graph_ms(fn) if ON_GPU else None


def busy_ms(fn, calls=20):
    """Milliseconds per call that GPU kernels ran (torch.profiler), host gaps excluded."""
    if not ON_GPU:
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e3


def loop_ms(fn, calls=2000, loops=5):
    """Wall ms per call of ``calls`` calls in a row, synchronised once at the end: the least over
    ``loops`` such loops, since other work on the host only ever adds time (3 calls, one loop in
    CPU mode)."""
    calls, loops = (calls, loops) if ON_GPU else (3, 1)
    for _ in range(10 if ON_GPU else 1):
        fn()
    best = float("inf")
    for _ in range(loops):
        if ON_GPU:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if ON_GPU:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3 / calls)
    return best


def forward_and_backward(fn, inputs):
    """fn's forward on ``inputs``, and forward+backward on leaf copies of them. The gradients
    are returned by torch.autograd.grad and dropped, never accumulated into .grad (see the
    module docstring)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    grad_out = torch.randn_like(fn(*inputs))

    def step():
        torch.autograd.grad(fn(*leaves), leaves, grad_out)

    return (lambda: fn(*inputs)), step


def load_fla():
    try:
        from fla.ops.linear_attn import fused_chunk_linear_attn
    except Exception as exc:  # fla is optional: record why it is missing
        return None, repr(exc)
    import fla

    return fused_chunk_linear_attn, getattr(fla, "__version__", "unknown")


def phi(x):
    return torch.nn.functional.elu(x) + 1


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](...)`` does nothing (and has no pre-run hooks, as
    the step's launcher asks)."""

    pre_run_hooks = ()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def pytorch_step(q, k, v, state, eps=1e-6):
    """The normalised step as PyTorch operations on the float32 (S, z) state: what the kernel replaces."""
    phi_q, phi_k = phi(q).to(state.dtype), phi(k).to(state.dtype)
    S, z = state[..., :-1], state[..., -1]
    S.add_(phi_k.unsqueeze(-1) * v.to(state.dtype).unsqueeze(-2))
    z.add_(phi_k)
    out = torch.einsum("bhd,bhde->bhe", phi_q, S) / ((phi_q * z).sum(-1, keepdim=True) + eps)
    return out.to(q.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median kept)")
    args = parser.parse_args()

    B, H, T, D = ttx_tutorial.size(cpu=(1, 2, 64, 16), gpu=(8, 16, 4096, 64))
    step_shape = ttx_tutorial.size(cpu=(2, 2, 16), gpu=(8, 16, 64))
    dtype = torch.bfloat16
    q, k, v = random_inputs(B, H, T, D, dtype=dtype, seed=0)
    mapped_q, mapped_k = phi(q), phi(k)
    fla_fn, fla_version = load_fla()

    def plain(q, k, v):
        return ttx_tutorial.causal_product(q, k, v)

    def normalised(q, k, v):
        return ttx_tutorial.causal_linear_attention(q, k, v)

    def normalised_mapped(q, k, v):
        return ttx_tutorial.causal_linear_attention(q, k, v, feature_map="identity")

    candidates = {"plain": (plain, (q, k, v)), "normalised": (normalised, (q, k, v)),
                  "normalised_mapped": (normalised_mapped, (mapped_q, mapped_k, v))}
    layer = ttx_tutorial.CausalLinearAttention(H * D, H, device=q.device, dtype=dtype)
    x = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(3)).to(q.device, dtype)
    candidates["layer"] = (layer, (x,))
    if fla_fn is not None:
        def fla_normalised(q, k, v):
            return fla_fn(q, k, v, scale=1.0, normalize=True)[0]

        to_fla = [x.transpose(1, 2).contiguous() for x in (mapped_q, mapped_k, v)]
        candidates["fla_fused_chunk"] = (fla_normalised, tuple(to_fla))
    if ON_GPU:  # the CPU interpreter cannot run under CUDA graphs; compiling there takes minutes
        def new_step(fn):
            # Each call is a new step for the CUDA graph trees: its outputs may replace the last call's.
            def call(*args):
                torch.compiler.cudagraph_mark_step_begin()
                return fn(*args)
            return call

        compiled_plain = new_step(torch.compile(plain, mode="reduce-overhead", fullgraph=True))
        compiled_normalised = new_step(torch.compile(normalised, mode="reduce-overhead", fullgraph=True))
        candidates["compiled_plain"] = (compiled_plain, (q, k, v))
        candidates["compiled_normalised"] = (compiled_normalised, (q, k, v))
        candidates["compiled_layer"] = (new_step(torch.compile(layer, mode="reduce-overhead", fullgraph=True)), (x,))

    errors = {}
    expected = ttx_tutorial.causal_linear_attention(q[:1, :2].double().cpu(), k[:1, :2].double().cpu(),
                                                    v[:1, :2].double().cpu(), method="quadratic")
    errors["normalised"] = relative_error(normalised(q, k, v)[:1, :2], expected)
    errors["normalised_mapped"] = relative_error(normalised_mapped(mapped_q, mapped_k, v)[:1, :2], expected)
    if fla_fn is not None:
        fla_out = candidates["fla_fused_chunk"][0](*candidates["fla_fused_chunk"][1]).transpose(1, 2)
        errors["fla_fused_chunk"] = relative_error(fla_out[:1, :2], expected)

    timings, failures = {}, {}
    for _ in range(args.rounds):
        for name, (fn, inputs) in candidates.items():
            if name in failures:
                continue
            try:
                forward, step = forward_and_backward(fn, inputs)
                compiled = name.startswith("compiled")
                for mode, call in (("fwd", forward), ("fwd+bwd", step)):
                    ms = time_ms(call)
                    gpu = busy_ms(call) if compiled else graph_ms(call)
                    timings.setdefault((name, mode), []).append((ms, gpu))
            except RuntimeError as error:  # recorded, and the other rows still measured
                failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                print(f"{name}: {failures[name]}", file=sys.stderr)

    rows = [{"name": name, "error": message} for name, message in failures.items()]
    for (name, mode), samples in timings.items():
        if name in failures:
            continue
        ms = statistics.median(s[0] for s in samples)
        gpus = [s[1] for s in samples if s[1] is not None]
        rows.append({"name": name, "mode": mode, "shape": [B, H, T, D, D], "dtype": "bf16",
                     "ms": round(ms, 5), "rounds_ms": [round(s[0], 5) for s in samples],
                     "gpu_ms": round(statistics.median(gpus), 5) if gpus else None,
                     "rel_err": errors.get(name)})

    # One generation step: (B, H, D) queries and keys, (B, H, E) values, state (B, H, D, E + 1).
    sb, sh, sd = step_shape
    sq, sk, sv = (x[:, :, 0] for x in random_inputs(sb, sh, 1, sd, dtype=dtype, seed=1))
    # The state of a 100-token prompt (from zeros, every output would be about v itself).
    _, prompt_state = ttx_tutorial.causal_linear_attention(
        *random_inputs(sb, sh, 100, sd, dtype=torch.float32, seed=2), method="quadratic", return_state=True)
    states = {name: prompt_state.clone() for name in ("step", "step_pytorch")}
    steps = {"step": lambda: ttx_tutorial.linear_attention_step(sq, sk, sv, states["step"]),
             "step_pytorch": lambda: pytorch_step(sq, sk, sv, states["step_pytorch"])}
    expected_step = pytorch_step(sq.double().cpu(), sk.double().cpu(), sv.double().cpu(),
                                 prompt_state.double().cpu())
    step_samples = {}
    with torch.no_grad():  # the step is inference only
        step_errors = {name: relative_error(fn(), expected_step) for name, fn in steps.items()}
        for _ in range(args.rounds):
            for name, fn in steps.items():
                step_samples.setdefault(name, []).append((loop_ms(fn), graph_ms(fn)))
        # The wrappers' share of a call: everything but Triton's launcher and the kernel.
        # The kept launches put aside too, so that every call reaches the stand-in.
        real_kernel, kept = step_kernels.step_kernel, dict(step_kernels._KEPT_LAUNCHES)
        step_kernels.step_kernel = _NoLaunch()
        step_kernels._KEPT_LAUNCHES.clear()
        try:
            step_samples["step_host"] = [(loop_ms(steps["step"]), None) for _ in range(args.rounds)]
        finally:
            step_kernels.step_kernel = real_kernel
            step_kernels._KEPT_LAUNCHES.clear()
            step_kernels._KEPT_LAUNCHES.update(kept)
        step_errors["step_host"] = None
    for name, samples in step_samples.items():
        gpus = [s[1] for s in samples if s[1] is not None]
        rows.append({"name": name, "mode": "fwd", "shape": [sb, sh, 1, sd, sd], "dtype": "bf16",
                     "ms": round(statistics.median(s[0] for s in samples), 5),
                     "rounds_ms": [round(s[0], 5) for s in samples],
                     "gpu_ms": round(statistics.median(gpus), 5) if gpus else None, "rel_err": step_errors[name]})

    by_name = {(r["name"], r["mode"]): r for r in rows if "mode" in r}

    def ratio(a, b, key):
        x, y = by_name.get(a), by_name.get(b)
        if x is None or y is None or x[key] is None or y[key] is None:
            return None
        return round(x[key] / y[key], 3)

    ratios = {
        "normalised / plain, fwd+bwd, GPU time (target <= 1.2)":
            ratio(("normalised", "fwd+bwd"), ("plain", "fwd+bwd"), "gpu_ms"),
        "normalised / plain, fwd+bwd, per call": ratio(("normalised", "fwd+bwd"), ("plain", "fwd+bwd"), "ms"),
        "fla fused_chunk / normalised, fwd, per call (target >= 3)":
            ratio(("fla_fused_chunk", "fwd"), ("normalised", "fwd"), "ms"),
        "fla fused_chunk / normalised, fwd+bwd, per call (target >= 3)":
            ratio(("fla_fused_chunk", "fwd+bwd"), ("normalised", "fwd+bwd"), "ms"),
        "fla fused_chunk / normalised_mapped (the same features in), fwd, per call":
            ratio(("fla_fused_chunk", "fwd"), ("normalised_mapped", "fwd"), "ms"),
        "fla fused_chunk / normalised_mapped (the same features in), fwd+bwd, per call":
            ratio(("fla_fused_chunk", "fwd+bwd"), ("normalised_mapped", "fwd+bwd"), "ms"),
        "normalised_mapped / plain, fwd+bwd, GPU time":
            ratio(("normalised_mapped", "fwd+bwd"), ("plain", "fwd+bwd"), "gpu_ms"),
        "compiled plain / plain, fwd+bwd, GPU time": ratio(("compiled_plain", "fwd+bwd"), ("plain", "fwd+bwd"), "gpu_ms"),
        "compiled normalised / normalised, fwd+bwd, GPU time":
            ratio(("compiled_normalised", "fwd+bwd"), ("normalised", "fwd+bwd"), "gpu_ms"),
        "compiled layer / layer, fwd+bwd, per call":
            ratio(("compiled_layer", "fwd+bwd"), ("layer", "fwd+bwd"), "ms"),
        "step_pytorch / step, per call": ratio(("step_pytorch", "fwd"), ("step", "fwd"), "ms"),
        "step_pytorch / step, replay": ratio(("step_pytorch", "fwd"), ("step", "fwd"), "gpu_ms"),
    }
    step_row = by_name.get(("step", "fwd"))
    ratios["step per call / 0.040 ms (target <= 1)"] = round(step_row["ms"] / 0.040, 3)
    ratios["step replay / 0.006 ms (target <= 1)"] = (
        round(step_row["gpu_ms"] / 0.006, 3) if step_row["gpu_ms"] is not None else None)
    for name in ("compiled_plain", "compiled_normalised", "compiled_layer"):
        row = by_name.get((name, "fwd+bwd"))
        ratios[f"{name} fwd+bwd, call / GPU busy (target <= 1.3)"] = (
            round(row["ms"] / row["gpu_ms"], 3) if row and row["gpu_ms"] else None)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if ON_GPU else f"CPU interpreter ({platform.machine()})",
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "fla": fla_version if fla_fn is not None else None, "fla_missing": None if fla_fn else fla_version,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "mode": ttx_tutorial.describe()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "rows": rows, "ratios": ratios}, indent=1))
    for row in rows:
        if "error" in row:
            print(f"{row['name']:22s} failed: {row['error']}")
            continue
        gpu = "" if row["gpu_ms"] is None else f"  (GPU {row['gpu_ms']:.4f})"
        err = "" if row["rel_err"] is None else f"  err {row['rel_err']:.1e}"
        print(f"{row['name']:22s} {row['mode']:8s} {row['ms']:9.4f} ms{gpu}{err}")
    for key, value in ratios.items():
        print(f"{key}: {value}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
