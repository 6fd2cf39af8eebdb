"""Packed variable-length batches (``cu_seqlens``) against the same tokens as one sequence, and fla.

    python benchmarks/varlen_check.py                          # GPU: the table, about a minute
    python benchmarks/varlen_check.py --json varlen_check.json # ... and the rows with their setting

65536 tokens (``--tokens``), 16 heads of D = E = 64, bfloat16, in two packings drawn with
``--seed``: "drawn", lengths drawn uniformly between 128 and 8192 until the tokens run out (the
last takes the rest), and "18 sequences", 18 lengths drawn in the same range and scaled to the
same total. Rows, each timed forward ("fwd") and forward+backward ("fwd+bwd") per call with
``triton.testing.do_bench`` (median, host included), and the forward's error against float64
(each sequence alone):
  chunked, scan, auto     ttx_tutorial.causal_product(..., cu_seqlens=...), packed
  ... unpacked            the same method on the (1, 16, 65536, 64) sequence, no cu_seqlens
  fla_chunk, fla_fused_chunk   fla's chunk_linear_attn / fused_chunk_linear_attn with the same
                          cu_seqlens (normalize=False, scale=1), when fla is importable
On a GPU each row also gets "fwd_gpu_ms" and "fwd+bwd_gpu_ms": the same call replayed from a CUDA
graph (``ttx_tutorial.bench.graph_ms``), the GPU's time without the host's ("-" where a call
cannot be captured, as when it reads values back to the host).
"vs unpacked": packed time over the same method unpacked (target <= 1.2); "vs fla": packed time
over fla's best packed time in the same run (target < 1). Without a GPU the script runs the
same rows at a few hundred tokens under Triton's interpreter (no fla), to check itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
import ttx_tutorial.bench  # noqa: E402
from ttx_tutorial.testing import reference, relative_error  # noqa: E402

ON_GPU = ttx_tutorial.on_gpu()
METHODS = ("chunked", "scan", "auto")
SHORTEST, LONGEST = (128, 8192) if ON_GPU else (8, 96)


def drawn_lengths(total, generator):
    """Lengths drawn uniformly in [SHORTEST, LONGEST] until ``total`` tokens; the last takes the rest."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(SHORTEST, LONGEST + 1, (), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    return lengths


def scaled_lengths(count, total, generator):
    """``count`` lengths drawn in [SHORTEST, LONGEST], scaled to sum to ``total``."""
    drawn = torch.randint(SHORTEST, LONGEST + 1, (count,), generator=generator).double()
    lengths = (drawn * total / drawn.sum()).floor().long().tolist()
    lengths[-1] += total - sum(lengths)
    return lengths


def time_ms(fn, leaves=()):
    """Median ms per call: ``do_bench`` on a GPU; a few timed calls under the interpreter."""
    if ON_GPU:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=list(leaves),
                                             return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[1]


def gpu_ms(fn, leaves=()):
    """The GPU's ms of one call (a CUDA-graph replay), or None off a GPU or where capture fails."""
    if not ON_GPU:
        return None
    try:
        return ttx_tutorial.bench.graph_ms(fn, leaves)
    except Exception as error:  # noqa: BLE001  a call that cannot be captured: say so, go on
        print(f"    (no graph replay: {type(error).__name__}: {str(error).splitlines()[0][:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def contenders(q, k, v, cu_seqlens):
    """name -> (packed, function of (q, k, v) in the (1, H, T, D) layout returning o)."""
    rows = {}
    for method in METHODS:
        rows[method] = (True, lambda q, k, v, m=method: ttx_tutorial.causal_product(q, k, v, m, cu_seqlens=cu_seqlens))
        rows[f"{method} unpacked"] = (False, lambda q, k, v, m=method: ttx_tutorial.causal_product(q, k, v, m))
    if not ON_GPU:
        return rows
    try:
        from fla.ops import linear_attn
    except ImportError as error:
        print(f"fla not importable ({error}); its rows are left out")
        return rows
    offsets = cu_seqlens.long()
    for name, function in (("fla_chunk", linear_attn.chunk_linear_attn),
                           ("fla_fused_chunk", linear_attn.fused_chunk_linear_attn)):
        def fla(q, k, v, function=function):  # fla takes and returns (B, T, H, D)
            o, _ = function(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                            normalize=False, cu_seqlens=offsets)
            return o.transpose(1, 2)
        rows[name] = (True, fla)
    return rows


def packed_error(o, q, k, v, offsets):
    """The largest relative error of one sequence's o against float64 on that sequence alone."""
    worst = 0.0
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end > start:
            expected, _ = reference(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], device=q.device)
            worst = max(worst, relative_error(o[:, :, start:end], expected))
    return worst


def run_case(case, lengths, heads, dim, generator):
    T = sum(lengths)
    device = ttx_tutorial.DEVICE
    draw = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(device, torch.bfloat16)
    # fla reads its (B, T, H, D) layout; ours reads any strides: one (1, T, H, D) buffer seen as
    # (1, H, T, D) serves both without a copy in either timing.
    q, k = (draw(1, T, heads, dim, scale=dim ** -0.5).transpose(1, 2) for _ in range(2))
    v = draw(1, T, heads, dim).transpose(1, 2)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    grad_o = torch.randn(q.shape, generator=generator).to(device, torch.bfloat16)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    rows = []
    for name, (packed, fn) in contenders(q, k, v, cu_seqlens).items():
        with torch.no_grad():
            o = fn(q, k, v)
            forward = time_ms(lambda: fn(q, k, v))
        backward = time_ms(lambda: fn(*leaves).backward(grad_o), leaves)
        with torch.no_grad():
            forward_gpu = gpu_ms(lambda: fn(q, k, v))
        backward_gpu = gpu_ms(lambda: fn(*leaves).backward(grad_o), leaves)
        error = packed_error(o, q, k, v, offsets) if packed else None
        # printed as it comes: fla's first calls autotune for minutes, and a cut run keeps ours
        gpu = "" if forward_gpu is None and backward_gpu is None else (
            f" (GPU {shown(forward_gpu)} / {shown(backward_gpu)} ms)")
        print(f"  {name}: fwd {forward:.4f} ms, fwd+bwd {backward:.4f} ms{gpu}", flush=True)
        rows.append({"case": case, "method": name, "packed": packed, "sequences": len(lengths), "T": T,
                     "fwd_ms": forward, "fwd+bwd_ms": backward, "fwd_gpu_ms": forward_gpu,
                     "fwd+bwd_gpu_ms": backward_gpu, "error": error})
    best_fla = {key: min((r[key] for r in rows if r["method"].startswith("fla")), default=None)
                for key in ("fwd_ms", "fwd+bwd_ms")}
    by_name = {r["method"]: r for r in rows}
    for row in rows:
        unpacked = by_name.get(f"{row['method']} unpacked")
        for key in ("fwd_ms", "fwd+bwd_ms"):
            row[f"{key} vs unpacked"] = row[key] / unpacked[key] if unpacked else None
            row[f"{key} vs fla"] = row[key] / best_fla[key] if row["packed"] and best_fla[key] else None
    return rows


def shown(value):
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def print_table(rows):
    columns = ("case", "method", "fwd_ms", "fwd+bwd_ms", "fwd_gpu_ms", "fwd+bwd_gpu_ms", "fwd_ms vs unpacked",
               "fwd+bwd_ms vs unpacked", "fwd_ms vs fla", "fwd+bwd_ms vs fla", "error")
    table = [columns] + [tuple(shown(row[c]) for c in columns) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536 if ON_GPU else 256)
    parser.add_argument("--heads", type=int, default=16 if ON_GPU else 2)
    parser.add_argument("--dim", type=int, default=64 if ON_GPU else 16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows and their setting here")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    cases = {"drawn": drawn_lengths(args.tokens, generator),
             "18 sequences": scaled_lengths(18, args.tokens, generator)}
    rows = []
    for case, lengths in cases.items():
        print(f"{case}: {len(lengths)} sequences, lengths {lengths}")
        rows += run_case(case, lengths, args.heads, args.dim, generator)
    print_table(rows)
    if args.json:
        setting = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "gpu": torch.cuda.get_device_name() if ON_GPU else None, "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "python": platform.python_version(),
                   "command": " ".join(sys.argv), "lengths": cases}
        args.json.write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
