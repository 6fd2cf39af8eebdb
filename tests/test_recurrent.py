"""The recurrent Triton kernel (method "recurrent") against float64 references.

Shapes are small and awkward on purpose: T = 0 and 1, D != E, D and E that are not powers of
two, one of them near 256. Every output is allocated poisoned (NaN), so an element the kernel
forgets to write fails the comparison.
"""

import pytest
import torch

import ttx_tutorial
from ttx_tutorial.kernels import recurrent
from ttx_tutorial.testing import (assert_close, poisoned_allocations, random_inputs, reference, reference_gradients,
                                  run_python)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (B, H, T, D, E)
FORWARD_SHAPES = [
    (1, 2, 0, 4, 3),     # empty sequence: o is empty, the final state is the initial one
    (2, 1, 1, 5, 7),     # one token
    (1, 2, 7, 24, 5),    # D != E, neither a power of two
    (1, 1, 33, 16, 65),  # E just past a power of two
    (1, 1, 5, 250, 3),   # D near 256
    (1, 1, 3, 2, 256),   # E = 256
]
BACKWARD_SHAPES = [
    (1, 1, 0, 3, 2),
    (1, 2, 1, 5, 4),
    (1, 1, 7, 24, 5),
    (1, 1, 33, 9, 65),
    (1, 1, 3, 250, 2),
]


def _shape_id(shape):
    return "B{}H{}T{}D{}E{}".format(*shape)


def _upstream_gradients(o_shape, state_shape, dtype, seed):
    """Random gradients for o (representable in ``dtype``) and for the final state (float32)."""
    generator = torch.Generator().manual_seed(seed)
    grad_o = torch.randn(o_shape, generator=generator).to(dtype)
    grad_state = torch.randn(state_shape, generator=generator)
    return grad_o.to(ttx_tutorial.DEVICE), grad_state.to(ttx_tutorial.DEVICE)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FORWARD_SHAPES, ids=_shape_id)
def test_forward_matches_float64(shape, dtype, with_state):
    q, k, v, s0 = random_inputs(*shape, dtype=dtype, seed=sum(shape), initial_state=True)
    s0 = s0 if with_state else None
    with poisoned_allocations():
        o, final_state = ttx_tutorial.causal_product(q, k, v, "recurrent", initial_state=s0,
                                                     return_state=True)
    ref_o, ref_state = reference(q, k, v, s0)
    assert o.dtype == dtype and o.shape == ref_o.shape
    assert final_state.dtype == torch.float32 and final_state.shape == ref_state.shape
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=_shape_id)
def test_backward_matches_float64(shape, dtype, with_state):
    q, k, v, s0 = random_inputs(*shape, dtype=dtype, seed=sum(shape) + 1, initial_state=True,
                                requires_grad=True)
    s0 = s0 if with_state else None
    B, H, T, D, E = shape
    grad_o, grad_state = _upstream_gradients((B, H, T, E), (B, H, D, E), dtype, seed=T)
    with poisoned_allocations():
        o, final_state = recurrent.recurrent_causal_product(q, k, v, s0)
        torch.autograd.backward([o, final_state], [grad_o, grad_state])
    expected = list(reference_gradients(q, k, v, s0, grad_o, grad_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "dS0"), (q, k, v, s0), expected):
        if x is None:
            continue
        assert x.grad.dtype == x.dtype, name
        assert_close(x.grad, ref, dtype, name)


#: Each walk with small blocks, whichever the rule takes (on a GPU: the blocks walk for few heads,
#: the tokens walk for many; the interpreter's rule: the blocks walk with whole heads). Blocks:
#: several blocks and a partial last one at T = 7 and 33, and D > 16 split over key blocks whose
#: float32 parts are added. Tokens: 32 value columns a program in 2 groups (several programs at
#: E = 65), 4 tokens a step and a tail at T = 5, 7, 33.
SMALL_WALKS = {"blocks": {"WALK": "blocks", "BLOCK_D": 16, "BLOCK_E": 4, "BLOCK_T": 8},
               "tokens": {"WALK": "tokens", "BLOCK_E": 32, "COLS": 16, "HALVES": 1, "UNROLL": 4},
               # The key rows in two tiles: rows past BLOCK_D / 2 (D = 9, 24, 250; E = 65 in dq's
               # and dk's walks) land in the second.
               "halves": {"WALK": "tokens", "BLOCK_E": 16, "COLS": 8, "HALVES": 2, "UNROLL": 4}}


def _walk_cases():
    """Every walk at every shape and dtype; the initial state alternates between shapes so that
    each walk meets each dtype with and without one (the state adds a load and dS0, the same
    code at every shape)."""
    shapes = BACKWARD_SHAPES + FORWARD_SHAPES[4:]
    for w, walk in enumerate(SMALL_WALKS):
        for s, shape in enumerate(shapes):
            for d, dtype in enumerate(DTYPES):
                with_state = (w + s + d) % 2 == 1
                yield pytest.param(shape, dtype, with_state, walk, id="-".join(
                    (_shape_id(shape), str(dtype), "initial_state" if with_state else "zero_state", walk)))


@pytest.mark.parametrize("shape, dtype, with_state, walk", list(_walk_cases()))
def test_each_walk_matches_float64(shape, dtype, with_state, walk):
    q, k, v, s0 = random_inputs(*shape, dtype=dtype, seed=sum(shape) + 2, initial_state=True,
                                requires_grad=True)
    s0 = s0 if with_state else None
    B, H, T, D, E = shape
    grad_o, grad_state = _upstream_gradients((B, H, T, E), (B, H, D, E), dtype, seed=T + 1)
    with poisoned_allocations():
        o, final_state = recurrent.recurrent_causal_product(q, k, v, s0, config=SMALL_WALKS[walk])
        torch.autograd.backward([o, final_state], [grad_o, grad_state])
    ref_o, ref_state = reference(q, k, v, s0)
    assert o.dtype == dtype
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")
    expected = list(reference_gradients(q, k, v, s0, grad_o, grad_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "dS0"), (q, k, v, s0), expected):
        if x is not None:
            assert_close(x.grad, ref, dtype, name)


@pytest.mark.parametrize("config", recurrent.TUNING_CANDIDATES, ids=lambda c: "-".join(map(str, c.values())))
def test_tuning_candidates_are_correct(config):
    """Every config the benchmark may pick: several value blocks, a partial last iteration."""
    B, H, T, D, E = 1, 1, 11, 8, 20
    q, k, v, s0 = random_inputs(B, H, T, D, E, dtype=torch.bfloat16, seed=3, initial_state=True,
                                requires_grad=True)
    grad_o, grad_state = _upstream_gradients((B, H, T, E), (B, H, D, E), torch.bfloat16, seed=4)
    with poisoned_allocations():
        o, final_state = recurrent.recurrent_causal_product(q, k, v, s0, config=config)
        torch.autograd.backward([o, final_state], [grad_o, grad_state])
    ref_o, ref_state = reference(q, k, v, s0)
    assert_close(o, ref_o, torch.bfloat16, "o")
    assert_close(final_state, ref_state, torch.bfloat16, "final state")
    expected = list(reference_gradients(q, k, v, s0, grad_o, grad_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "dS0"), (q, k, v, s0), expected):
        assert_close(x.grad, ref, torch.bfloat16, name)


@pytest.mark.parametrize("used", ["o only", "final state only"])
def test_gradient_when_one_output_is_unused(used):
    q, k, v = random_inputs(1, 2, 6, 4, 3, seed=5, requires_grad=True)
    o, final_state = recurrent.recurrent_causal_product(q, k, v)
    grad_o, grad_state = _upstream_gradients(o.shape, final_state.shape, torch.float32, seed=6)
    if used == "o only":
        (o * grad_o).sum().backward()
        grad_state = torch.zeros_like(grad_state)
    else:
        (final_state * grad_state).sum().backward()
        grad_o = torch.zeros_like(grad_o)
    expected = list(reference_gradients(q, k, v, None, grad_o, grad_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv"), (q, k, v), expected):
        assert_close(x.grad, ref, torch.float32, name)


def test_unknown_config_key_is_refused():
    q, k, v = random_inputs(1, 1, 2, 4, seed=0)
    with pytest.raises(ValueError, match="BLOCK_N"):
        recurrent.recurrent_causal_product(q, k, v, config={"BLOCK_N": 4})


def test_default_rule_fills_the_gpu():
    """Few heads (1, 8, 65536, 64) take the blocks walk with D split in two; many heads
    (8, 16, 4096, 64) and D = 128 the tokens walk."""
    few_heads = recurrent.default_config(1, 8, 64, 64, torch.bfloat16, multiprocessors=132)
    many_heads = recurrent.default_config(8, 16, 64, 64, torch.bfloat16, multiprocessors=132)
    wide_heads = recurrent.default_config(1, 8, 128, 128, torch.bfloat16, multiprocessors=132)
    assert few_heads["WALK"] == "blocks" and few_heads["BLOCK_D"] == 32
    assert many_heads["WALK"] == "tokens" and many_heads["BLOCK_E"] == 8
    assert wide_heads["WALK"] == "tokens"
    for D in (1, 16, 64, 100, 256):
        for dtype in DTYPES:
            for heads in (1, 4096):
                cfg = recurrent.default_config(1, heads, D, 256, dtype, multiprocessors=132)
                if cfg["WALK"] == "blocks":
                    assert heads == 1 and D <= 64
                    continue
                block_d = recurrent._block_d(D)
                # The groups fill the lanes the k tile leaves (see the caveats of the module docstring).
                assert cfg["BLOCK_E"] // cfg["COLS"] == recurrent._groups(block_d // cfg["HALVES"], dtype.itemsize)
                # Two tiles of key rows where one float32 tile of 128 would take every lane.
                assert cfg["HALVES"] == (2 if dtype == torch.float32 and block_d == 128 else 1)
                assert recurrent._shared_memory_bytes(block_d, cfg, dtype.itemsize) <= recurrent._SHARED_MEMORY_BUDGET
                if dtype.itemsize == 2 and D == 64:  # the v block is large enough to be copied asynchronously
                    assert cfg["UNROLL"] * cfg["BLOCK_E"] >= 64


def test_config_validation():
    q, k, v = random_inputs(1, 1, 2, 4, seed=0)
    with pytest.raises(ValueError, match="COLS"):
        recurrent.recurrent_causal_product(q, k, v, config={"BLOCK_E": 2, "COLS": 4})
    with pytest.raises(ValueError, match="HALVES must be 1 or 2"):
        recurrent.recurrent_causal_product(q, k, v, config={"WALK": "tokens", "HALVES": 4})
    # The normalised walks carry z or dz beside the state, in one tile.
    with pytest.raises(ValueError, match="HALVES must be 1 for the normalised attention"):
        recurrent.recurrent_normalized_attention(q.abs(), k.abs(), v, config={"WALK": "tokens", "HALVES": 2})
    with pytest.raises(ValueError, match="power of two"):
        recurrent.recurrent_causal_product(q, k, v, config={"BLOCK_E": 6})
    with pytest.raises(ValueError, match="BLOCK_T must be a power of two"):
        recurrent.recurrent_causal_product(q, k, v, config={"WALK": "blocks", "BLOCK_T": 12})
    with pytest.raises(ValueError, match="WALK must be one of"):
        recurrent.recurrent_causal_product(q, k, v, config={"WALK": "chunks"})
    # Keys of the other walk are refused, not silently ignored.
    with pytest.raises(ValueError, match=r"\['UNROLL'\] do not apply to WALK='blocks'"):
        recurrent.recurrent_causal_product(q, k, v, config={"WALK": "blocks", "UNROLL": 4})
    with pytest.raises(ValueError, match=r"\['BLOCK_T'\] do not apply to WALK='tokens'"):
        recurrent.recurrent_causal_product(q, k, v, config={"WALK": "tokens", "BLOCK_T": 4})
    with pytest.raises(ValueError, match="do not apply to WALK"):  # keys of both walks
        recurrent.recurrent_causal_product(q, k, v, config={"UNROLL": 4, "BLOCK_T": 4})


def test_config_without_walk_takes_the_walk_that_reads_its_keys():
    q, k, v = random_inputs(1, 1, 2, 4, seed=0)
    assert recurrent._resolve_config(q, v, {"UNROLL": 2})["WALK"] == "tokens"
    assert recurrent._resolve_config(q, v, {"BLOCK_T": 16})["WALK"] == "blocks"
    rule = recurrent._resolve_config(q, v, None)["WALK"]
    assert recurrent._resolve_config(q, v, {"BLOCK_E": 2})["WALK"] == rule  # both read it


# Prepended to the children below (run outside the interpreter): the launch a wrapper really
# makes, recorded instead of run, and compiled for sm_90 with its real arguments.
_RECORD_AND_COMPILE = """
        import torch
        import ttx_tutorial
        from ttx_tutorial.course import compiler
        from ttx_tutorial.kernels import recurrent


        def compile_recorded_launch(kernel, B, H, T, D, with_state, dtype=torch.bfloat16):
            launches = []
            kernel.run = lambda *args, grid, warmup, **kwargs: launches.append((args, kwargs))
            q, k, v = (torch.zeros(B, H, T, D, dtype=dtype) for _ in range(3))
            recurrent._run_validated(q, k, v, torch.zeros(B, H, D, D) if with_state else None)
            del kernel.run
            assert len(launches) == 1, len(launches)
            args, kwargs = launches[0]
            result = compiler.compile_launch(kernel, *args, target="sm_90", **kwargs)
            assert result.ok, result.summary()
            return result


        # The text of each scf.for loop of a TTGIR listing, from its first line to its end.
        def loop_bodies(ttgir):
            lines = ttgir.splitlines()
            bodies = []
            for start, line in enumerate(lines):
                if "scf.for" in line:
                    indent = len(line) - len(line.lstrip())
                    end = next(i for i in range(start + 1, len(lines))
                               if lines[i].strip().startswith("}") and len(lines[i]) - len(lines[i].lstrip()) == indent)
                    bodies.append("\\n".join(lines[start:end]))
            return bodies


        # ptxas' resource usage of the cubin (cuobjdump): STACK is the bytes of spilled registers.
        def print_resources(compiled):
            import os, re, subprocess, tempfile
            import triton
            cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True).stdout
            print("resources:", re.search(r"REG:\\d+ STACK:\\d+", usage).group(0))
"""


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_default_bf16_launch_pipelines_every_load(with_state):
    """The performance-critical shape of the compiled kernel (see the caveats of the module docstring).

    Compiled as the forward launch on aligned (B, H, T, 64) bf16 tensors is specialised, every
    load in the main token loop must be an asynchronous copy, no layout conversion may go
    through shared memory, and the state's layout must give each thread 8 contiguous D elements of COLS
    columns, so that one k and q load serves COLS columns and the sum over D needs only 3 warp
    shuffles per column."""
    result = run_python(_RECORD_AND_COMPILE + f"""
        import re

        cfg = recurrent.default_config(8, 16, 64, 64, torch.bfloat16, multiprocessors=132)
        compiled = compile_recorded_launch(recurrent.recurrent_tokens_kernel, 8, 16, 4096, 64, {with_state})
        # The main token loop: the one with the most reductions (UNROLL tokens per iteration).
        loop = max(loop_bodies(compiled.asm["ttgir"]), key=lambda body: body.count('"tt.reduce"'))
        layouts = dict(re.findall(r"^(#\\w+) = (#ttg\\.blocked<.*>)$", compiled.asm["ttgir"], re.M))
        # The sums over D (tensors whose first dimension is BLOCK_D = 64).
        reduced = re.findall(r'"tt\\.reduce".*?\\}}\\) : \\(tensor<64x\\w+, (#\\w+)>', loop, re.S)
        print("COLS:", cfg["COLS"])
        print("plain loads in the loop:", loop.count("tt.load "))
        print("asynchronous copies in the loop:", loop.count("async_copy_global_to_local"))
        tiles = recurrent._shared_memory_bytes(64, cfg, 2)
        print("shared memory beyond the pipelined tiles:", compiled.shared_bytes - tiles)
        print("reduced layouts:", sorted({{layouts[name] for name in reduced}}))
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout
    assert "plain loads in the loop: 0" in report, report
    assert "asynchronous copies in the loop: 0" not in report, report
    # No layout conversion through shared memory (each would cost a round trip and a barrier).
    assert "shared memory beyond the pipelined tiles: 0" in report, report
    assert "COLS: 2" in report, report  # two columns per thread share each k and q load
    expected_layout = ("reduced layouts: ['#ttg.blocked<{sizePerThread = [8, 1, 1], "
                       "threadsPerWarp = [8, 4, 1]")
    assert expected_layout in report, report


@pytest.mark.parametrize("heads", [(8, 16), (2, 16)], ids=["many_programs", "few_programs"])
def test_float32_d128_launch_sums_over_16_lanes(heads):
    """float32 at D = 128 (module docstring, caveats; ``default_config``): as launched on aligned
    (B, H, 4096, 128) tensors, the state is two tiles of 64 key rows, each thread holds 4
    contiguous rows of COLS columns and the sum over D crosses 16 lanes (one 128-row tile would
    cross all 32, with no lane left for the groups); every load of the token loop is an
    asynchronous copy, and nothing spills."""
    B, H = heads
    result = run_python(_RECORD_AND_COMPILE + f"""
        import re

        cfg = recurrent.default_config({B}, {H}, 128, 128, torch.float32, multiprocessors=132)
        compiled = compile_recorded_launch(recurrent.recurrent_tokens_kernel, {B}, {H}, 4096, 128, False,
                                           torch.float32)
        loop = max(loop_bodies(compiled.asm["ttgir"]), key=lambda body: body.count('"tt.reduce"'))
        layouts = dict(re.findall(r"^(#\\w+) = (#ttg\\.blocked<.*>)$", compiled.asm["ttgir"], re.M))
        reduced = re.findall(r'"tt\\.reduce".*?\\}}\\) : \\(tensor<64x\\w+, (#\\w+)>', loop, re.S)
        print("HALVES:", cfg["HALVES"], "GROUPS:", cfg["BLOCK_E"] // cfg["COLS"])
        print("plain loads in the loop:", loop.count("tt.load "))
        print("asynchronous copies in the loop:", loop.count("async_copy_global_to_local"))
        print("reduced layouts:", sorted({{layouts[name] for name in reduced}}))
        print_resources(compiled)
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout
    assert "HALVES: 2 GROUPS: 2" in report, report
    assert "plain loads in the loop: 0" in report, report
    assert "asynchronous copies in the loop: 0" not in report, report
    assert "reduced layouts: ['#ttg.blocked<{sizePerThread = [4, 1, 1], threadsPerWarp = [16, 2, 1]" in report, report
    assert "STACK:0" in report, report


def test_few_heads_block_walk_compiles_to_an_in_thread_scan():
    """The blocks walk's speed rests on its compiled shape (module docstring, caveats): as
    launched on aligned (1, 8, T, 64) bf16 tensors, every load of the block loop is an
    asynchronous copy, the cumsum runs along registers of one thread (a scan across lanes would
    cost shuffles at every step) and nothing spills."""
    result = run_python(_RECORD_AND_COMPILE + """
        import re

        cfg = recurrent.default_config(1, 8, 64, 64, torch.bfloat16, multiprocessors=132)
        assert cfg["WALK"] == "blocks", cfg
        compiled = compile_recorded_launch(recurrent.recurrent_blocks_kernel, 1, 8, 4096, 64, False)
        ttgir = compiled.asm["ttgir"]
        # The block loop (the other loop adds the initial state row by row).
        loop = next(body for body in loop_bodies(ttgir) if '"tt.scan"' in body)
        layouts = dict(re.findall(r"^(#\\w+) = (#ttg\\.blocked<.*>)$", ttgir, re.M))
        scanned = re.findall(r'"tt\\.scan".*?\\}\\) : \\(tensor<\\w+, (#\\w+)>', loop, re.S)
        print("plain loads in the loop:", loop.count("tt.load "))
        print("asynchronous copies in the loop:", loop.count("async_copy_global_to_local"))
        print("scan layouts:", sorted({layouts[name] for name in scanned}))
        print_resources(compiled)
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout
    assert "plain loads in the loop: 0" in report, report
    assert "asynchronous copies in the loop: 0" not in report, report
    # BLOCK_T (the scanned axis) has one lane: its elements are registers of each thread.
    assert "scan layouts: ['#ttg.blocked<{sizePerThread = [1, 1, 1], threadsPerWarp = [1, 8, 4]" in report, report
    assert "STACK:0" in report, report
