"""The normaliser inside the recurrent kernels (NORMALIZE): method "recurrent" of
causal_linear_attention and ``recurrent.recurrent_normalized_attention``, against float64.

The reference is test_attention's, written independently of the ones column: the masked
weights A = tril(phi(Q) phi(K)^T), out = A V / (A 1 + eps), the state (S, z). Every output is
allocated poisoned (NaN), so an element a walk forgets to write fails the comparison. The
interpreter walks token by token, so sequences are short.
"""

import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial.kernels import recurrent
from ttx_tutorial.testing import (TOLERANCES, assert_close, poisoned_allocations, random_inputs, relative_error,
                                  run_python)
from test_recurrent import _RECORD_AND_COMPILE
from test_attention import (NORMALISED_BF16_DQ_TOLERANCE, attention64_by_chunks,
                            check_gradient_of_the_state_alone, check_gradients_of_values_far_from_zero,
                            check_kernel_normaliser_with_state, check_long_sequence_stays_finite,
                            check_normalised_entry, check_packed_normalised_entry, check_widest_values_normalise)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def phi(x):
    return F.elu(x) + 1


# 23 tokens: five iterations of the interpreter rule's 4 unrolled tokens and 3 left over.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", ["elu", "relu", "callable"])
def test_method_recurrent_matches_float64_with_states_and_gradients(feature, dtype):
    """causal_linear_attention(method="recurrent") normalises in its walks."""
    check_kernel_normaliser_with_state("recurrent", 23, 12, feature, dtype)


def test_method_recurrent_normalises_in_the_kernel(monkeypatch):
    """The route: one normalised walk of the kernel file, no ones column, no plain product."""
    seen = []
    launch = recurrent._launch

    def recording_launch(*args, **kwargs):
        seen.append((args[2].shape[-1], kwargs.get("denominator") is not None))
        return launch(*args, **kwargs)

    monkeypatch.setattr(recurrent, "_launch", recording_launch)
    q, k, v = random_inputs(1, 2, 9, 8, 5)
    ttx_tutorial.causal_linear_attention(q, k, v, method="recurrent")
    assert seen == [(5, True)]


#: (dtype, D, E, config): the walk and how many value blocks split E (the blocks walk normalising
#: holds every key row: BLOCK_D >= D).
WALKS = {
    "tokens, 3 value blocks": (torch.float32, 12, 10, {"WALK": "tokens", "BLOCK_E": 4, "COLS": 2, "UNROLL": 2}),
    "tokens, 1 column a program": (torch.bfloat16, 8, 2, {"WALK": "tokens", "BLOCK_E": 1, "UNROLL": 8}),
    # The backward's dq and dk walks split their keys (E = 20) over two blocks of 16.
    "blocks, 5 value blocks": (torch.float32, 12, 20, {"WALK": "blocks", "BLOCK_D": 16, "BLOCK_E": 4, "BLOCK_T": 8}),
    "blocks, rule's block sizes": (torch.float16, 20, 6, {"WALK": "blocks"}),
}


@pytest.mark.parametrize("with_state", [True, False], ids=["with a state", "from nothing"])
@pytest.mark.parametrize("walk", WALKS)
def test_walks_and_value_blocks_match_float64(walk, with_state):
    """The kernel file's entry on features: every value block's program computes its own
    denominator; out, state and the four gradients against float64."""
    dtype, D, E, config = WALKS[walk]
    check_normalised_entry(recurrent.recurrent_normalized_attention, dtype, 19, D, E, config, with_state, walk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients_of_values_far_from_zero(dtype):
    """Values of mean 3: r_t = -(g_t . out_t) then cancels most of dk's and dq's other terms, so
    a missing or misplaced term of the denominator shows at once (bfloat16's rounding of the
    output leaves too little of dq: see test_attention's test of the chunked kernel)."""
    check_gradients_of_values_far_from_zero(recurrent.recurrent_normalized_attention, dtype, 21, 8, 6, None, "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_of_the_state_alone(dtype):
    """Only the returned state is used: no output gradient reaches the backward."""
    check_gradient_of_the_state_alone("recurrent", dtype, 14, 8, 5)


@pytest.mark.parametrize("walk", ["tokens", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_sequences_match_each_sequence_alone(dtype, walk):
    """cu_seqlens (an empty sequence and one of one token among them): each sequence's output,
    final (S, z) and gradients equal float64 on that sequence alone, from its own initial state."""
    check_packed_normalised_entry(
        lambda q, k, v, s0, offsets: recurrent.recurrent_normalized_attention(q, k, v, s0, config={"WALK": walk},
                                                                           cu_seqlens=offsets),
        [6, 0, 1, 9], dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the plain product, on purpose
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_sequence_stays_finite(dtype):
    """Features of about 3 make phi(q).z pass float16's 65504 within 512 tokens of 16 features:
    the normalised walk keeps it in float32 and stays finite and accurate, gradients included."""
    check_long_sequence_stays_finite("recurrent", dtype, 512, 4, 1e-1)


def test_widest_values_normalise_with_gradients():
    """E = 256, where a ones column would not fit (E + 1 values): the walks carry the
    normaliser beside the state, forward and backward."""
    check_widest_values_normalise("recurrent")


def test_errors_are_named():
    q, k, v = random_inputs(1, 2, 5, 40, 8)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\), z as the last "
                                         r"column, = \(1, 2, 40, 9\), got \(1, 2, 40, 8\)"):
        recurrent.recurrent_normalized_attention(q, k, v, torch.zeros(1, 2, 40, 8, device=q.device))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(N, H, D, E \+ 1\) with cu_seqlens"):
        recurrent.recurrent_normalized_attention(q[:1], k[:1], v[:1], torch.zeros(2, 2, 40, 8, device=q.device),
                                                 cu_seqlens=torch.tensor([0, 2, 5], device=q.device))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        recurrent.recurrent_normalized_attention(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        recurrent.recurrent_normalized_attention(q, k, v, eps=None)
    with pytest.raises(ValueError, match=r"BLOCK_D \(32\) must cover D \(40\) when normalising"):
        recurrent.recurrent_normalized_attention(q, k, v, config={"WALK": "blocks", "BLOCK_D": 32})
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\)"):
        ttx_tutorial.causal_linear_attention(q, k, v, method="recurrent", initial_state=torch.zeros(2, 2, 40, 9, device=q.device))


# On the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("walk", ["tokens", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_65536_tokens_match_float64(dtype, walk):
    """One normalised walk over 65536 tokens, and its backward: finite, and out and the
    gradients of q, k and v against float64 (on the GPU, chunk by chunk)."""
    q, k, v = random_inputs(1, 2, 65536, 64, 64, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out, _ = recurrent.recurrent_normalized_attention(*(phi(x) for x in (q, k)), v, config={"WALK": walk})
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert torch.isfinite(out).all()
    for leaf in (q, k, v):
        assert torch.isfinite(leaf.grad).all()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = attention64_by_chunks(*leaves, phi, 1e-6)
    assert_close(out, expected, dtype, "output")
    for label, leaf, grad in zip("qkv", (q, k, v), torch.autograd.grad(expected, leaves, grad_out.double())):
        tolerance = NORMALISED_BF16_DQ_TOLERANCE if label == "q" else TOLERANCES[dtype]
        error = relative_error(leaf.grad, grad)
        assert error <= tolerance, f"d{label}: {error:.3e} > {tolerance:.0e}"


# Compiled for the GPU, on any machine -------------------------------------------------------

@pytest.mark.parametrize("walk, B, H", [("tokens", 8, 16), ("blocks", 1, 8)])
def test_default_bf16_normalised_launch_pipelines_its_loads_without_spills(walk, B, H):
    """The NORMALIZE forward as launched on aligned (B, H, 4096, 64) bf16 tensors with an
    initial state, compiled for sm_90 (the rule's walk for many and for few heads): every load
    of the main loop is an asynchronous copy, and nothing spills (ptxas' STACK)."""
    result = run_python(_RECORD_AND_COMPILE + f"""
        kernel = recurrent.recurrent_{walk}_kernel
        launches = []
        kernel.run = lambda *args, grid, warmup, **kwargs: launches.append((args, kwargs))
        q, k, v = (torch.zeros({B}, {H}, 4096, 64, dtype=torch.bfloat16) for _ in range(3))
        recurrent._run_normalized_validated(q, k, v, torch.zeros({B}, {H}, 64, 65), 1e-6)
        del kernel.run
        (args, kwargs), = launches
        assert kwargs["NORMALIZE"], kwargs
        compiled = compiler.compile_launch(kernel, *args, target="sm_90", **kwargs)
        assert compiled.ok, compiled.summary()
        # The main loop: the one with the most reductions.
        loop = max(loop_bodies(compiled.asm["ttgir"]), key=lambda body: body.count('"tt.reduce"'))
        print("plain loads in the loop:", loop.count("tt.load "))
        print("asynchronous copies in the loop:", loop.count("async_copy_global_to_local"))
        print_resources(compiled)
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout
    assert "plain loads in the loop: 0" in report, report
    assert "asynchronous copies in the loop: 0" not in report, report
    assert "STACK:0" in report, report
