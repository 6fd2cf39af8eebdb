"""What one launch costs the host, layer by layer, for the generation step (GPU only).

    python benchmarks/launch_cost.py [--calls 2000] [--json OUT.json]

The step at (B, H, D, E) = (8, 16, 64, 64) bfloat16 does microseconds of GPU work, so a call's
time is the host's. Each row is the host time of one call in a loop of ``--calls`` calls that
never waits for the GPU (the best of five loops' means), peeling one layer at a time:

  api             ttx_tutorial.linear_attention_step(q, k, v, state)
  step_update     kernels/step.py's entry: checks (cached per signature), plan, launch (after
                  the first call, of the compiled kernel the JIT path returned: _KEPT_LAUNCHES)
  jit             step_kernel[grid](...): Triton's JIT path (binds and specialises the
                  arguments, finds the compiled kernel in its cache, then launches)
  compiled        the CompiledKernel the JIT path returned, called as kernel[grid](*args):
                  no binding or cache lookup, Triton's C launcher and the driver
  empty jit / empty compiled
                  the same two for a Triton kernel that does nothing, with 1 and with 6
                  pointer arguments (the launcher checks every pointer with the driver)
  torch add_      one PyTorch kernel launch (o.add_(1.0)) for comparison
  torch.empty     the output's allocation alone
  pytorch step    the same normalised step as PyTorch operations (layer_check.py's)
  fla step        fla's fused_recurrent_linear_attn on one token (T = 1), plain, its state
                  passed in and the final state returned (skipped when fla is missing)

The difference between rows says what a layer costs; "compiled" is the least a Triton launch
costs on this host through Triton's own launcher. A host's speed drifts within a run, so "api"
is also timed against itself with the kept launches off (every call through Triton's JIT path)
in alternating loops (``--rounds``, 9 by default), whose median times and median ratio are the
"kept against jit path" row.

Then the GPU's side ("replay_us"): the median of ``triton.testing.do_bench`` on a CUDA-graph
replay (the L2 cache emptied before each, as layer_check.py times the step), for the empty
kernel (the floor of such a measurement), the step with its default config, the two peer steps
above, and the step with each BLOCK_E in 16, 32, 64 and num_warps in 1, 2, 4, 8
(``--no-configs`` skips them); "x20"
rows replay a graph of 20 steps in a row and give the time per step, the state then in L2 as in
a generation loop; "do_bench_cudagraph" rows are ``triton.testing.do_bench_cudagraph``'s median,
the same with as many steps in the graph as fill 20 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import bench  # noqa: E402
from ttx_tutorial.kernels import step  # noqa: E402
from layer_check import pytorch_step  # noqa: E402  (this folder is the script's: on sys.path)


@triton.jit
def empty_kernel(a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, f_ptr, n, POINTERS: tl.constexpr):
    pass


class _KeepingNothing(dict):
    """Stands in for ``step._KEPT_LAUNCHES``: every launch then takes Triton's JIT path."""

    def __setitem__(self, key, value):
        pass


@contextlib.contextmanager
def kept_launches_off():
    kept, step._KEPT_LAUNCHES = step._KEPT_LAUNCHES, _KeepingNothing()
    try:
        yield
    finally:
        step._KEPT_LAUNCHES = kept


def loop_us(fn, calls):
    """Microseconds per call of ``fn`` in one loop of ``calls`` calls that does not wait for the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter_ns() - start) / calls / 1e3
    torch.cuda.synchronize()
    return elapsed


def kept_against_jit_path_us(fn, calls, rounds):
    """(median us of ``fn``, median us of ``fn`` with the kept launches off, median of the rounds'
    ratios), the two timed in alternating loops so that the host's drift reaches both alike."""
    a_times, b_times = [], []
    for _ in range(rounds):
        a_times.append(loop_us(fn, calls))
        with kept_launches_off():
            b_times.append(loop_us(fn, calls))
    ratios = sorted(a / b for a, b in zip(a_times, b_times))
    return sorted(a_times)[rounds // 2], sorted(b_times)[rounds // 2], ratios[rounds // 2]


def host_us(fn, calls):
    """Microseconds per call of ``fn`` in a loop that does not wait for the GPU, the best of five loops."""
    return min(loop_us(fn, calls) for _ in range(5))


def replay_us(fn, repeats=1):
    """Microseconds of GPU time per call of ``fn``: ``repeats`` calls captured in one CUDA graph
    (``ttx_tutorial.bench.graph_ms``), divided by ``repeats``."""
    def calls():
        for _ in range(repeats):
            fn()

    return 1e3 * bench.graph_ms(calls) / repeats


def peer_steps(q, k, v, state):
    """{name: one step} for the peers of the module docstring: PyTorch's operations on a state of
    their own, and fla's recurrent kernel on one token where fla imports."""
    pytorch_state = state.clone()
    steps = {"pytorch step": lambda: pytorch_step(q, k, v, pytorch_state)}
    try:
        from fla.ops.linear_attn import fused_recurrent_linear_attn
    except Exception as error:  # noqa: BLE001  fla is optional: say why it is missing
        print(f"{'fla step':28s} skipped: {type(error).__name__}: {error}", flush=True)
        return steps
    # fla takes (B, T, H, D) and returns a new state; timed plain (normalize=False), its normaliser
    # being a pass of its own.
    fla_q, fla_k, fla_v = (x.unsqueeze(1) for x in (q, k, v))
    fla_state = state[..., :-1].contiguous()
    steps["fla step"] = lambda: fused_recurrent_linear_attn(fla_q, fla_k, fla_v, initial_state=fla_state,
                                                            output_final_state=True)
    return steps


def cudagraph_us(fn):
    """Microseconds per call of ``fn`` by ``triton.testing.do_bench_cudagraph``: as many calls as
    fill 20 ms captured in one graph, the L2 cache left as the calls leave it."""
    return 1e3 * triton.testing.do_bench_cudagraph(fn, return_mode="median")


def replay_rows(q, k, v, state, *, configs):
    """The GPU's time of one step, by config, and of the peers' steps (see the module docstring)."""
    B, H, D = q.shape
    E = v.shape[-1]
    x = torch.zeros(1, device=q.device)
    o = torch.empty(B, H, E, device=q.device, dtype=q.dtype)
    arrivals = step._arrivals(state, B * H)
    arguments = [q, k, v, o, state, arrivals, H, D, E, *q.stride(), *k.stride(), *v.stride(), 1e-6]
    rows = {"empty kernel": lambda: empty_kernel[(1,)](x, None, None, None, None, None, 1, POINTERS=1),
            "step, default config": lambda: ttx_tutorial.linear_attention_step(q, k, v, state),
            **peer_steps(q, k, v, state)}
    if configs:
        for block_e in (16, 32, 64):
            for num_warps in (1, 2, 4, 8):
                grid = (B * H * triton.cdiv(E, block_e),)
                rows[f"step, BLOCK_E {block_e}, {num_warps} warps"] = (
                    lambda grid=grid, block_e=block_e, num_warps=num_warps: step.step_kernel[grid](
                        *arguments, FEATURE_MAP="elu", NORMALIZE=True, BLOCK_D=max(16, triton.next_power_of_2(D)),
                        BLOCK_E=block_e, D_BLOCKS=1, INTERPRETED=False, num_warps=num_warps))
    measures = {"": lambda fn: replay_us(fn, 1), ", x20": lambda fn: replay_us(fn, 20),
                ", do_bench_cudagraph": cudagraph_us}
    results = {}
    for name, fn in rows.items():
        for suffix, measure in measures.items():
            label = name + suffix
            try:
                results[label] = measure(fn)
            except Exception as error:  # noqa: BLE001  a config this GPU refuses: say so, go on
                results[label] = f"{type(error).__name__}: {error}"
                print(f"{label:40s} {results[label]}", flush=True)
                continue
            print(f"{label:40s} {results[label]:8.2f} us replayed", flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-configs", action="store_true", help="skip the step's config sweep")
    parser.add_argument("--rounds", type=int, default=9, help="alternating loops of api against its jit path")
    args = parser.parse_args(argv)
    if not ttx_tutorial.on_gpu():
        print("launch_cost.py times launches on a GPU; in CPU mode Triton's interpreter runs the kernels")
        return 0
    B, H, D, E = 8, 16, 64, 64
    device = torch.device("cuda")
    q, k = (torch.randn(B, H, D, device=device, dtype=torch.bfloat16) / 8 for _ in range(2))
    v = torch.randn(B, H, E, device=device, dtype=torch.bfloat16)
    state = torch.zeros(B, H, D, E + 1, device=device, dtype=torch.float32)
    o = torch.empty(B, H, E, device=device, dtype=torch.bfloat16)

    grid, block_d, block_e, d_blocks, num_warps = step._launch_plan(B, H, D, E, True)
    arrivals = step._arrivals(state, B * H)
    arguments = [q, k, v, o, state, arrivals, H, D, E, *q.stride(), *k.stride(), *v.stride(), 1e-6]
    constants = {"FEATURE_MAP": "elu", "NORMALIZE": True, "BLOCK_D": block_d, "BLOCK_E": block_e,
                 "D_BLOCKS": d_blocks, "INTERPRETED": False}

    def jit():
        return step.step_kernel[grid](*arguments, **constants, num_warps=num_warps)

    compiled = jit()
    # The compiled kernel takes every parameter positionally, constexprs included, in order.
    compiled_arguments = [*arguments, *constants.values()]
    compiled_launch = compiled[(grid[0], 1, 1)]  # a CompiledKernel takes a full 3-D grid

    x = torch.zeros(1, device=device)
    empty_pointers = {}
    for pointers in (1, 6):
        pointer_arguments = [x if i < pointers else None for i in range(6)]
        empty_compiled = empty_kernel[(1,)](*pointer_arguments, 1, POINTERS=pointers)
        empty_pointers[pointers] = (pointer_arguments, empty_compiled)

    rows = {
        "api": lambda: ttx_tutorial.linear_attention_step(q, k, v, state),
        "step_update": lambda: step.step_update(q, k, v, state),
        "jit": jit,
        "compiled": lambda: compiled_launch(*compiled_arguments),
    }
    for pointers, (pointer_arguments, empty_compiled) in empty_pointers.items():
        rows[f"empty jit, {pointers} pointers"] = (
            lambda pa=pointer_arguments, p=pointers: empty_kernel[(1,)](*pa, 1, POINTERS=p))
        launch = empty_compiled[(1, 1, 1)]
        rows[f"empty compiled, {pointers} pointers"] = (
            lambda pa=pointer_arguments, p=pointers, launch=launch: launch(*pa, 1, p))
    rows["torch add_"] = lambda: o.add_(1.0)
    rows["torch.empty"] = lambda: torch.empty(B, H, E, device=device, dtype=torch.bfloat16)
    rows.update(peer_steps(q, k, v, state))

    results = {}
    for name, fn in rows.items():
        try:
            fn()
            results[name] = host_us(fn, args.calls)
        except Exception as error:  # noqa: BLE001  a layer this Triton lays out otherwise: say so, go on
            results[name] = f"{type(error).__name__}: {error}"
            print(f"{name:28s} {results[name]}", flush=True)
            continue
        print(f"{name:28s} {results[name]:8.1f} us", flush=True)
    kept_us, jit_us, ratio = kept_against_jit_path_us(rows["api"], args.calls, args.rounds)
    results["kept against jit path"] = {"kept_us": kept_us, "jit_path_us": jit_us, "median_ratio": ratio,
                                        "rounds": args.rounds}
    print(f"{'kept against jit path':28s} {kept_us:8.1f} against {jit_us:.1f} us (median ratio {ratio:.3f}, "
          f"{args.rounds} alternating rounds)", flush=True)
    replays = replay_rows(q, k, v, state, configs=not args.no_configs)
    if args.json:
        setting = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "python": platform.python_version(),
                   "command": " ".join(sys.argv)}
        args.json.write_text(json.dumps({"setting": setting, "host_us": results, "replay_us": replays}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
