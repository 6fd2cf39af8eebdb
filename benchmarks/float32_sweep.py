"""float32 on tensor cores: every precision setting of PyTorch against candidate chunked configs.

    python benchmarks/float32_sweep.py --out results/float32_sweep.json

float32 inputs follow ``torch.get_float32_matmul_precision()``: "highest" multiplies with a split
into bfloat16 parts in chunked (3xTF32 on the tiles where the split is wrong, and in the
normalised attention) and with 3xTF32 in scan, "high" and "medium" with TF32 (the kernel files'
``FLOAT32_PRECISIONS``; "medium" launches the same kernels as "high", so it is timed only with
``--settings``). For each shape (``--shapes``,
by default the four reference shapes), forward ("fwd") and forward+backward ("fwd+bwd"), this
times:

- per setting, ``chunked`` with the wrapper's rule ("rule") and with each candidate config of
  ``CANDIDATES`` (CHUNK, BLOCK_E, num_warps, num_stages; at most 8 per head size), through the
  kernel file's public ``chunked_causal_product``; ``scan`` with its rule and on 4 and 8 warps
  (``SCAN_CANDIDATES``); ``recurrent`` with its rule. Under "highest", once per kind of float32
  products named by ``--products``, set in both kernel files for the run ("bf16x3_manual", the
  kernel files' own split into bfloat16 parts, ``BF16X3_MANUAL``, chunked's default and the
  default of this option; "tf32x3", 3xTF32, scan's default; Triton's bfloat16 splits "bf16x3" and
  "bf16x6" on a GPU only), each row saying which (a split gives way to 3xTF32 on the tiles where
  the kernel files' ``split_is_right`` says no);
- once, the peers when importable: fast-transformers' ``causal_dot_product`` (a CUDA kernel in
  float32, unaffected by the setting) and fla's ``chunk_linear_attn`` and
  ``fused_chunk_linear_attn`` in float32 (their own TF32 products; ``scale=1.0,
  normalize=False``, (B, T, H, D) layout, transposed outside the timed region).

Each row: the median ms of ``triton.testing.do_bench`` (CPU mode: the median wall time of two
calls, which says nothing about a GPU) and ``rel_err``, ||x - ref|| / ||ref|| against float64 on
batch 0 and the first two heads: of o for "fwd", the largest over dq, dk, dv for "fwd+bwd" (the
float64 gradients are causal products themselves, computed once per shape on the device, see
``reference_gradients``). The run prints the table and, per (shape, setting, mode), the fastest
chunked config whose error meets the setting's bound (``ERROR_BOUNDS``), beside
fast-transformers and fla; ``--out`` also gets every row as JSON with the date, GPU, versions and
command.

Work is ordered so that a time limit (``--max-seconds``, 200 by default) cuts the least useful
part: first every shape's rules and references, then the peers (fla autotunes each kernel on its
first float32 call, which can take minutes; ``--no-peers`` leaves them out), then the candidates,
shape by shape; rows not timed in time say so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from ttx_tutorial.bench import REFERENCE_SHAPES, parse_shapes  # noqa: E402
from ttx_tutorial.kernels import chunked, scan  # noqa: E402
from ttx_tutorial.kernels.chunked import FLOAT32_PRECISIONS  # noqa: E402
from ttx_tutorial.testing import random_inputs, reference, relative_error  # noqa: E402

SETTINGS = ("highest", "high")
MODES = ("fwd", "fwd+bwd")
#: The relative error a setting must keep to count as a candidate for its default: float32's
#: tolerance for "highest", float16's (TF32 has its 10 significand bits) for "high" and "medium".
ERROR_BOUNDS = {"highest": 1e-5, "high": 1e-2, "medium": 1e-2}

#: Candidate configs by the head size they are meant for (BLOCK_D = 64, or 128 and above);
#: float32 tiles take twice a 16-bit tile's shared memory, and every candidate fits an H100/H200's.
#: Compiled for sm_90 with Triton 3.9, 3xTF32 at 32- and 64-token chunks uses all 255 registers
#: and spills (hundreds of bytes a thread at D = 64, over a thousand at D = 128), while 16-token
#: chunks (mma.sync instead of wgmma) spill little or nothing (nothing at D = 64 with 64 value
#: columns on 8 warps or 32 on 4): both kinds are here.
CANDIDATES = {
    64: [
        {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 4, "num_stages": 3},  # deeper pipelines: the
        {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 4, "num_stages": 4},  # bfloat16 rule's 4 stages
        {"BLOCK_E": 64, "CHUNK": 32, "num_warps": 4, "num_stages": 4},  # fit in 227 KB on sm_90
        {"BLOCK_E": 32, "CHUNK": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_E": 32, "CHUNK": 16, "num_warps": 4, "num_stages": 3},
    ],
    128: [
        {"BLOCK_E": 64, "CHUNK": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_E": 32, "CHUNK": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 32, "CHUNK": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 64, "CHUNK": 16, "num_warps": 8, "num_stages": 2},
        {"BLOCK_E": 32, "CHUNK": 16, "num_warps": 4, "num_stages": 3},
        {"BLOCK_E": 32, "CHUNK": 16, "num_warps": 8, "num_stages": 2},
    ],
}
#: scan's candidates (keys over its rule's): the warps its float32 rule chooses between, and
#: deeper load pipelines on 4 warps.
SCAN_CANDIDATES = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 4, "num_stages": 3},
                   {"num_warps": 4, "num_stages": 4}]
#: float32 products "highest" may use: the kernel files' own split into two bfloat16 parts
#: (``BF16X3_MANUAL``, chunked's default), 3xTF32 (scan's) and Triton's splits into bfloat16 parts (two
#: parts, three products; three parts, six products).
HIGHEST_PRODUCTS = ("bf16x3_manual", "tf32x3", "bf16x3", "bf16x6")
#: Products the interpreter computes: Triton's own splits are lowered on a GPU only.
INTERPRETER_PRODUCTS = ("bf16x3_manual", "tf32x3")
DEFAULT_PRODUCTS = FLOAT32_PRECISIONS["highest"]
#: Short names of config keys in printed rows.
LABELS = {"BLOCK_E": "E", "CHUNK": "C", "num_warps": "w", "num_stages": "s", "SEGMENT_LEN": "L"}
#: In CPU mode: tiny shapes, and the candidates the interpreter runs in seconds.
CPU_SHAPES = ((1, 2, 40, 16, 16),)
CPU_CANDIDATES = [{"BLOCK_E": 16, "CHUNK": 16, "num_warps": 4, "num_stages": 2}]
CPU_SCAN_CANDIDATES = [{"num_warps": 4}]
#: Heads checked against float64 (of batch 0).
CHECKED_HEADS = 2


def candidates_for(D, chosen=None):
    """``chosen`` (from ``--candidates``) if given, else the candidates for D's head size."""
    if chosen is not None:
        return chosen
    if ttx_tutorial.INTERPRETED:
        return CPU_CANDIDATES
    return CANDIDATES[64 if D <= 64 else 128]


def scan_candidates(chosen=None):
    """``chosen`` (from ``--scan-candidates``) if given, else the built-in ones."""
    if chosen is not None:
        return chosen
    return CPU_SCAN_CANDIDATES if ttx_tutorial.INTERPRETED else SCAN_CANDIDATES


def median_ms(fn, leaves):
    """Median ms of one call; ``leaves``' gradients are cleared before each."""
    if ttx_tutorial.INTERPRETED:
        samples = []
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = None
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    return float(do_bench(fn, warmup=10, rep=50, grad_to_none=leaves, return_mode="median"))


def reversed_in_time(x):
    return x.flip(2)


def reference_gradients(q, k, v, grad_o):
    """dq, dk, dv of <o, grad_o> in float64, each a causal product of the inputs:
    dq_t = sum_{s<=t} (dO_t . v_s) k_s, and in reverse time dk_s = sum_{t>=s} (v_s . dO_t) q_t and
    dv_s = sum_{t>=s} (k_s . q_t) dO_t."""
    device = q.device
    dq = reference(grad_o, v, k, device=device, chunk=2048)[0]
    r = reversed_in_time
    dk = r(reference(r(v), r(grad_o), r(q), device=device, chunk=2048)[0])
    dv = r(reference(r(k), r(q), r(grad_o), device=device, chunk=2048)[0])
    return dq, dk, dv


class Shape:
    """Inputs of one shape and their float64 references (batch 0, the first heads)."""

    def __init__(self, shape, seed):
        B, H, T, D, E = shape
        self.shape = shape
        self.q, self.k, self.v = random_inputs(B, H, T, D, E, seed=seed, device=ttx_tutorial.DEVICE)
        self.grad_o = torch.randn(B, H, T, E, device=self.q.device)
        self._references = None

    def references(self):
        if self._references is None:
            q, k, v, grad_o = (x[:1, :CHECKED_HEADS] for x in (self.q, self.k, self.v, self.grad_o))
            self._references = {"fwd": (reference(q, k, v, device=q.device, chunk=2048)[0],),
                                "fwd+bwd": reference_gradients(q, k, v, grad_o)}
        return self._references

    def error(self, mode, outputs, time_major=False):
        checked = [x[:1, :, :CHECKED_HEADS] if time_major else x[:1, :CHECKED_HEADS] for x in outputs]
        if time_major:
            checked = [x.transpose(1, 2) for x in checked]
        return max(relative_error(x, ref) for x, ref in zip(checked, self.references()[mode]))


def timed(point: Shape, mode, function, time_major=False):
    """(ms, rel_err) of function(q, k, v) -> o."""
    tensors = (point.q, point.k, point.v, point.grad_o)
    if time_major:
        tensors = tuple(x.transpose(1, 2).contiguous() for x in tensors)
    q, k, v, grad_o = tensors
    if mode == "fwd":
        error = point.error(mode, [function(q, k, v)], time_major)
        return median_ms(lambda: function(q, k, v), []), error
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def call():
        function(*leaves).backward(grad_o)

    call()
    error = point.error(mode, [x.grad for x in leaves], time_major)
    return median_ms(call, leaves), error


def peers():
    """name -> function(q, k, v) -> o, and whether it takes (B, T, H, D); and why others are absent."""
    found, missing = {}, {}
    if ttx_tutorial.INTERPRETED:
        return found, {"fast_transformers": "GPU only", "fla": "GPU only"}
    try:
        from fast_transformers.causal_product import causal_dot_product
        found["fast_transformers"] = (causal_dot_product, False)
    except Exception as exc:  # noqa: BLE001  optional
        missing["fast_transformers"] = f"{type(exc).__name__}: {exc}"
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn
        for name, fn in (("fla_chunk", chunk_linear_attn), ("fla_fused_chunk", fused_chunk_linear_attn)):
            found[name] = ((lambda fn: lambda q, k, v: fn(q, k, v, scale=1.0, normalize=False)[0])(fn), True)
    except Exception as exc:  # noqa: BLE001  optional
        missing["fla"] = f"{type(exc).__name__}: {exc}"
    return found, missing


def jobs(shapes, settings, peer_functions, products=(DEFAULT_PRODUCTS,), chosen=None, scan_chosen=None):
    """(shape index, setting, products, implementation, config, function, time_major), most
    useful first; "highest" once per kind of ``products``, the other settings with TF32."""
    first, peer_jobs, second = [], [], []
    for index, (B, H, T, D, E) in enumerate(shapes):
        for name, (function, time_major) in peer_functions.items():
            peer_jobs.append((index, None, None, name, None, function, time_major))
        for setting in settings:
            for kind in (products if setting == "highest" else (FLOAT32_PRECISIONS[setting],)):
                for method in ("chunked", "scan", "recurrent"):
                    first.append((index, setting, kind, method, "rule",
                                  (lambda m: lambda q, k, v: ttx_tutorial.causal_product(q, k, v, m))(method), False))
                for config in candidates_for(D, chosen):
                    second.append((index, setting, kind, "chunked", config,
                                   (lambda c: lambda q, k, v: chunked.chunked_causal_product(q, k, v, config=c)[0])(
                                       config), False))
                for config in scan_candidates(scan_chosen):
                    second.append((index, setting, kind, "scan", config,
                                   (lambda c: lambda q, k, v: scan.scan_causal_product(q, k, v, config=c)[0])(config),
                                   False))
    return first + peer_jobs + second


@contextlib.contextmanager
def float32_products(setting, kind):
    """PyTorch's ``setting``, and ``kind`` as the kernels' float32 products under it."""
    saved = {module: dict(module.FLOAT32_PRECISIONS) for module in (chunked, scan)}
    torch.set_float32_matmul_precision(setting)
    for module in saved:
        module.FLOAT32_PRECISIONS[setting] = kind
    try:
        yield
    finally:
        for module, precisions in saved.items():
            module.FLOAT32_PRECISIONS.update(precisions)
        torch.set_float32_matmul_precision("highest")


def run(shapes, settings, max_seconds, with_peers=True, products=(DEFAULT_PRODUCTS,), chosen=None,
        scan_chosen=None):
    start = time.perf_counter()
    peer_functions, missing = peers() if with_peers else ({}, {"peers": "--no-peers"})
    points = {}
    rows = []
    work = jobs(shapes, settings, peer_functions, products, chosen, scan_chosen)
    for index, setting, kind, impl, config, function, time_major in work:
        for mode in MODES:
            row = {"shape": list(shapes[index]), "impl": impl, "setting": setting, "products": kind,
                   "config": config, "mode": mode, "ms": None, "rel_err": None, "note": None}
            rows.append(row)
            if time.perf_counter() - start > max_seconds:
                row["note"] = f"not timed: past --max-seconds {max_seconds}"
                continue
            if index not in points:
                points = {index: Shape(shapes[index], seed=index)}  # one shape's tensors at a time
            try:
                with float32_products(setting or "highest", kind or DEFAULT_PRODUCTS):
                    row["ms"], row["rel_err"] = timed(points[index], mode, function, time_major)
            except Exception as exc:  # noqa: BLE001  a config that fails (resources) must not end the run
                row["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                if not ttx_tutorial.INTERPRETED:
                    torch.cuda.synchronize()
            print(line(row), flush=True)
    return rows, missing, time.perf_counter() - start


def config_label(config):
    if config is None or config == "rule":
        return config or ""
    return " ".join(f"{LABELS[key]}{value}" for key, value in config.items())


def line(row):
    ms = "-" if row["ms"] is None else f"{row['ms']:.3f}"
    err = "-" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
    return (f"{'x'.join(map(str, row['shape'][:4])):>18} {row['mode']:>7} {row['setting'] or '':>7} "
            f"{row['products'] or '':>6} {row['impl']:>17} {config_label(row['config']):>18} {ms:>9} {err:>8}  "
            f"{row['note'] or ''}")


def summary(rows):
    """Per (shape, setting, mode): our fastest method and config (any kind of products) within
    the setting's error bound, beside our rules' and the peers' times."""
    out = ["", "best config per (shape, setting, mode), error within the setting's bound:"]
    keys = sorted({(tuple(r["shape"]), r["setting"], r["mode"]) for r in rows if r["setting"]},
                  key=lambda key: (key[0], key[1], key[2]))
    for shape, setting, mode in keys:
        same = [r for r in rows if tuple(r["shape"]) == shape and r["mode"] == mode]
        ours = [r for r in same if r["setting"] == setting and r["ms"] is not None
                and r["rel_err"] is not None and r["rel_err"] <= ERROR_BOUNDS[setting]]
        peers_ms = {r["impl"]: r["ms"] for r in same if r["setting"] is None and r["ms"] is not None}
        others = {f"{r['impl']} rule {r['products']}": r["ms"] for r in same if r["setting"] == setting
                  and r["config"] == "rule" and r["ms"] is not None}
        best = min(ours, key=lambda r: r["ms"]) if ours else None
        text = (f"{best['ms']:.3f} ms ({best['impl']} {best['products']} {config_label(best['config'])}, "
                f"err {best['rel_err']:.1e})"
                if best else "none within bound")
        beside = ", ".join(f"{name} {ms:.3f}" for name, ms in {**others, **peers_ms}.items())
        out.append(f"{'x'.join(map(str, shape[:4])):>18} {setting:>7} {mode:>7}: {text}; {beside}")
    return "\n".join(out)


def environment(command):
    gpu = "cpu (Triton interpreter)" if ttx_tutorial.INTERPRETED else torch.cuda.get_device_name()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "torch": torch.__version__, "triton": triton.__version__, "command": command}


def _json_configs(parser, option, text):
    """A non-empty list of dicts from ``text``, or the parser's error naming ``option``."""
    try:
        configs = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{option}: not JSON ({exc})")
    if not isinstance(configs, list) or not configs or any(not isinstance(c, dict) for c in configs):
        parser.error(f"{option}: a non-empty JSON list of dicts, got {text!r}")
    return configs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="'B,H,T,D[,E];...' (default: the reference shapes)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="torch.set_float32_matmul_precision values, comma-separated")
    parser.add_argument("--max-seconds", type=float, default=200.0, help="start no timing after this")
    parser.add_argument("--out", default=None, help="JSON file for every row and the environment")
    parser.add_argument("--no-peers", action="store_true", help="time neither fast-transformers nor fla")
    parser.add_argument("--products", default=DEFAULT_PRODUCTS,
                        help="kinds of float32 products to time under 'highest', comma-separated "
                             f"(from {', '.join(HIGHEST_PRODUCTS)})")
    parser.add_argument("--candidates", default=None,
                        help="chunked configs to time instead of CANDIDATES, a JSON list of dicts with the keys "
                             f"{', '.join(chunked.CONFIG_KEYS)}, e.g. "
                             "'[{\"BLOCK_E\": 64, \"CHUNK\": 32, \"num_warps\": 8, \"num_stages\": 3}]'")
    parser.add_argument("--scan-candidates", default=None,
                        help="scan configs to time instead of SCAN_CANDIDATES, a JSON list of dicts with keys "
                             f"among {', '.join(scan.CONFIG_KEYS)} (the rule fills the others)")
    args = parser.parse_args(argv)
    chosen = scan_chosen = None
    if args.candidates is not None:
        chosen = _json_configs(parser, "--candidates", args.candidates)
        if any(set(c) != set(chunked.CONFIG_KEYS) for c in chosen):
            parser.error(f"--candidates: each dict needs exactly the keys {', '.join(chunked.CONFIG_KEYS)}")
    if args.scan_candidates is not None:
        scan_chosen = _json_configs(parser, "--scan-candidates", args.scan_candidates)
        if any(set(c) - set(scan.CONFIG_KEYS) for c in scan_chosen):
            parser.error(f"--scan-candidates: keys must be among {', '.join(scan.CONFIG_KEYS)}")
    products = tuple(p for p in args.products.split(",") if p)
    if not products or set(products) - set(HIGHEST_PRODUCTS):
        parser.error(f"--products: choose from {', '.join(HIGHEST_PRODUCTS)}, got {args.products!r}")
    if ttx_tutorial.INTERPRETED and set(products) - set(INTERPRETER_PRODUCTS):
        parser.error(f"--products: Triton's interpreter knows only {', '.join(INTERPRETER_PRODUCTS)} of these")
    if args.shapes is not None:
        shapes = parse_shapes(args.shapes, "--shapes")
    else:
        shapes = CPU_SHAPES if ttx_tutorial.INTERPRETED else REFERENCE_SHAPES
    settings = tuple(s for s in args.settings.split(",") if s)
    unknown = set(settings) - set(ERROR_BOUNDS)
    if unknown:
        parser.error(f"--settings: unknown {sorted(unknown)}; choose from {sorted(ERROR_BOUNDS)}")
    env = environment(" ".join(["python", *sys.argv]) if argv is None else " ".join(["float32_sweep", *argv]))
    print(json.dumps(env))
    rows, missing, seconds = run(shapes, settings, args.max_seconds, with_peers=not args.no_peers, products=products,
                                 chosen=chosen, scan_chosen=scan_chosen)
    for name, why in missing.items():
        print(f"{name}: not timed ({why})")
    print(summary(rows))
    print(f"\n{seconds:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**env, "seconds": seconds, "missing": missing, "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
