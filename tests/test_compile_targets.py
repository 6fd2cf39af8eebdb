"""Every kernel launch the package makes, compiled for real GPUs, on any machine.

Triton's CPU interpreter accepts code that the GPU compiler refuses (a ``tl.dot`` on a block
smaller than 16, a shape it cannot lay out, too much shared memory, an integer argument that the
GPU launcher turns into a constant). So here the wrappers of every Triton method run over a grid
of shapes, dtypes, head dimensions, initial states and the kernel file's ``TUNING_CANDIDATES``,
forward and backward, with every launch recorded instead of executed; and each distinct launch
is compiled with the arguments the wrapper really passed, by
``ttx_tutorial.course.compiler.compile_launch``: Triton's own launcher binds them, so the
argument types, the integers specialised to constants and the alignment hints are those of a
GPU run, down to ``ptxas``. No GPU is needed.

The wrappers choose their configurations from the device's limits (``_device_limits`` of each
kernel file: multiprocessors and shared memory per block), so the launches are recorded once
with an A100's limits, compiled for sm_80, and once with an H100's, compiled for sm_90. Each
compiled kernel must fit its target's shared memory. A few launches must also compile to the
instructions their speed depends on (``EXPECTED_INSTRUCTIONS``).

Recording and compiling run in child processes with ``TRITON_INTERPRET=0``, so the kernels are
the ``JITFunction``s a GPU run would build and nothing the interpreter patches can leak into the
compiler; each (family, target) is split over ``TTX_COMPILE_JOBS`` children (default: one per
CPU core). Triton's on-disk cache makes later runs fast.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
import torch

from ttx_tutorial import testing

CHILD_TIMEOUT_S = 3600

#: Kernel families, by the file under ttx_tutorial/kernels/ that holds them.
FAMILIES = ("recurrent", "chunked", "scan", "step", "feature_map")

#: The device limits the wrappers see while their launches are recorded, (multiprocessors,
#: shared memory per block opt-in), and the target those launches are compiled for.
DEVICE_LIMITS = {"sm_80": (108, 166912),   # A100
                 "sm_90": (132, 232448)}   # H100, H200

#: Compile children run side by side (``TTX_COMPILE_JOBS``, default: one per CPU core).
JOBS = max(1, int(os.environ.get("TTX_COMPILE_JOBS") or os.cpu_count() or 1))

COVERAGE_HEAD_DIMS = [(1, 1), (16, 16), (17, 33), (64, 64), (65, 129), (128, 128), (1, 256), (256, 1),
                      (200, 256), (256, 256)]
COVERAGE_SHAPES = [(1, 1, 1), (1, 1, 100), (2, 3, 777), (4, 16, 5000)]  # (B, H, T)
LONG_T = 4096 * 64 + 100  # past 4096 chunks of the default rule's 64 tokens (chunked's carry)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel_module(family):
    """The kernel file of a method, through the API's method table; the step and the feature maps
    have no method."""
    if family in ("step", "feature_map"):
        import importlib
        return importlib.import_module(f"ttx_tutorial.kernels.{family}")
    import ttx_tutorial
    return inspect.getmodule(ttx_tutorial.method_info(family).function)


def launched_kernels(module) -> dict:
    """The module's kernels that the host launches: every ``@triton.jit`` named ``*_kernel``."""
    from triton.runtime.jit import KernelInterface

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, KernelInterface) and name.endswith("_kernel")}


# --------------------------------------------------------------------------- the grid of calls

def wrapper_calls(module):
    """(call, thunk) pairs: each thunk runs the file's entry for checked inputs once (forward and
    backward for the causal products) at one point of the grid; ``call`` describes that point."""
    if module.__name__.endswith(".step"):
        return step_calls(module)
    if module.__name__.endswith(".feature_map"):
        return feature_map_calls(module)
    calls = []

    def add(B, H, T, D, E, dtype, config=None, with_state=True, cu_seqlens=None, offsets_dtype=torch.int32,
            normalized=False, feature_map=None, features=None, matmul_precision="highest", products=None):
        def thunk():
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(matmul_precision)  # float32's products and rule
            # Products no setting selects (the sweep's candidates) replace the setting's for this call.
            replaced = (mock.patch.dict(module.FLOAT32_PRECISIONS, {matmul_precision: products}) if products
                        else contextlib.nullcontext())
            try:
                with replaced:
                    run()
            finally:
                torch.set_float32_matmul_precision(before)

        def run():
            # Uninitialised memory: nothing runs, and filling gigabytes with zeros would cost seconds.
            q = torch.empty(B, H, T, D, dtype=dtype, requires_grad=True)
            k = torch.empty(B, H, T, D, dtype=dtype, requires_grad=True)
            v = torch.empty(B, H, T, E, dtype=dtype, requires_grad=True)
            packed = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=offsets_dtype)
            states = B if cu_seqlens is None else len(cu_seqlens) - 1
            s0 = (torch.empty(states, H, D, E + normalized, dtype=torch.float32, requires_grad=True)
                  if with_state else None)
            if normalized:  # the states carry z as an extra column
                packing = {} if packed is None else {"cu_seqlens": packed}
                mapping = {} if feature_map is None else {"feature_map": feature_map}
                if features is not None:  # q and k raw, their features made beforehand (chunked)
                    mapping = {"features": (features, torch.empty_like(q).detach(), torch.empty_like(k).detach())}
                o, state = module._run_normalized_validated(q, k, v, s0, 1e-6, config, **packing, **mapping)
            else:
                o, state = module._run_validated(q, k, v, s0, config=config, cu_seqlens=packed)
            torch.autograd.backward((o, state), (torch.empty_like(o), torch.empty_like(state)))
        call = {"shape": [B, H, T, D, E], "dtype": str(dtype).removeprefix("torch."), "config": config,
                "initial_state": with_state, "cu_seqlens": cu_seqlens, "normalized": normalized,
                "feature_map": feature_map or features}
        if matmul_precision != "highest":
            call["float32_matmul_precision"] = matmul_precision
        if products:
            call["products"] = products
        calls.append((call, thunk))

    for dtype in DTYPES:
        for D, E in COVERAGE_HEAD_DIMS:
            for B, H, T in COVERAGE_SHAPES:
                if B * H * T * max(D, E) <= 2_000_000:
                    add(B, H, T, D, E, dtype, with_state=(T != 100))
    # float32 under TF32 ("high"): its own tiles (whole value heads up to 128 columns in chunked).
    for D, E in COVERAGE_HEAD_DIMS:
        add(2, 3, 777, D, E, torch.float32, matmul_precision="high")
    # chunked's transposed TF32 loop (keys 128 wide) beyond those few heads' narrowed blocks:
    # whole value heads (many heads), packed sequences, a carry past 4096 chunks, and the
    # normalised attention, whose forward keeps the untransposed loop and whose passes do not.
    if hasattr(module, "TRANSPOSED_KEY_BLOCKS"):
        add(8, 16, 64, 128, 128, torch.float32, matmul_precision="high")
        add(1, 4, 3000, 128, 128, torch.float32, cu_seqlens=(0, 1000, 1000, 2999, 3000), matmul_precision="high")
        add(1, 1, LONG_T, 128, 128, torch.float32, with_state=False, matmul_precision="high")
        add(2, 3, 777, 128, 128, torch.float32, normalized=True, matmul_precision="high")
        # and the fused backward, which float32 heads up to 64 wide take under TF32
        add(2, 3, 777, 64, 64, torch.float32, normalized=True, matmul_precision="high")
        add(1, 4, 3000, 64, 64, torch.float32, cu_seqlens=(0, 1000, 1000, 2999, 3000), matmul_precision="high")
        add(1, 1, LONG_T, 64, 64, torch.float32, with_state=False, matmul_precision="high")
    # The other products of "highest" at two tiles: 3xTF32 where the file's default is the split
    # into bfloat16 parts (BF16X3_MANUAL: chunked; 3xTF32 is then the products of small calls,
    # of the normalised attention, and what benchmarks/float32_sweep.py times with --products
    # tf32x3), the split where the default is 3xTF32 (scan, whose split is an opt-in).
    if hasattr(module, "BF16X3_MANUAL"):
        other = "tf32x3" if module.FLOAT32_PRECISIONS["highest"] == "bf16x3_manual" else "bf16x3_manual"
        for D, E in ((64, 64), (128, 128)):
            add(2, 3, 777, D, E, torch.float32, products=other)
    # Long 16-bit sequences, past the chunk count where chunked sums its states with a carry.
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            add(1, 1, LONG_T, head_dim, head_dim, dtype)
    # Packed sequences (cu_seqlens): each kernel's IS_VARLEN variant, int32 and int64 offsets, and
    # one token in all (the most integers the launcher turns into constants).
    for dtype in DTYPES:
        for D, E in ((16, 16), (17, 33), (64, 64), (128, 128)):
            add(1, 4, 3000, D, E, dtype, cu_seqlens=(0, 1000, 1000, 2999, 3000))
    add(1, 4, 3000, 64, 64, torch.bfloat16, cu_seqlens=(0, 1500, 3000), offsets_dtype=torch.int64)
    add(1, 1, 1, 64, 64, torch.bfloat16, cu_seqlens=(0, 0, 1))
    # The normalised attention of a file that computes it in the kernel (NORMALIZE of chunked,
    # recurrent and scan; scan's NORMALIZER_GRADIENT): its forward, its fused backward and its passes.
    if hasattr(module, "_run_normalized_validated"):
        for dtype in DTYPES:
            for D, E in COVERAGE_HEAD_DIMS:
                for B, H, T in COVERAGE_SHAPES:
                    if B * H * T * max(D, E) <= 2_000_000:
                        add(B, H, T, D, E, dtype, with_state=(T != 100), normalized=True)
        for dtype in (torch.float16, torch.bfloat16):
            add(1, 1, LONG_T, 64, 64, dtype, normalized=True)
        # Feature maps inside the normalised kernels (scan's FEATURE_MAP): padded heads in every
        # dtype, the benchmark head, and relu once (each map is its own compiled variant).
        if "feature_map" in inspect.signature(module._run_normalized_validated).parameters:
            for dtype in DTYPES:
                add(2, 3, 777, 17, 33, dtype, normalized=True, feature_map="elu")
            add(2, 3, 777, 64, 64, torch.bfloat16, normalized=True, feature_map="elu")
            add(2, 3, 777, 17, 33, torch.bfloat16, normalized=True, feature_map="relu")
        # The map's derivative in chunked's backward (FEATURE_MAP of the fused kernel, its token
        # walks and the terms' walks): the fused backward and the passes, each map.
        if "features" in inspect.signature(module._run_normalized_validated).parameters:
            for name in ("elu", "relu"):
                for dtype in DTYPES:
                    add(2, 3, 777, 17, 33, dtype, normalized=True, features=name)
                add(2, 3, 777, 64, 64, torch.bfloat16, normalized=True, features=name)
                add(2, 3, 777, 128, 128, torch.bfloat16, normalized=True, features=name)
        # Normalised packed sequences (IS_VARLEN with NORMALIZE): recurrent's (both walks) and scan's.
        if "cu_seqlens" in inspect.signature(module._run_normalized_validated).parameters:
            for dtype in DTYPES:
                for D, E in ((16, 16), (64, 64), (128, 128)):
                    add(1, 4, 3000, D, E, dtype, cu_seqlens=(0, 1000, 1000, 2999, 3000), normalized=True)
            add(1, 1, 1, 64, 64, torch.bfloat16, cu_seqlens=(0, 0, 1), normalized=True)
            if "WALK" in module.CONFIG_KEYS:
                add(1, 4, 3000, 64, 64, torch.bfloat16, config={"WALK": "blocks"}, cu_seqlens=(0, 1500, 3000),
                    normalized=True)
    # TUNING_CANDIDATES are offered to benchmarks for bfloat16 with D = E = 64 and 128.
    for candidate in module.TUNING_CANDIDATES:
        for head_dim in (64, 128):
            add(2, 4, 3000, head_dim, head_dim, torch.bfloat16, config=dict(candidate))
    return calls


def step_calls(step):
    """The generation step: one token per call, every feature map, with and without the normaliser."""
    calls = []
    for dtype in DTYPES:
        for feature_map in step.FEATURE_MAPS:
            for normalize in (True, False):
                for D, E in COVERAGE_HEAD_DIMS:
                    for B, H in ((1, 1), (8, 16)):
                        def thunk(B=B, H=H, D=D, E=E, dtype=dtype, feature_map=feature_map, normalize=normalize):
                            q, k = torch.empty(B, H, D, dtype=dtype), torch.empty(B, H, D, dtype=dtype)
                            v = torch.empty(B, H, E, dtype=dtype)
                            state = torch.empty(B, H, D, E + normalize)
                            step._launch(q, k, v, state, feature_map, normalize, 1e-6)
                        call = {"shape": [B, H, 1, D, E], "dtype": str(dtype).removeprefix("torch."),
                                "config": None, "feature_map": feature_map, "normalize": normalize}
                        calls.append((call, thunk))
    return calls


def feature_map_calls(feature_map):
    """The feature maps, forward and backward: every map and dtype, head dimensions from 1 to 256,
    a layer's heads (strided views) and contiguous tensors."""
    calls = []
    for dtype in DTYPES:
        for name in feature_map.FEATURE_MAPS:
            for D in (1, 17, 64, 128, 256):
                for B, H, T, strided in ((1, 1, 1, False), (2, 3, 777, False), (2, 3, 777, True)):
                    def thunk(B=B, H=H, T=T, D=D, dtype=dtype, name=name, strided=strided):
                        shape = (B, T, H, D) if strided else (B, H, T, D)
                        q, k = (torch.empty(shape, dtype=dtype) for _ in range(2))
                        if strided:
                            q, k = q.transpose(1, 2), k.transpose(1, 2)
                        phi_q, phi_k = feature_map._launch(q, k, name)
                        feature_map._launch_backward(torch.empty_like(phi_q), torch.empty_like(phi_k), phi_q, phi_k,
                                                     name)
                    call = {"shape": [B, H, T, D], "dtype": str(dtype).removeprefix("torch."), "config": None,
                            "feature_map": name, "strided": strided}
                    calls.append((call, thunk))
    return calls


class LaunchRecorder:
    """Replaces ``run`` on each kernel: records every launch's arguments, executes none.

    ``kernel[grid](*args, **kwargs)`` calls ``kernel.run(*args, grid=..., warmup=..., **kwargs)``,
    so an instance attribute ``run`` sees every launch. Nothing runs, so the sizes of the grid
    cost only their allocation.
    """

    def __init__(self, kernels):
        self.kernels = kernels
        self.launches = []  # (kernel name, args, kwargs)

    def __enter__(self):
        for name, kernel in self.kernels.items():
            kernel.run = self._recorder(name)
        return self

    def __exit__(self, *exc):
        for kernel in self.kernels.values():
            del kernel.run

    def _recorder(self, name):
        def run(*args, grid, warmup, **kwargs):
            if not warmup:
                self.launches.append((name, args, kwargs))
        return run


# --------------------------------------------------------------------------- the child

def selected_launches(family, target):
    """The launches compiled for ``target``, from those the wrappers make over the grid with
    ``target``'s device limits, in a fixed order: a list of (binding, kernel name, args, kwargs,
    the first call that made it).

    Launches differ in their configuration (the kernel, its pointer dtypes, constexprs, warps and
    stages) and in how the launcher specialises their integers, which multiplies the distinct
    binaries by ten. So each configuration is compiled once, with its launch that has the most
    arguments aligned to 16 (vectorised, pipelined loads: the most shared memory), and each kernel
    once more with its launch that has the most integers turned into constants (the most
    constant-folded code, which the interpreter never sees)."""
    from ttx_tutorial.course import compiler

    module = kernel_module(family)
    kernels = launched_kernels(module)
    limits = DEVICE_LIMITS[target]
    if hasattr(module, "_device_limits"):  # only files whose rules ask the driver have one
        module._device_limits = lambda device: limits
    most_aligned, most_constant = {}, {}
    for call, thunk in wrapper_calls(module):
        with LaunchRecorder(kernels) as recorder:
            thunk()
        if not recorder.launches:
            raise AssertionError(f"no kernel launch was seen for {call}: is the recorder blind?")
        for name, args, kwargs in recorder.launches:
            binding = compiler.bind_launch(kernels[name], *args, target=target, **kwargs)
            launch = (binding, name, args, kwargs, call)
            declared = {key: value for key, value in binding.constexprs.items() if key not in binding.specialised}
            configuration = repr((name, sorted(t for t in binding.signature.values() if t.startswith("*")),
                                  sorted(declared.items()), binding.num_warps, binding.num_stages))
            if (configuration not in most_aligned
                    or len(binding.aligned) > len(most_aligned[configuration][0].aligned)):
                most_aligned[configuration] = launch
            if name not in most_constant or len(binding.specialised) > len(most_constant[name][0].specialised):
                most_constant[name] = launch
    selected = {launch[0].key: launch for launch in [*most_aligned.values(), *most_constant.values()]}
    return list(selected.values())


def compile_shard(family, target, shard, shards):
    """Run in a child: compile every ``shards``-th distinct launch from ``shard`` on and print
    the results as JSON."""
    import ttx_tutorial
    from ttx_tutorial.course import compiler

    assert not ttx_tutorial.INTERPRETED, "the compile child must run without the interpreter"
    kernels = launched_kernels(kernel_module(family))
    launches = selected_launches(family, target)
    results = []
    for index, (binding, name, args, kwargs, call) in list(enumerate(launches))[shard::shards]:
        result = compiler.compile_launch(kernels[name], *args, target=target, **kwargs)
        results.append({
            "index": index, "of": len(launches), "kernel": name, "call": call, "specialised": binding.specialised, "ok": result.ok,
            "summary": result.summary(), "shared_bytes": result.shared_bytes,
            "limit": compiler.target_facts(target).max_shared_bytes_per_block,
            "num_stages": result.num_stages,
            "async_copies": result.ok and "cp.async" in result.ptx,
            "tensor_core_instructions": result.tensor_core_instructions() if result.ok else [],
            "warp_group_products": result.ptx.count("wgmma.mma_async") if result.ok else 0,
            "transposed": bool(kwargs.get("TRANSPOSED")), "block_e": kwargs.get("BLOCK_E"),
        })
    print(json.dumps(results))


if __name__ == "__main__":
    compile_shard(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))


# --------------------------------------------------------------------------- the tests

_RESULTS: dict[tuple[str, str], list[dict] | str] = {}  # (family, target) -> results, or why the children failed


def run_child(family, target, shard, shards) -> list[dict]:
    child = testing.run_python(Path(__file__), family, target, str(shard), str(shards), timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, f"recording or compiling {family}'s launches crashed:\n{child.stderr[-4000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def compiled_launches(family, target) -> list[dict]:
    """Every selected launch of ``family`` compiled for ``target``, once per test session, by JOBS
    children. A failure of the children is remembered and reported by every test that asks."""
    if (family, target) not in _RESULTS:
        try:
            with ThreadPoolExecutor(JOBS) as pool:
                shards = list(pool.map(lambda shard: run_child(family, target, shard, JOBS), range(JOBS)))
            results = sorted((r for shard in shards for r in shard), key=lambda r: r["index"])
            assert results and [r["index"] for r in results] == list(range(results[0]["of"])), \
                "the children did not compile every selected launch exactly once"
            _RESULTS[family, target] = results
        except (AssertionError, subprocess.SubprocessError, ValueError) as error:
            _RESULTS[family, target] = f"{type(error).__name__}: {error}"
    if isinstance(_RESULTS[family, target], str):
        pytest.fail(_RESULTS[family, target])
    return _RESULTS[family, target]


CASES = [pytest.param(family, target, id=f"{family}-{target}") for family in FAMILIES for target in DEVICE_LIMITS]


@pytest.mark.parametrize("family, target", CASES)
def test_every_launch_compiles_for_the_gpu_target_within_its_shared_memory(family, target):
    results = compiled_launches(family, target)
    refused = [f"{r['summary']}\n    first made by {r['call']}" for r in results if not r["ok"]]
    assert not refused, f"{len(refused)} of {len(results)} launches do not compile:\n" + "\n".join(refused[:10])
    too_big = [f"{r['summary']}\n    first made by {r['call']}" for r in results if r["shared_bytes"] > r["limit"]]
    assert not too_big, (f"{len(too_big)} launches need more shared memory than one block may use on {target}, "
                         "so they would fail at launch:\n" + "\n".join(too_big[:10]))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_of_the_file_is_launched_and_compiled(family):
    """The grid reaches every kernel the file defines, so none escapes compilation."""
    module = kernel_module(family)
    for target in DEVICE_LIMITS:
        launched = {r["kernel"] for r in compiled_launches(family, target)}
        assert launched == set(launched_kernels(module)), (
            f"{family} on {target}: kernels never launched over the grid: {set(launched_kernels(module)) - launched}")


def _default_16bit_head(call, head_dims=(64, 128)):
    B, H, T, D, E = call["shape"]
    return call["dtype"] in ("bfloat16", "float16") and D == E and D in head_dims and call["config"] is None


#: Kernels without products: the segment table of packed sequences (scan_segments_kernel), the
#: normalised backward's r_t (normalizer_gradient_kernel), one elementwise read each, and its
#: terms after the passes (normalizer_terms_kernel) and dz per chunk (chunk_suffix_sums_kernel),
#: walks of running sums.
WITHOUT_PRODUCTS = ("scan_segments_kernel", "normalizer_gradient_kernel", "normalizer_terms_kernel",
                    "chunk_suffix_sums_kernel")

#: Instructions the speed of a launch depends on: (family, target, which launches, what must hold).
EXPECTED_INSTRUCTIONS = [
    # Pipelined loads: with more than one stage, chunked's loads become asynchronous copies.
    ("chunked", "sm_90", lambda r: _default_16bit_head(r["call"]) and r["num_stages"] > 1
     and r["kernel"] not in WITHOUT_PRODUCTS,
     "asynchronous copies (cp.async)", lambda r: r["async_copies"]),
    # Hopper's warp-group tensor-core instructions in every kernel of the scan with products.
    ("scan", "sm_90", lambda r: _default_16bit_head(r["call"]) and r["call"]["shape"][2] >= 64
     and r["kernel"] not in WITHOUT_PRODUCTS,
     "wgmma", lambda r: any(op.startswith("wgmma") for op in r["tensor_core_instructions"])),
    # chunked's transposed TF32 loop on whole 128-column value heads: its products of 128 rows run
    # as warp-group products (the untransposed loop has 4 there, its state product's).
    ("chunked", "sm_90", lambda r: r["transposed"] and r["block_e"] == 128,
     "at least 16 warp-group products (wgmma)", lambda r: r["warp_group_products"] >= 16),
    # The chunked kernels with products run them on tensor cores.
    ("chunked", "sm_80", lambda r: _default_16bit_head(r["call"]) and r["kernel"] not in WITHOUT_PRODUCTS,
     "tensor-core mma", lambda r: bool(r["tensor_core_instructions"])),
]


@pytest.mark.parametrize("family, target, selects, what, holds",
                         [pytest.param(*e, id=f"{e[0]}-{e[1]}-{e[3]}") for e in EXPECTED_INSTRUCTIONS])
def test_fast_launches_compile_to_the_instructions_their_speed_needs(family, target, selects, what, holds):
    selected = [r for r in compiled_launches(family, target) if r["ok"] and selects(r)]
    assert selected, f"no launch of {family} on {target} was selected: the grid or the selection changed"
    missing = [f"{r['summary']}\n    first made by {r['call']}" for r in selected if not holds(r)]
    assert not missing, f"{len(missing)} of {len(selected)} launches lack {what}:\n" + "\n".join(missing[:10])
