"""Every Triton kernel the package can launch, compiled for real GPUs, on any machine.

Triton's CPU interpreter accepts code that the GPU compiler refuses (a ``tl.dot`` on a block
smaller than 16, a shape it cannot lay out, too much shared memory). So each entry of every
kernel file's ``launch_variants()`` (docs/CONTRIBUTING.md) is compiled here for sm_80 (A100) and
sm_90 (H100/H200) with ``ttx_tutorial.course.compiler``: ``triton.compile`` with a ``GPUTarget``, the
whole pipeline down to ``ptxas``, no GPU needed. Each compiled kernel's shared memory must fit
the target's per-block limit.

The compiles run in child processes with ``TRITON_INTERPRET=0``, so the kernels are the real
``JITFunction``s a GPU run would build, and nothing the interpreter patches while other tests run
can leak into the compiler. Each family's variants are compiled once, split over
``TTX_COMPILE_JOBS`` children (default: one per CPU core), and the results are shared by that
family's parametrized cases. Triton's on-disk cache makes later runs fast.

A second test checks ``launch_variants()`` against the wrappers themselves: every launch a
wrapper makes (forward and backward, over dtypes, head dimensions and lengths, and with the
file's ``TUNING_CANDIDATES`` for bfloat16) must be one of the listed variants, or CI would
compile something other than what runs.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import triton

import ttx_tutorial
from triton.runtime.jit import KernelInterface

TARGETS = ("sm_80", "sm_90")
TRITON_METHODS = tuple(m for m in ttx_tutorial.METHODS if ttx_tutorial.method_info(m).is_triton)
ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 3600


def kernel_module(method):
    return inspect.getmodule(ttx_tutorial.method_info(method).function)


def kernel_name(kernel) -> str:
    return getattr(kernel, "fn", kernel).__name__


def variant_label(variant) -> str:
    """kernel, dtype (its first pointer's), constexprs, warps and stages: unique within a family."""
    pointers = [t for t in variant["signature"].values() if t.startswith("*")]
    dtype = pointers[0].lstrip("*") if pointers else "noptr"
    constexprs = ",".join(f"{name}={value}" for name, value in variant["constexprs"].items())
    return (f"{kernel_name(variant['kernel'])}-{dtype}-{constexprs}"
            f"-w{variant['num_warps']}s{variant['num_stages']}")


def compile_cases():
    """(method, variant index, label, target) for every variant; a family whose module or
    launch_variants() fails gives one case that reports the failure."""
    cases = []
    for method in TRITON_METHODS:
        try:
            labels = [variant_label(v) for v in kernel_module(method).launch_variants()]
        except Exception as error:  # reported by the test, not as a collection error
            cases.append(pytest.param(method, None, repr(error), None, id=f"{method}-launch_variants-failed"))
            continue
        for index, label in enumerate(labels):
            for target in TARGETS:
                cases.append(pytest.param(method, index, label, target, id=f"{method}-{label}-{target}"))
    return cases


#: Compile children run side by side (``TTX_COMPILE_JOBS``, default: one per CPU core).
JOBS = max(1, int(os.environ.get("TTX_COMPILE_JOBS") or os.cpu_count() or 1))

_RESULTS: dict[str, list[dict] | str] = {}  # method -> its results, or why its children failed


def run_compile_child(method, shard, shards) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, __file__, method, str(shard), str(shards), *TARGETS],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, f"compiling {method}'s launch variants crashed:\n{child.stderr[-4000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def compile_family(method) -> list[dict]:
    """All variants of one family compiled for every target, once, by JOBS child processes.
    A failure of the children is remembered too, so that it is reported, not retried, by each
    of the family's cases."""
    if method not in _RESULTS:
        try:
            with ThreadPoolExecutor(JOBS) as pool:
                shards = list(pool.map(lambda shard: run_compile_child(method, shard, JOBS), range(JOBS)))
            _RESULTS[method] = [result for shard in shards for result in shard]
        except (AssertionError, subprocess.SubprocessError, ValueError) as error:
            _RESULTS[method] = f"{type(error).__name__}: {error}"
    if isinstance(_RESULTS[method], str):
        pytest.fail(_RESULTS[method])
    return _RESULTS[method]


@pytest.mark.parametrize("method, index, label, target", compile_cases())
def test_launch_variant_compiles_for_gpu_target(method, index, label, target):
    assert index is not None, f"{method}: importing its module or calling launch_variants() failed: {label}"
    results = [r for r in compile_family(method) if r["index"] == index and r["target"] == target]
    assert len(results) == 1, f"the compile child returned {len(results)} results for {label} on {target}"
    result = results[0]
    assert result["label"] == label, f"launch_variants() changed order: {result['label']} != {label}"
    assert result["ok"], f"{method} {label} does not compile for {target}: {result['message']}"
    assert result["shared_bytes"] <= result["limit"], (
        f"{method} {label} needs {result['shared_bytes']} bytes of shared memory on {target}, "
        f"more than the {result['limit']} one block may use: it would fail at launch"
    )


# --------------------------------------------------------------------------- coverage

_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
_TENSOR_POINTER_TYPES = {**_POINTER_TYPES, torch.int32: "*i32"}  # int32: counters, never an input
# What Triton compiles when the launch names no num_warps / num_stages (CUDA backend defaults).
_DEFAULT_LAUNCH = {"num_warps": 4, "num_stages": 3}


class LaunchRecorder:
    """Replaces ``run`` on every kernel in ``kernels``: records each launch, executes none.

    ``kernel[grid](*args, **kwargs)`` calls ``kernel.run(*args, grid=..., warmup=..., **kwargs)``
    on both JITFunction and the interpreter's InterpretedFunction, so an instance attribute
    ``run`` sees every launch. Nothing runs, so the sizes below cost only their allocation, and
    Triton's interpreter switch is off meanwhile, so the launches are those a GPU run would make
    (except where a wrapper asks the tensors' device).
    """

    def __init__(self, kernels):
        self.kernels = kernels
        self.launches = []

    def __enter__(self):
        for kernel in self.kernels:
            kernel.run = self._recorder(kernel)
        # Wrappers may pick constexprs by asking whether Triton interprets; nothing executes
        # here, so let them choose as they would on a GPU.
        self.interpreting = triton.knobs.runtime.interpret
        triton.knobs.runtime.interpret = False
        return self

    def __exit__(self, *exc):
        triton.knobs.runtime.interpret = self.interpreting
        for kernel in self.kernels:
            del kernel.run

    def _recorder(self, kernel):
        def run(*args, grid, warmup, **kwargs):
            if warmup:
                return None
            values = dict(zip(kernel.arg_names, args))
            values.update(kwargs)
            self.launches.append((kernel, values))
            return None
        return run


def launch_matches(values, variant) -> bool:
    for name, kind in variant["signature"].items():
        if name not in values:
            return False
        value = values[name]
        if kind == "constexpr":
            if value != variant["constexprs"][name]:
                return False
        elif kind.startswith("*") and value is not None:  # None: an unused pointer
            if not isinstance(value, torch.Tensor) or _TENSOR_POINTER_TYPES.get(value.dtype) != kind:
                return False
    launch = {key: values.get(key, default) for key, default in _DEFAULT_LAUNCH.items()}
    return launch == {key: variant[key] for key in _DEFAULT_LAUNCH}


def describe_launch(kernel, values, variants) -> str:
    """The kernel with what decides its compilation: pointer dtypes, constexprs, warps, stages."""
    constexpr_names = {name for v in variants if v["kernel"] is kernel
                       for name, kind in v["signature"].items() if kind == "constexpr"}
    shown = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            shown[name] = _TENSOR_POINTER_TYPES.get(value.dtype, str(value.dtype))
        elif name in constexpr_names or not constexpr_names:
            shown[name] = value
    shown.update({key: values.get(key, default) for key, default in _DEFAULT_LAUNCH.items()})
    return f"{kernel_name(kernel)}({shown})"


COVERAGE_HEAD_DIMS = [(1, 1), (16, 16), (17, 33), (64, 64), (65, 129), (128, 128), (1, 256), (256, 1),
                      (200, 256), (256, 256)]
COVERAGE_SHAPES = [(1, 1, 1), (1, 1, 100), (2, 3, 777), (4, 16, 5000)]  # (B, H, T)


def wrapper_calls(module, method):
    """(description, thunk) for forward and backward over dtypes, head dims, shapes and the
    module's tuning candidates; each thunk runs the wrapper once with gradients."""
    # The entry for checked inputs: the public function's checks would refuse these CPU tensors
    # while the recorder has the interpreter switched off (tensors must then be on the GPU).
    function = module._run_validated
    calls = []

    def call(B, H, T, D, E, dtype, config=None, with_state=True):
        def thunk():
            device = ttx_tutorial.DEVICE
            q = torch.zeros(B, H, T, D, dtype=dtype, device=device, requires_grad=True)
            k = torch.zeros(B, H, T, D, dtype=dtype, device=device, requires_grad=True)
            v = torch.zeros(B, H, T, E, dtype=dtype, device=device, requires_grad=True)
            s0 = (torch.zeros(B, H, D, E, dtype=torch.float32, device=device, requires_grad=True)
                  if with_state else None)
            o, state = function(q, k, v, s0, config=config)
            torch.autograd.backward((o, state), (torch.zeros_like(o), torch.zeros_like(state)))
        return (f"B={B} H={H} T={T} D={D} E={E} {dtype} config={config} initial_state={with_state}", thunk)

    for dtype in _POINTER_TYPES:
        for D, E in COVERAGE_HEAD_DIMS:
            for B, H, T in COVERAGE_SHAPES:
                if B * H * T * max(D, E) <= 2_000_000:
                    calls.append(call(B, H, T, D, E, dtype, with_state=(T != 100)))
    # The kernel files offer TUNING_CANDIDATES to benchmarks for 16-bit inputs with D = E = 64
    # and 128; bfloat16 is the dtype they all compile them for.
    for candidate in getattr(module, "TUNING_CANDIDATES", []):
        for head_dim in (64, 128):
            calls.append(call(2, 4, 3000, head_dim, head_dim, torch.bfloat16, config=dict(candidate)))
    return calls


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_launch_variants_cover_every_launch_of_the_wrappers(method):
    module = kernel_module(method)
    variants = module.launch_variants()
    kernels = [obj for obj in vars(module).values() if isinstance(obj, KernelInterface)]
    missing = {}  # launch -> the first call that made it
    for description, thunk in wrapper_calls(module, method):
        with LaunchRecorder(kernels) as recorder:
            thunk()
        assert recorder.launches, f"no kernel launch was seen for {description}: is the recorder blind?"
        for kernel, values in recorder.launches:
            if not any(v["kernel"] is kernel and launch_matches(values, v) for v in variants):
                missing.setdefault(describe_launch(kernel, values, variants), description)
    assert not missing, (f"{len(missing)} distinct launches of {method} are not in launch_variants(), so CI "
                         "never compiles them for a GPU; the first ones:\n"
                         + "\n".join(f"{launch} from {call}" for launch, call in list(missing.items())[:10]))


# --------------------------------------------------------------------------- the child

def _compile_shard(method, shard, shards, targets):
    """Run in a child: compile every ``shards``-th (variant, target) pair of ``method`` from
    ``shard`` on, and print the results as JSON."""
    import time

    from ttx_tutorial.course import compiler

    assert not ttx_tutorial.INTERPRETED, "the compile child must run without the interpreter"
    variants = kernel_module(method).launch_variants()
    pairs = [(index, target) for index in range(len(variants)) for target in targets][shard::shards]
    results = []
    for index, target in pairs:
        variant = variants[index]
        start = time.perf_counter()
        result = compiler.compile_variant(variant, target=target)
        results.append({
            "index": index, "label": variant_label(variant), "target": target, "ok": result.ok,
            "message": result.message, "shared_bytes": result.shared_bytes,
            "limit": compiler.target_facts(target).max_shared_bytes_per_block,
            "seconds": round(time.perf_counter() - start, 3),
        })
    print(json.dumps(results))


if __name__ == "__main__":
    _compile_shard(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
