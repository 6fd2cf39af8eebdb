"""ttx_tutorial.course.compiler: asking the GPU compiler, without a GPU, what it makes of a kernel."""

import re

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from ttx_tutorial.course import compiler
from ttx_tutorial.testing import run_python

TARGETS = ["sm_80", "sm_90"]


@triton.jit
def _outer_product_broadcast_kernel(k_ptr, v_ptr, s_ptr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    # The small-block fix: S = k v^T by broadcasting, and S^T k by a sum; no tl.dot.
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    k = tl.load(k_ptr + offs_d)
    v = tl.load(v_ptr + offs_e)
    state = k[:, None] * v[None, :]
    tl.store(s_ptr + offs_d[:, None] * BLOCK_E + offs_e[None, :], state)
    tl.store(v_ptr + offs_e, tl.sum(k[:, None] * state, axis=0))


BROADCAST_SIGNATURE = {"k_ptr": "*fp32", "v_ptr": "*fp32", "s_ptr": "*fp32",
                       "BLOCK_D": "constexpr", "BLOCK_E": "constexpr"}
BROADCAST_CONSTEXPRS = {"BLOCK_D": 64, "BLOCK_E": 64}


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _helper_and_zeros_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # Calls a @triton.jit helper of this module and tl.zeros, itself written with @triton.jit:
    # under the interpreter both are InterpretedFunctions that the compiler must not see.
    x_ptr += tl.program_id(0) * n  # integer arithmetic, which a rebound triton.language miscompiles
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(x_ptr + offs, acc + _doubled(tl.load(x_ptr + offs, mask=mask)), mask=mask)


HELPER_SIGNATURE = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def test_accepted_shape_compiles_to_ptx():
    result = compiler.dot_shape_accepted(16, 16, 16, "bf16", target="sm_90")
    assert result.ok, result.summary()
    assert result.message is None
    assert ".entry _dot_probe_kernel" in result.ptx
    assert result.shared_bytes >= 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", compiler.DOT_DTYPES)
def test_inner_dimension_one_is_refused_with_the_compilers_message(dtype, target):
    result = compiler.dot_shape_accepted(16, 1, 16, dtype, target=target)
    assert not result.ok
    assert result.message.startswith("Input shapes should have M >= 1, N >= 1 and K >= "), result.message
    assert result.error_type == "CompilationError"
    assert "tl.dot" in result.full_message  # the source line the compiler points at
    assert result.ptx is None and result.shared_bytes is None


def test_torch_dtypes_are_accepted_like_their_names():
    assert compiler.dot_shape_accepted(16, 1, 16, torch.float16).message == \
        compiler.dot_shape_accepted(16, 1, 16, "fp16").message


def test_refused_result_has_no_ptx_facts():
    result = compiler.dot_shape_accepted(4, 4, 4, "fp16")
    for query in (result.fits_shared_memory, result.uses_tensor_cores, result.tensor_core_instructions):
        with pytest.raises(ValueError, match="was refused"):
            query()
    assert "refused" in result.summary()


@pytest.mark.parametrize("target", TARGETS)
def test_large_bf16_tile_uses_tensor_cores(target):
    result = compiler.dot_shape_accepted(64, 64, 64, "bf16", target=target)
    assert result.uses_tensor_cores(), result.summary()
    opcodes = result.tensor_core_instructions()
    assert all(opcode.startswith(compiler.target_facts(target).tensor_core_opcodes) for opcode in opcodes)
    if target == "sm_80":  # wgmma exists on Hopper only
        assert all(opcode.startswith("mma.sync") for opcode in opcodes)


def test_ieee_float32_product_avoids_tensor_cores():
    assert compiler.dot_shape_accepted(64, 64, 64, "fp32", input_precision="tf32").uses_tensor_cores()
    assert not compiler.dot_shape_accepted(64, 64, 64, "fp32", input_precision="ieee").uses_tensor_cores()


@pytest.mark.parametrize("target", TARGETS)
def test_broadcast_and_sum_kernel_compiles_without_tensor_cores(target):
    result = compiler.compile_for_target(_outer_product_broadcast_kernel, BROADCAST_SIGNATURE,
                                         BROADCAST_CONSTEXPRS, target=target)
    assert result.ok, result.summary()
    assert not result.uses_tensor_cores()
    assert result.tensor_core_instructions() == []


def test_kernel_with_helpers_compiles_before_and_after_it_runs(device, monkeypatch):
    # Running a kernel that calls @triton.jit functions in the interpreter leaves parts of
    # triton.language rebound (triton 3.9); compiling afterwards must still work. A cached
    # compilation would skip the front end, where that goes wrong, so the cache is bypassed.
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")

    def compile_it():
        return compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE, {"BLOCK": 16})

    assert compile_it().ok, compile_it().summary()
    x = torch.arange(10, dtype=torch.float32, device=device)
    _helper_and_zeros_kernel[(1,)](x, 10, BLOCK=16)
    assert torch.equal(x.cpu(), 2 * torch.arange(10, dtype=torch.float32))
    after = compile_it()
    assert after.ok, after.summary()


_IMPORTED_AFTER_A_KERNEL_RAN = """
import os
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached compilation would skip the front end
import sys
import ttx_tutorial  # first: it turns the interpreter on before triton.language is imported
import torch, triton, triton.language as tl

@triton.jit
def kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # tl.sum, tl.cdiv and tl.max are @triton.jit helpers of triton.language.standard: each call
    # leaves triton.language.core rebound (triton 3.9)
    tl.store(x_ptr + offs, x + tl.sum(x, axis=0) + tl.max(x, axis=0) + tl.cdiv(n, 2), mask=mask)

before = {name: dict(vars(module)) for name, module in list(sys.modules.items())
          if name == "triton.language" or name.startswith("triton.language.")}
x = torch.ones(10)
kernel[(1,)](x, 10, BLOCK=16)
assert x.tolist() == [17.0] * 10, x
assert "ttx_tutorial.course.compiler" not in sys.modules
from ttx_tutorial.course import compiler
rebuilt = {obj.__name__: names for obj, names in compiler._PRISTINE_LANGUAGE if obj.__name__ in before}
assert rebuilt.keys() == before.keys()
for module, names in before.items():
    wrong = [name for name, value in names.items() if rebuilt[module].get(name) is not value]
    assert not wrong, f"{module}: not put back as before the kernel ran: {wrong}"
result = compiler.compile_for_target(kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                     {"BLOCK": 16}, target="sm_90")
assert result.ok, result.summary()
print("compiled after the kernel ran")
"""


def test_the_probe_imported_after_a_kernel_ran_still_compiles():
    result = run_python(_IMPORTED_AFTER_A_KERNEL_RAN, timeout=300, TTX_TUTORIAL_DEVICE="cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled after the kernel ran" in result.stdout


def test_gpu_target_object_and_launch_options_are_reported():
    result = compiler.compile_for_target(_outer_product_broadcast_kernel, BROADCAST_SIGNATURE,
                                         BROADCAST_CONSTEXPRS, target=GPUTarget("cuda", 80, 32),
                                         num_warps=8, num_stages=2)
    assert (result.target, result.num_warps, result.num_stages) == ("sm_80", 8, 2)
    # 8 warps of 32 threads; the directive's name differs between Triton versions
    assert re.search(r"\.(reqntid|maxntid) 256\b", result.ptx)


def test_compile_launch_binds_the_real_arguments_as_a_gpu_launch_would():
    x = torch.zeros(64)
    result = compiler.compile_launch(_helper_and_zeros_kernel, x, 48, BLOCK=64, num_warps=2, num_stages=1,
                                     target="sm_80")
    assert result.ok and (result.num_warps, result.num_stages) == (2, 1), result.summary()
    # Triton's launcher turns an integer equal to 1 into a constant and marks multiples of 16.
    one, forty_eight, forty_seven, thirty_two = (
        compiler.bind_launch(_helper_and_zeros_kernel, x, n, BLOCK=64, target="sm_80") for n in (1, 48, 47, 32))
    assert one.specialised == ("n",) and one.constexprs == {"n": 1, "BLOCK": 64}
    assert forty_eight.aligned == ("x_ptr", "n") and forty_seven.aligned == ("x_ptr",)
    assert len({one.key, forty_eight.key, forty_seven.key}) == 3 and thirty_two.key == forty_eight.key


def test_shared_memory_limits_per_target():
    assert compiler.target_facts("sm_80").max_shared_bytes_per_block == 166912
    assert compiler.target_facts("sm_90").max_shared_bytes_per_block == 232448
    assert compiler.target_facts(GPUTarget("cuda", 90, 32)).name == "sm_90"


def test_fits_shared_memory_compares_with_the_targets_limit():
    result = compiler.dot_shape_accepted(64, 64, 64, "bf16", target="sm_80")
    assert 0 < result.shared_bytes and result.fits_shared_memory()
    limit = compiler.target_facts("sm_80").max_shared_bytes_per_block
    at_limit = compiler.CompileResult("k", "sm_80", ok=True, num_warps=4, num_stages=3, ptx="", shared_bytes=limit)
    over = compiler.CompileResult("k", "sm_80", ok=True, num_warps=4, num_stages=3, ptx="", shared_bytes=limit + 1)
    assert at_limit.fits_shared_memory() and not over.fits_shared_memory()


def test_tensor_core_lines_read_guarded_instructions_and_skip_bookkeeping():
    ptx = "\n".join([
        "\twgmma.fence.sync.aligned;",
        "\t@%p3 wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 1, 1, 1, 1;",
        "\twgmma.commit_group.sync.aligned;",
        "\tmma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 { %r1 }, { %r2 }, { %r3 }, { %r1 };",
        "\tfma.rn.f32 %r4, %r5, %r6, %r4;",
    ])
    assert len(compiler.tensor_core_lines(ptx)) == 2
    assert compiler.tensor_core_instructions(ptx) == [
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
    ]
    assert not compiler.uses_tensor_cores("\tfma.rn.f32 %r4, %r5, %r6, %r4;")


def _not_a_kernel(x_ptr):
    return x_ptr


@pytest.mark.parametrize("call, error, match", [
    (lambda: compiler.target_facts("sm_75"), ValueError, "unknown target 'sm_75'"),
    (lambda: compiler.target_facts(90), TypeError, "target must be"),
    (lambda: compiler.target_facts(GPUTarget("cuda", 70, 32)), ValueError, "no facts"),
    (lambda: compiler.dot_shape_accepted(16, 16, 16, target="hopper"), ValueError, "unknown target"),
    (lambda: compiler.dot_shape_accepted(3, 16, 16), ValueError, "M must be a positive power of two"),
    (lambda: compiler.dot_shape_accepted(16, 0, 16), ValueError, "K must be a positive power of two"),
    (lambda: compiler.dot_shape_accepted(16, 16.0, 16), TypeError, "K must be an int"),
    (lambda: compiler.dot_shape_accepted(16, 16, 16, "fp64"), ValueError, "dtype must be one of"),
    (lambda: compiler.dot_shape_accepted(16, 16, 16, torch.int8), ValueError, "dtype must be one of"),
    (lambda: compiler.dot_shape_table([(16, 16)]), ValueError, r"\(M, K, N\)"),
    (lambda: compiler.compile_for_target(_not_a_kernel, {"x_ptr": "*fp32"}), TypeError, "@triton.jit"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, {"x_ptr": "*fp32", "BLOCK": "constexpr"},
                                         {"BLOCK": 16}), ValueError, r"missing \['n'\]"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, {**HELPER_SIGNATURE, "n": "int"},
                                         {"BLOCK": 16}), ValueError, "unknown types"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, {**HELPER_SIGNATURE, "BLOCK": "i32"},
                                         {}), ValueError, "annotated tl.constexpr"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE), ValueError,
     r"need a value in constexprs: \['BLOCK'\]"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE, {"BLOCK": 16, "n": 3}),
     ValueError, "must be marked 'constexpr'"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, [("x_ptr", "*fp32")]), TypeError,
     "signature must be a dict"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE, {"BLOCK": 16},
                                         num_warps=3), ValueError, "power of two"),
    (lambda: compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE, {"BLOCK": 16},
                                         num_stages=0), ValueError, "num_stages must be at least 1"),
    (lambda: compiler.compile_launch(_helper_and_zeros_kernel, torch.zeros(4), 4), TypeError, "BLOCK"),
    (lambda: compiler.tensor_core_lines(b"mma.sync"), TypeError, "ptx must be a string"),
])
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compiling_leaves_triton_language_and_module_globals_as_found():
    mul, zeros, doubled = tl.core.mul, tl.zeros, _doubled
    compiler.dot_shape_accepted(16, 1, 16)
    compiler.compile_for_target(_helper_and_zeros_kernel, HELPER_SIGNATURE, {"BLOCK": 16})
    assert tl.core.mul is mul and tl.zeros is zeros and _doubled is doubled
