"""Run one method once (after a warm-up call) at one shape, for a profiler to watch.

    ncu --clock-control none -k regex:recurrent --section WarpStateStats \\
        python benchmarks/profile_one.py recurrent 1,8,16384,64 --config '{"BLOCK_E": 2}'

The warm-up call compiles the kernel, so the profiled launch is the second one; ``-c`` or
``--launch-skip`` select it. Inputs are bfloat16, drawn as in ttx_tutorial.bench.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial.testing import random_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method")
    parser.add_argument("shape", help="B,H,T,D[,E]")
    parser.add_argument("--config", default=None, help="JSON config for the kernel function")
    parser.add_argument("--backward", action="store_true", help="also run the backward")
    parser.add_argument("--timeline", action="store_true",
                        help="print each GPU kernel of the last call: stream, start and duration (torch.profiler)")
    args = parser.parse_args()
    B, H, T, D, *rest = (int(x) for x in args.shape.split(","))
    E = rest[0] if rest else D
    fn = ttx_tutorial.method_info(args.method).function
    config = json.loads(args.config) if args.config else None
    q, k, v = random_inputs(B, H, T, D, E, dtype=torch.bfloat16, device="cuda", seed=0,
                            requires_grad=args.backward)
    def call():
        o, _ = fn(q, k, v, None, config=config)
        if args.backward:
            o.backward(torch.randn_like(o))

    call()
    torch.cuda.synchronize()
    if args.timeline:
        print_timeline(call)
    else:
        call()
        torch.cuda.synchronize()
    print(f"{args.method} {(B, H, T, D, E)} config={config}: done")


def print_timeline(call):
    """One call under torch.profiler: which kernels overlap, on which streams."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return
    origin = kernels[0].time_range.start
    for e in kernels:
        start = e.time_range.start - origin
        print(f"stream {e.device_resource_id:3d}  start {start / 1e3:9.3f} ms  "
              f"duration {e.time_range.elapsed_us() / 1e3:8.3f} ms  {e.name[:60]}")


if __name__ == "__main__":
    main()
