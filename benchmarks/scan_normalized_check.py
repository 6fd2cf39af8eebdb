"""GPU time of the normalised scan against the plain scan, forward and forward+backward.

    python benchmarks/scan_normalized_check.py results.json   # GPU: the shapes below; CPU mode: one tiny shape, untimed

Rows (bfloat16; (B, H, T, D = E) = (1, 8, 65536, 64), the scan's shape, and (8, 16, 4096, 64);
(1, 2, 64, 16) in CPU mode):
  plain       causal_product(q, k, v, method="scan")
  features    scan.scan_normalized_attention on features mapped beforehand (elu + 1): the
              normaliser beside the state in the scan's passes, no map in the kernels
  elu_inside  causal_linear_attention(q, k, v, method="scan"): elu + 1 applied by the kernels as
              they load q and k, forward and backward
Each row: "gpu_ms", the median of ``triton.testing.do_bench`` over a CUDA-graph replay of one
call (the forward under ``torch.no_grad``; forward+backward with ``torch.autograd.grad``), the
GPU's time alone; in CPU mode the kernels run in the interpreter and no time is taken. The
JSON also records the date, GPU, versions and this command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import bench  # noqa: E402
from ttx_tutorial.kernels import scan  # noqa: E402
from ttx_tutorial.testing import random_inputs  # noqa: E402

ON_GPU = ttx_tutorial.on_gpu()
SHAPES = [(1, 8, 65536, 64), (8, 16, 4096, 64)] if ON_GPU else [(1, 2, 64, 16)]


def gpu_ms(fn, leaves=()):
    """The GPU time of one call of fn (``bench.graph_ms``); None in CPU mode, where fn runs once."""
    if ON_GPU:
        return bench.graph_ms(fn, leaves)
    fn()
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        q, k, v = random_inputs(*shape, dtype=torch.bfloat16, requires_grad=True, seed=0)
        phi_q, phi_k = ((F.elu(x.detach()) + 1).requires_grad_() for x in (q, k))
        grad_out = torch.randn_like(v)
        calls = {
            "plain": ((q, k, v), lambda: ttx_tutorial.causal_product(q, k, v, method="scan")),
            "features": ((phi_q, phi_k, v), lambda: scan.scan_normalized_attention(phi_q, phi_k, v)[0]),
            "elu_inside": ((q, k, v), lambda: ttx_tutorial.causal_linear_attention(q, k, v, method="scan")),
        }
        for name, (leaves, call) in calls.items():
            def forward(call=call):
                with torch.no_grad():
                    call()

            def forward_and_backward(call=call, leaves=leaves):
                torch.autograd.grad(call(), leaves, grad_out)

            for mode, fn in (("fwd", forward), ("fwd+bwd", forward_and_backward)):
                row = {"name": name, "mode": mode, "shape": list(shape) + [shape[-1]], "dtype": "bf16",
                       "gpu_ms": gpu_ms(fn, leaves)}
                rows.append(row)
                print(row, flush=True)
    environment = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if ON_GPU else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "command": "python " + " ".join(sys.argv),
    }
    args.out.write_text(json.dumps({"environment": environment, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
