"""Context parallelism: one sequence split between the ranks, against one device on all of it.

    torchrun --nproc-per-node 2 benchmarks/cp_check.py benchmarks/results/cp_check.json
    torchrun --nproc-per-node 2 benchmarks/cp_check.py cp_check.json    # CPU mode: gloo, tiny sizes

(B, H, T, D = E) = (1, 8, 131072, 64) bfloat16 on GPUs ((1, 2, 64, 16) in CPU mode), method
"auto"; rank r holds tokens [r T / P, (r + 1) T / P) as a tensor of its own. On GPUs the process
group has NCCL for CUDA tensors (the states) and gloo for CPU tensors (the ranks' summaries,
which then need no wait for the GPU): backend "cpu:gloo,cuda:nccl". Rows, forward ("fwd") and
forward+backward ("fwd+bwd"):
  whole            rank 0 alone: ttx_tutorial.causal_product on the whole sequence
  half             every rank alone on its slice, no communication: the floor of the split
  split            ttx_tutorial.distributed.causal_product, every rank on its slice
  split_unchecked  the same with check_ranks=False (no exchange of summaries)
"ms": the median over --rounds of the mean time of --calls calls in a row, host included (the
slowest rank's); every rank makes the same calls, since each split call is a collective.
"gpu_ms": the time GPU kernels ran per call (torch.profiler; the slowest rank's, NCCL's kernels
included). "ratios": split / whole, the target being <= 0.6 forward+backward on two GPUs.
"communication": the bytes each rank sent in one forward+backward, as counted by
ttx_tutorial.distributed.count_communication, as the all_gathers the profiler saw, and by the
formula (communication_bytes). "errors": each rank's output and final state against float64,
for the split and the whole. The JSON also records the date, devices, versions and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import distributed  # noqa: E402
from ttx_tutorial.testing import random_inputs, reference, relative_error  # noqa: E402

ON_GPU = ttx_tutorial.on_gpu()
_ELEMENT_SIZES = {"float": 4, "double": 8, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2}


def synchronize():
    if ON_GPU:
        torch.cuda.synchronize()


def per_call_ms(fn, calls, rounds, active=True):
    """Median over rounds of the mean ms of ``calls`` calls of fn in a row; ranks not ``active``
    only keep step at the barriers."""
    if active:
        fn()  # compiles
    samples = []
    for _ in range(rounds):
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        if active:
            for _ in range(calls):
                fn()
        synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    dist.barrier()
    return statistics.median(samples) if active else None


def gpu_busy_ms(fn, calls, active=True):
    """Milliseconds per call that GPU kernels ran (torch.profiler), host gaps excluded."""
    if not ON_GPU:
        return None
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    if not active:
        dist.barrier()
        return None
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        synchronize()
    dist.barrier()
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1e3


def profiled_bytes(fn, world_size):
    """(all_gathers seen, bytes this rank sent in them) during fn, from each one's input."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
        synchronize()
    seen = [event for event in prof.events() if event.name.endswith(":all_gather") and event.input_shapes]
    sent = sum((world_size - 1) * math.prod(event.input_shapes[0])
               * _ELEMENT_SIZES.get(event.input_dtypes[0], 0) for event in seen)
    return len(seen), sent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="JSON file to write (by rank 0)")
    parser.add_argument("--calls", type=int, default=20, help="calls in a row per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings per row (median kept)")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if ON_GPU:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if ON_GPU else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if ON_GPU else ttx_tutorial.DEVICE

    B, H, T, D = ttx_tutorial.size(cpu=(1, 2, 64, 16), gpu=(1, 8, 131072, 64))
    dtype = torch.bfloat16
    q, k, v = random_inputs(B, H, T, D, dtype=dtype, device=device, seed=0)
    grad_o = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    part = slice(rank * T // world_size, (rank + 1) * T // world_size)
    mine = [x[:, :, part].contiguous() for x in (q, k, v)]
    my_grad_o = grad_o[:, :, part].contiguous()

    def forward_and_backward(fn, inputs, grad):
        leaves = [x.detach().requires_grad_() for x in inputs]

        def step():
            for leaf in leaves:
                leaf.grad = None
            fn(*leaves).backward(grad)

        return (lambda: fn(*inputs)), step

    candidates = {
        "whole": (lambda *x: ttx_tutorial.causal_product(*x), (q, k, v), grad_o, rank == 0),
        "half": (lambda *x: ttx_tutorial.causal_product(*x), mine, my_grad_o, True),
        "split": (lambda *x: distributed.causal_product(*x), mine, my_grad_o, True),
        "split_unchecked": (lambda *x: distributed.causal_product(*x, check_ranks=False), mine, my_grad_o, True),
    }
    rows = []
    for name, (fn, inputs, grad, active) in candidates.items():
        forward, step = forward_and_backward(fn, inputs, grad)
        for mode, call in (("fwd", forward), ("fwd+bwd", step)):
            ms = per_call_ms(call, args.calls, args.rounds, active)
            gpu = gpu_busy_ms(call, args.calls, active)
            every = [None] * world_size
            dist.all_gather_object(every, (ms, gpu))
            measured = [row for row in every if row[0] is not None]
            rows.append({"name": name, "mode": mode, "shape": [B, H, T, D, D], "dtype": "bf16",
                         "ranks": world_size if name != "whole" else 1,
                         "ms": round(max(m for m, _ in measured), 5),
                         "rank_ms": [round(m, 5) for m, _ in measured],
                         "gpu_ms": None if measured[0][1] is None else round(max(g for _, g in measured), 5)})

    # Communication of one forward+backward of the split, three ways.
    _, split_step = forward_and_backward(candidates["split"][0], mine, my_grad_o)
    with distributed.count_communication() as traffic:
        split_step()
    seen, seen_bytes = profiled_bytes(split_step, world_size)
    formula = distributed.communication_bytes(B, H, D, D, world_size, dtype=dtype, backward=True)

    # Accuracy against float64 (on the GPU when there is one: T is long).
    ref_o, ref_state = reference(q, k, v, device=device)
    split_o, split_state = distributed.causal_product(*mine, return_state=True)
    errors = {"split o": relative_error(split_o, ref_o[:, :, part]),
              "split final state": relative_error(split_state, ref_state)}
    if rank == 0:
        whole_o, whole_state = ttx_tutorial.causal_product(q, k, v, return_state=True)
        errors.update({"whole o": relative_error(whole_o, ref_o), "whole final state": relative_error(whole_state, ref_state)})
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {"errors": errors, "bytes_counted": traffic.bytes_sent,
                                      "all_gathers_seen": seen, "bytes_seen": seen_bytes})
    dist.destroy_process_group()
    if rank != 0:
        return

    by_name = {(row["name"], row["mode"]): row for row in rows}

    def ratio(mode, key):
        split, whole = by_name[("split", mode)][key], by_name[("whole", mode)][key]
        return None if split is None or whole is None else round(split / whole, 3)

    ratios = {"split / whole, fwd+bwd, per call (target <= 0.6)": ratio("fwd+bwd", "ms"),
              "split / whole, fwd+bwd, GPU busy": ratio("fwd+bwd", "gpu_ms"),
              "split / whole, fwd, per call": ratio("fwd", "ms"),
              "split / whole, fwd, GPU busy": ratio("fwd", "gpu_ms")}
    communication = {"formula_bytes_per_rank": formula,
                     "counted_bytes": [r["bytes_counted"] for r in per_rank],
                     "profiled": [{"all_gathers": r["all_gathers_seen"], "bytes": r["bytes_seen"]} for r in per_rank],
                     "matches": all(r["bytes_counted"] == formula for r in per_rank)}
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": (f"{world_size} x {torch.cuda.get_device_name()}" if ON_GPU
                      else f"{world_size} processes, CPU interpreter ({platform.machine()})"),
           "backend": "cpu:gloo,cuda:nccl" if ON_GPU else "gloo",
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "command": " ".join(["torchrun", "--nproc-per-node", str(world_size), Path(sys.argv[0]).name,
                                *sys.argv[1:]]),
           "mode": ttx_tutorial.describe(), "method_whole": ttx_tutorial.choose_method(q, v),
           "method_slice": ttx_tutorial.choose_method(mine[0], mine[2])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "rows": rows, "ratios": ratios, "communication": communication,
                                    "errors": [r["errors"] for r in per_rank]}, indent=1))
    for row in rows:
        gpu = "" if row["gpu_ms"] is None else f"  (GPU {row['gpu_ms']:.4f})"
        print(f"{row['name']:16s} {row['mode']:8s} {row['ms']:9.4f} ms{gpu}  per rank {row['rank_ms']}")
    for name, value in ratios.items():
        print(f"{name}: {value}")
    print(f"communication per rank: formula {formula} B, counted {communication['counted_bytes']}, "
          f"profiled {communication['profiled']}")
    for rank_number, r in enumerate(per_rank):
        print(f"rank {rank_number} errors: " + ", ".join(f"{k} {e:.1e}" for k, e in r["errors"].items()))


if __name__ == "__main__":
    main()
