"""chunked's fused backward launch by launch keywords, plain and normalised (GPU only).

    python benchmarks/fused_backward_variants.py
    python benchmarks/fused_backward_variants.py --shapes 8,16,4096,64 1,8,65536,64 \\
        --variants '[{}, {"SPLIT_WALKS": true}, {"SPLIT_WALKS": true, "num_stages": 3}]'

For each shape (B, H, T, D; E = D; bfloat16) and each kind of backward, the launch of
``chunked._launch_backward`` (the normaliser's r kernel included where it runs) with the rule's
launch keywords updated by each variant, timed as the GPU's time of a CUDA-graph replay
(``ttx_tutorial.bench.graph_ms``). Kinds: "plain" (the causal product's backward), "normalised"
(on features mapped beforehand) and "elu" (the same taking dq and dk through elu + 1's
derivative). Each variant's dq, dk, dv and dS_0 are compared with the rule's (relative
difference; a variant that computes differently, such as another CHUNK, rounds differently).

``--profile`` times nothing: it runs each kind's rule twice (compiling it), then once more between
``torch.cuda.profiler.start()`` and ``stop()``, for a profiler told to wait for that range:

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o backward \
        python benchmarks/fused_backward_variants.py --profile --shapes 8,16,4096,64 --kinds plain,normalised
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import bench  # noqa: E402
from ttx_tutorial.kernels import chunked  # noqa: E402
from ttx_tutorial.testing import random_inputs, relative_error  # noqa: E402

KINDS = ("plain", "normalised", "elu")


def backward_call(shape, kind):
    """(call(launch_keywords) -> gradients, the rule's launch keywords) for one shape and kind."""
    B, H, T, D = shape
    q, k, v = random_inputs(B, H, T, D, D, dtype=torch.bfloat16, seed=0)
    grad_o = torch.randn_like(v)
    limits = chunked._device_limits(q.device)
    normalize = kind != "plain"
    rule = chunked._backward_plan(B * H, T, D, D, torch.bfloat16, limits, False, (), normalize=normalize)
    if not normalize:
        return (lambda keywords: chunked._launch_backward(q, k, v, None, grad_o, None, keywords, compute_dq=True)), rule
    phi_q, phi_k = (torch.nn.functional.elu(x.float()).add(1).to(x.dtype) for x in (q, k))
    o, _, denominator = chunked._launch_normalized(phi_q, phi_k, v, None, 1e-6, None)
    feature_map = "elu" if kind == "elu" else "identity"

    def call(keywords):
        return chunked._launch_backward(phi_q, phi_k, v, None, grad_o, None, keywords, compute_dq=True, o=o,
                                        denominator=denominator, feature_map=feature_map)
    return call, rule


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8,16,4096,64", "1,8,65536,64", "8,16,4096,32"],
                        help="B,H,T,D (E = D)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--variants", default='[{}, {"SPLIT_WALKS": false}, {"SPLIT_WALKS": true}]',
                        help="JSON list of launch-keyword updates; {} is the rule")
    parser.add_argument("--profile", action="store_true",
                        help="launch each kind's rule once inside a profiler range instead of timing variants")
    args = parser.parse_args()
    if not ttx_tutorial.on_gpu():
        print("fused_backward_variants.py times launches on a GPU")
        return 0
    shapes = [tuple(int(x) for x in text.split(",")) for text in args.shapes]
    kinds = args.kinds.split(",")
    if args.profile:
        calls = [backward_call(shape, kind) for shape in shapes for kind in kinds]
        for call, rule in calls:
            for _ in range(2):
                call(dict(rule))
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for call, rule in calls:
            call(dict(rule))
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    variants = json.loads(args.variants)
    print(ttx_tutorial.describe())
    for shape in shapes:
        for kind in kinds:
            call, rule = backward_call(shape, kind)
            reference = [x.clone() for x in call(rule)]
            print(f"{shape} {kind}: rule {json.dumps({k: v for k, v in rule.items() if k not in ('INTERPRETED',)})}")
            for change in variants:
                keywords = {**rule, **change}
                keywords["COMPENSATED"] = chunked._compensated(shape[2], keywords["CHUNK"])
                try:
                    gradients = call(keywords)
                    torch.cuda.synchronize()
                    differences = " ".join(f"{relative_error(a, b):.1e}" for a, b in zip(gradients, reference))
                    ms = bench.graph_ms(lambda: call(keywords))
                except Exception as error:  # noqa: BLE001  a variant this GPU refuses: say so, go on
                    print(f"  {json.dumps(change):55s} refused: {type(error).__name__}: {str(error)[:100]}")
                    continue
                print(f"  {json.dumps(change):55s} {ms:8.4f} ms   difference dq dk dv dS0: {differences}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
