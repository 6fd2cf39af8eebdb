"""Two source trees of this package timed side by side: ``causal_product`` for chunked and scan.

    python benchmarks/compare_trees.py BASE_TREE NEW_TREE            # GPU: the table below
    python benchmarks/compare_trees.py A B --shapes 8,16,4096,64 1,8,65536,64 --rounds 3 --json OUT.json
    python benchmarks/compare_trees.py A B --dtype float32 --float32-precision high

A tree is a folder holding ``ttx_tutorial/`` (a checkout, or ``git archive REV | tar -x -C DIR``).
Each tree runs in its own Python process with that folder first on ``PYTHONPATH`` (the child
checks that it imported the package from there), so the two never share a module, a kernel or
a launch plan; rounds alternate between the trees (A, B, A, B, ...) so that clocks and
neighbours drift alike on both. Rows, for each shape (B, H, T, D; E = D), method and mode:
  fwd       ``causal_product(q, k, v, method)``
  fwd+bwd   the same and ``o.backward(dO)``, q, k, v requiring gradients
float32 inputs are multiplied at ``--float32-precision`` (``torch.set_float32_matmul_precision``
in each child; PyTorch's default "highest" unless given). Each row is
timed as the GPU's time of a CUDA-graph replay of one call (``do_bench`` median, host excluded),
the median over rounds; "new / base" is NEW_TREE's time over BASE_TREE's. Each round also
reports the forward's relative error against a float64 reference, so that a fast wrong tree
shows. Inputs are drawn from ``--seed`` for both trees alike. The timing code is this file's, not
the trees', so that both are measured the same way. Without a GPU the children run under
Triton's interpreter and time a few calls on the host (use a tiny shape: ``--shapes 1,2,40,16``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("chunked", "scan")
MODES = ("fwd", "fwd+bwd")
SHAPES = ("8,16,4096,64", "8,16,4096,128", "1,8,65536,64")


def gpu_replay_ms(fn, leaves):
    """Median ms of ``fn`` replayed from a CUDA graph: the GPU's time alone. Gradients of the
    leaves are cleared before the capture, so that each replay writes fresh ones."""
    import torch
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, tune and allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def host_ms(fn, leaves):
    """Median ms of three calls on the host (the interpreter: all work is the host's)."""
    samples = []
    for _ in range(3):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def child(tree: Path, shapes, dtype_name, seed, float32_precision):
    """Run in the tree's own process: time every row, print them as one JSON line."""
    import torch
    import ttx_tutorial

    torch.set_float32_matmul_precision(float32_precision)
    from ttx_tutorial.testing import reference, relative_error

    imported_from = Path(ttx_tutorial.__file__).resolve().parents[1]
    if imported_from != tree.resolve():
        raise SystemExit(f"imported ttx_tutorial from {imported_from}, not from the tree {tree}")
    time_ms = host_ms if ttx_tutorial.INTERPRETED else gpu_replay_ms
    dtype = getattr(torch, dtype_name)
    device = ttx_tutorial.DEVICE
    rows = []
    for shape in shapes:
        B, H, T, D = shape
        generator = torch.Generator().manual_seed(seed)
        draw = lambda *size, scale=1.0: (torch.randn(*size, generator=generator) * scale).to(device, dtype)
        q, k = draw(B, H, T, D, scale=D ** -0.5), draw(B, H, T, D, scale=D ** -0.5)
        v, grad_o = draw(B, H, T, D), draw(B, H, T, D)
        expected, _ = reference(q, k, v, device=device)
        for method in METHODS:
            error = relative_error(ttx_tutorial.causal_product(q, k, v, method), expected)
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            calls = {"fwd": (lambda: ttx_tutorial.causal_product(q, k, v, method), []),
                     "fwd+bwd": (lambda: ttx_tutorial.causal_product(*leaves, method).backward(grad_o), leaves)}
            for mode in MODES:
                fn, grads = calls[mode]
                rows.append({"shape": list(shape), "method": method, "mode": mode,
                             "ms": time_ms(fn, grads), "rel_err": error})
    print(json.dumps({"tree": str(tree), "triton_interpreter": ttx_tutorial.INTERPRETED,
                      "torch": torch.__version__, "triton": __import__("triton").__version__,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "float32_precision": torch.get_float32_matmul_precision(), "rows": rows}))


def run_tree(tree: Path, args) -> dict:
    """One round of one tree, in a fresh process whose path starts with the tree."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree.resolve()), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), "--dtype", args.dtype,
               "--seed", str(args.seed), "--float32-precision", args.float32_precision,
               "--shapes", *args.shapes]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(base: list[dict], new: list[dict], names) -> str:
    """One line per row: both trees' median ms over rounds, their ratio and worst errors."""
    def key(row):
        return tuple(row["shape"]), row["method"], row["mode"]

    def collect(rounds):
        grouped = {}
        for result in rounds:
            for row in result["rows"]:
                grouped.setdefault(key(row), []).append(row)
        return grouped

    base_rows, new_rows = collect(base), collect(new)
    header = (f"{'B,H,T,D':>16} {'method':>8} {'mode':>8} {names[0] + ' ms':>14} {names[1] + ' ms':>14} "
              f"{'new / base':>10} {'base err':>9} {'new err':>9}")
    lines = [header]
    for row_key, rows in base_rows.items():
        shape, method, mode = row_key
        base_ms = statistics.median(r["ms"] for r in rows)
        new_ms = statistics.median(r["ms"] for r in new_rows[row_key])
        base_err = max(r["rel_err"] for r in rows)
        new_err = max(r["rel_err"] for r in new_rows[row_key])
        lines.append(f"{','.join(map(str, shape)):>16} {method:>8} {mode:>8} {base_ms:>14.4f} {new_ms:>14.4f} "
                     f"{new_ms / base_ms:>10.3f} {base_err:>9.2e} {new_err:>9.2e}")
    return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    values = tuple(int(part) for part in text.split(","))
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a shape is B,H,T,D with each at least 1, got {text!r}")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", type=Path, help="BASE_TREE NEW_TREE")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="B,H,T,D (E = D)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float32-precision", default="highest", choices=("highest", "high", "medium"),
                        help="torch.set_float32_matmul_precision in each tree's process")
    parser.add_argument("--json", type=Path, help="also write every round's rows here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [parse_shape(text) for text in args.shapes]
    if args.child:
        child(args.child, shapes, args.dtype, args.seed, args.float32_precision)
        return
    if len(args.trees) != 2:
        parser.error("give two trees: BASE_TREE NEW_TREE")
    for tree in args.trees:
        if not (tree / "ttx_tutorial" / "__init__.py").is_file():
            parser.error(f"{tree} holds no ttx_tutorial package")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    results = {tree: [] for tree in args.trees}
    for round_number in range(args.rounds):
        for tree in args.trees:
            print(f"round {round_number + 1} of {args.rounds}: {tree}", file=sys.stderr, flush=True)
            results[tree].append(run_tree(tree, args))
    base, new = (results[tree] for tree in args.trees)
    first = base[0]
    mode = " (Triton's interpreter: host time)" if first["triton_interpreter"] else " (GPU time of a graph replay)"
    precision = f" ({first['float32_precision']})" if args.dtype == "float32" else ""
    print(f"{args.dtype}{precision}; {first['device']}{mode}; torch {first['torch']}, triton {first['triton']}; "
          f"median of {args.rounds} rounds; base {args.trees[0]}, new {args.trees[1]}")
    print(table(base, new, [tree.resolve().name for tree in args.trees]))
    if args.json:
        args.json.write_text(json.dumps({str(tree): rounds for tree, rounds in results.items()}, indent=1))


if __name__ == "__main__":
    main()
