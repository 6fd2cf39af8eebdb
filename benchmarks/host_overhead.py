"""Where the host's microseconds of one call go: per stage, with the Triton launches stubbed out.

    python benchmarks/host_overhead.py                  # CPU or GPU; under 2 minutes
    python benchmarks/host_overhead.py --json OUT.json  # the same, also written as JSON
    python benchmarks/host_overhead.py --dtype float32  # float32 under torch.set_float32_matmul_precision("high")

Part 1, stubbed launches (any machine): every ``kernel[grid](...)`` of the kernel files is
replaced by a no-op for the length of this part, so that what remains is the package's own
Python and PyTorch work on the way to a launch: the API's checks and dispatch, the kernel file's
wrapper, the autograd Function, the launch plan and the output allocations. Small tensors on
the package's device (CPU tensors in CPU mode: the same Python runs, only the allocator
differs). Each stage is timed alone, as the least of five loops' mean
(``time.perf_counter_ns``; ``--cpu-time``: the thread's CPU time, on a machine shared with
other jobs):

  api          ttx_tutorial.causal_product(q, k, v, method)              (forward)
  validated    the kernel file's _run_validated(q, k, v): the API's call without its checks
  launch       the kernel file's forward launch function alone: plan, allocations, arguments
  checks       _validation.check_inputs(...) alone, the API's checks
  floor        a bare torch.autograd.Function that only allocates the outputs: the least a
               differentiable operator costs (forward with inputs that need no gradient)
  api fwd+bwd  causal_product and o.backward(grad) with q, k, v requiring gradients
  floor fwd+bwd
  step         linear_attention_step(q, k, v, state) at (B, H, D, E) = (8, 16, 64, 64)
  step_update  kernels/step.py's entry, and step _launch alone; floor: torch.empty of o

``--profile STAGE`` prints cProfile's top functions of one stage (e.g. ``chunked:api``).
Part 1 also counts the launches of one call of each method, forward and forward+backward: each
costs the host a Triton launch, and chunked's backward of heads wider than 64, or of float32
under "highest", is three launches where other heads up to 64 wide take one.
``--dtype float32`` runs parts 1 and 2 on float32 inputs under ``--float32-precision`` (PyTorch's
setting, "high" by default: the products it gives the tensor cores change the launches' plans).

Part 2, real launches, GPU only: host time per call of forward and forward+backward of
chunked, scan and recurrent at (8, 16, 4096, 64) in ``--dtype`` and again at T = 64 (the same
launches with microseconds of GPU work, so that a loop the GPU holds back cannot pass for host
time), and of the step: calls enqueued
in a loop that never waits for the GPU (synchronised once at the end, outside the timing),
as ``python -m ttx_tutorial.bench`` measures ``host_us``; next to it the GPU's time of one call
replayed from a CUDA graph.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import _validation, bench  # noqa: E402
from ttx_tutorial.kernels import chunked, recurrent, scan, step  # noqa: E402
from ttx_tutorial.testing import random_inputs  # noqa: E402

ON_GPU = ttx_tutorial.on_gpu()
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FAMILIES = {"chunked": chunked, "scan": scan, "recurrent": recurrent}
#: Every kernel the wrappers launch, by file: the names part 1 stubs.
KERNELS = {chunked: ("chunked_kernel", "chunked_backward_kernel"),
           scan: ("scan_summaries_kernel", "scan_outputs_kernel", "scan_backward_kernel"),
           recurrent: ("recurrent_tokens_kernel", "recurrent_blocks_kernel"),
           step: ("step_kernel",)}


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](...)`` does nothing but count itself in
    ``LAUNCHES`` (and has no pre-run hooks, as the step's launcher asks)."""

    pre_run_hooks = ()

    def __getitem__(self, grid):
        return _no_op


#: Launches of the stubbed kernels so far (``_no_op`` adds one each).
LAUNCHES = [0]


def _no_op(*args, **kwargs):
    LAUNCHES[0] += 1


@contextlib.contextmanager
def stubbed_launches():
    """Every kernel of the kernel files replaced by a no-op, restored on exit."""
    saved = {(module, name): getattr(module, name) for module, names in KERNELS.items() for name in names}
    kept = dict(step._KEPT_LAUNCHES)  # the step's kept launches would bypass the stand-in
    try:
        step._KEPT_LAUNCHES.clear()
        for module, name in saved:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
        step._KEPT_LAUNCHES.clear()
        step._KEPT_LAUNCHES.update(kept)


#: The clock of the stubbed stages: wall time, or with --cpu-time this thread's CPU time, which
#: a machine shared with other jobs does not inflate by preempting the loop.
CLOCK = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def mean_us(fn, calls, repeats=5, clock=time.perf_counter_ns):
    """Microseconds per call: the least over ``repeats`` loops of the mean of ``calls // repeats``
    calls in a row (other processes only ever add time), after a few unmeasured calls."""
    for _ in range(max(10, calls // 20)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(max(1, calls // repeats)):
            fn()
        best = min(best, (clock() - start) / max(1, calls // repeats) / 1e3)
    return best


class _Floor(torch.autograd.Function):
    """The least a differentiable causal product can cost: allocate o and S_T, and the gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, _, D = q.shape
        E = v.shape[-1]
        return torch.empty_like(v), torch.empty((B, H, D, E), dtype=torch.float32, device=v.device)

    @staticmethod
    def backward(ctx, grad_o, grad_state):
        return torch.empty_like(grad_o), torch.empty_like(grad_o), torch.empty_like(grad_o)


def forward_launch(family, q, k, v):
    """The file's own forward launch function (their signatures differ)."""
    if family is chunked:
        return chunked._launch(q, k, v, None, reverse=False, config=None)
    if family is recurrent:
        return recurrent._launch(q, k, v, None, reverse=False, store_final_state=True, config=None)
    return scan._launch(q, k, v, None, None)


def launches_per_call(fn):
    """How many kernel launches one call of ``fn`` makes (launches stubbed)."""
    before = LAUNCHES[0]
    fn()
    return LAUNCHES[0] - before


def stub_stages(calls, clock, dtype=torch.bfloat16):
    """({stage: microseconds per call}, the stages, {method: (launches forward, forward+backward)})
    with the launches stubbed (see the module docstring)."""
    B, H, T, D = 2, 2, 64, 16
    q, k, v = random_inputs(B, H, T, D, dtype=dtype, seed=0)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grad_o = torch.randn_like(v)
    stages = {}

    def backward_of(fn):
        def call():
            out = fn(*leaves)
            (out[0] if isinstance(out, tuple) else out).backward(grad_o)
        return call

    with stubbed_launches():
        for name, family in FAMILIES.items():
            stages[f"{name}:api"] = lambda name=name: ttx_tutorial.causal_product(q, k, v, name)
            stages[f"{name}:validated"] = lambda family=family: family._run_validated(q, k, v)
            stages[f"{name}:launch"] = lambda family=family: forward_launch(family, q, k, v)
            stages[f"{name}:api fwd+bwd"] = backward_of(lambda *x, name=name: ttx_tutorial.causal_product(*x, name))
        stages["auto:api"] = lambda: ttx_tutorial.causal_product(q, k, v)
        stages["checks"] = lambda: _validation.check_inputs(
            q, k, v, None, method="chunked", dtypes=_validation.KERNEL_DTYPES, max_head_dim=256,
            expected_device=ttx_tutorial.DEVICE.type, index_limit=_validation.KERNEL_INDEX_LIMIT)
        stages["floor"] = lambda: _Floor.apply(q, k, v)
        stages["floor fwd+bwd"] = backward_of(_Floor.apply)

        sq, sk, sv = (x[:, :, 0] for x in random_inputs(8, 16, 1, 64, dtype=torch.bfloat16, seed=1))
        state = torch.zeros(8, 16, 64, 65, device=sq.device)
        stages["step"] = lambda: ttx_tutorial.linear_attention_step(sq, sk, sv, state)
        stages["step:step_update"] = lambda: step.step_update(sq, sk, sv, state)
        stages["step:launch"] = lambda: step._launch(sq, sk, sv, state, "elu", True, 1e-6)
        stages["step:floor"] = lambda: torch.empty((8, 16, 64), dtype=sq.dtype, device=sq.device)
        with torch.no_grad():  # the step is inference only; torch.no_grad as in a generation loop
            step_stages = {name for name in stages if name.startswith("step")}
            results = {}
            for name, fn in stages.items():
                if name in step_stages:
                    results[name] = mean_us(fn, calls, clock=clock)
            with torch.enable_grad():
                for name, fn in stages.items():
                    if name not in step_stages:
                        results[name] = mean_us(fn, calls // 4 if "bwd" in name else calls, clock=clock)
                launches = {name: (launches_per_call(stages[f"{name}:api"]),
                                   launches_per_call(stages[f"{name}:api fwd+bwd"])) for name in FAMILIES}
    return results, stages, launches


def profile(stages, stage, calls):
    """cProfile's top functions over ``calls`` calls of one stage (launches stubbed)."""
    fn = stages[stage]
    grad_mode = torch.no_grad() if stage.startswith("step") else torch.enable_grad()
    with stubbed_launches(), grad_mode:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def real_host_times(T=4096, dtype=torch.bfloat16):
    """GPU only: {(name, mode): (host us per call, GPU ms of one call replayed)} at (8, 16, T, 64)."""
    q, k, v = random_inputs(8, 16, T, 64, dtype=dtype, seed=0)
    grad_o = torch.randn_like(v)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    rows = {}
    for name in FAMILIES:
        def forward(name=name):
            return ttx_tutorial.causal_product(q, k, v, name)

        def forward_backward(name=name):
            ttx_tutorial.causal_product(*leaves, name).backward(grad_o)

        for mode, fn, graph_leaves in (("fwd", forward, ()), ("fwd+bwd", forward_backward, leaves)):
            fn()
            calls = 200 if name != "recurrent" else 20  # recurrent is GPU-bound; its host time is flat
            rows[(name, mode)] = (bench.host_us(fn, calls), bench.graph_ms(fn, graph_leaves))
    sq, sk, sv = (x[:, :, 0] for x in random_inputs(8, 16, 1, 64, dtype=torch.bfloat16, seed=1))
    state = torch.zeros(8, 16, 64, 65, device=sq.device)
    with torch.no_grad():
        def one_step():
            return ttx_tutorial.linear_attention_step(sq, sk, sv, state)

        rows[("step", "fwd")] = (bench.host_us(one_step, 2000), bench.graph_ms(one_step))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=4000, help="calls per stubbed stage (default 4000)")
    parser.add_argument("--profile", metavar="STAGE", help="cProfile one stubbed stage, e.g. chunked:api")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the stubbed stages by this thread's CPU time (for machines shared with other jobs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="the inputs of the methods' stages and real launches (default bfloat16)")
    parser.add_argument("--float32-precision", choices=("highest", "high", "medium"), default="high",
                        help="torch.set_float32_matmul_precision for --dtype float32 (default high)")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32:
        torch.set_float32_matmul_precision(args.float32_precision)
    label = args.dtype if dtype != torch.float32 else f"float32 under {args.float32_precision!r}"

    stub, stages, launches = stub_stages(args.calls, CLOCK["cpu" if args.cpu_time else "wall"], dtype)
    print(f"{ttx_tutorial.describe()}\n\nHost microseconds per call, Triton launches stubbed "
          f"((2, 2, 64, 16) {label}; step (8, 16, 64, 64) bf16; {'CPU' if args.cpu_time else 'wall'} time):")
    for name in FAMILIES:
        api, validated, launch = (stub[f"{name}:{s}"] for s in ("api", "validated", "launch"))
        print(f"  {name:10s} api {api:6.1f} = checks+dispatch {api - validated:5.1f} + wrapper "
              f"{validated - launch:5.1f} + launch {launch:5.1f};   fwd+bwd {stub[f'{name}:api fwd+bwd']:6.1f}"
              f";   launches {launches[name][0]} / {launches[name][1]}")
    print(f"  auto       api {stub['auto:api']:6.1f};   the API's checks alone {stub['checks']:5.1f}")
    print(f"  floor      {stub['floor']:6.1f} (autograd.Function allocating the outputs);   "
          f"fwd+bwd {stub['floor fwd+bwd']:6.1f}")
    print(f"  step       {stub['step']:6.1f} = linear_attention_step {stub['step'] - stub['step:step_update']:5.1f}"
          f" + step_update {stub['step:step_update'] - stub['step:launch']:5.1f} + launch {stub['step:launch']:5.1f}"
          f";   floor (torch.empty of o) {stub['step:floor']:5.1f}")
    if args.profile:
        profile(stages, args.profile, args.calls)

    real = {}
    if ON_GPU:
        # At T = 4096 a loop of calls can outrun the GPU (gradients accumulate, as in training,
        # and the launch queue fills), and then measures the GPU; at T = 64 the same launches do
        # microseconds of GPU work, so the loop measures the host alone.
        for T in (4096, 64):
            print(f"\nReal launches at (8, 16, {T}, 64) {label} (step: (8, 16, 64, 64) bf16): host us per call "
                  "in a loop, GPU ms of a graph replay")
            for (name, mode), (host, gpu) in real_host_times(T, dtype).items():
                real[(name, mode, T)] = (host, gpu)
                print(f"  {name:10s} {mode:8s} host {host:7.1f} us   GPU {gpu:.4f} ms")
    if args.json:
        env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if ON_GPU else "CPU interpreter",
               "torch": torch.__version__, "triton": __import__("triton").__version__,
               "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "inputs": label}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "env": env, "stubbed_us": {k: round(v, 2) for k, v in stub.items()},
            "launches": {name: {"fwd": fwd, "fwd+bwd": both} for name, (fwd, both) in launches.items()},
            "real": [{"name": n, "mode": m, "T": T, "host_us": round(h, 2), "gpu_ms": round(g, 5)}
                     for (n, m, T), (h, g) in real.items()]}, indent=1))


if __name__ == "__main__":
    main()
