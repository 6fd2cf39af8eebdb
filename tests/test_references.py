"""The three PyTorch references, and the testing helpers every kernel test relies on.

The kernels are judged against ``ttx_tutorial.testing.reference`` (the quadratic form in
float64), so these tests first make sure that judge is right: the references agree with
each other and with the definition written out by hand, on awkward shapes, in every dtype,
with and without an initial state, and in their gradients.
"""

import math

import pytest
import torch

import ttx_tutorial
from ttx_tutorial import references
from ttx_tutorial._validation import REFERENCE_DTYPES
from ttx_tutorial.testing import (
    TOLERANCES,
    assert_close,
    poisoned_allocations,
    random_inputs,
    reference,
    relative_error,
)

REFERENCES = ("loop", "cumsum", "quadratic")

# (B, H, T, D, E), each awkward in its own way.
SHAPES = [
    pytest.param((1, 1, 1, 1, 1), id="one-token-scalar-heads"),
    pytest.param((2, 3, 1, 4, 4), id="T=1"),
    pytest.param((1, 2, 7, 5, 3), id="T=7-D>E"),
    pytest.param((2, 1, 33, 3, 8), id="T=33-D<E"),
    pytest.param((3, 2, 20, 16, 16), id="T=20-D=E"),
]


def expected_state_dtype(input_dtype):
    return torch.float64 if input_dtype == torch.float64 else torch.float32


def by_definition(q, k, v, initial_state):
    """o_t = S_0^T q_t + sum_{j <= t} (q_t . k_j) v_j, summed term by term in float64.

    Written from the attention view rather than from the recurrence, so that it shares no
    code and no formula with the references it checks.
    """
    q, k, v, s0 = (x.detach().double() for x in (q, k, v, initial_state))
    B, H, T, _ = q.shape
    o = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        o[:, :, t] = torch.einsum("bhd,bhde->bhe", q[:, :, t], s0)
        for j in range(t + 1):
            weight = (q[:, :, t] * k[:, :, j]).sum(-1, keepdim=True)
            o[:, :, t] += weight * v[:, :, j]
    return o


@pytest.mark.parametrize("method", REFERENCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float64_references_match_the_definition(method, shape):
    B, H, T, D, E = shape
    q, k, v, s0 = random_inputs(B, H, T, D, E, dtype=torch.float64, device="cpu", seed=T * D + E,
                                initial_state=True)
    o = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0)
    assert relative_error(o, by_definition(q, k, v, s0)) <= TOLERANCES[torch.float64]


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zeros", "initial-state"])
@pytest.mark.parametrize("dtype", REFERENCE_DTYPES, ids=str)
@pytest.mark.parametrize("method", REFERENCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_references_match_float64(method, shape, dtype, with_initial_state):
    B, H, T, D, E = shape
    q, k, v, s0 = random_inputs(B, H, T, D, E, dtype=dtype, device="cpu", seed=B + H + T + D * E,
                                initial_state=True)
    s0 = s0 if with_initial_state else None

    o, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)

    assert o.shape == (B, H, T, E) and o.dtype == dtype
    assert state.shape == (B, H, D, E) and state.dtype == expected_state_dtype(dtype)
    o_ref, state_ref = reference(q, k, v, s0)
    assert_close(o, o_ref, dtype, name=f"{method} output")
    # The state is accumulated and returned in float32 whatever the input dtype.
    assert_close(state, state_ref, expected_state_dtype(dtype), name=f"{method} final state")


@pytest.mark.parametrize("method", REFERENCES)
def test_references_accept_non_contiguous_inputs(method):
    # (B, T, H, D) tensors viewed as (B, H, T, D): the layout most models produce.
    q, k, v = (x.transpose(1, 2) for x in random_inputs(2, 9, 3, 4, seed=1, device="cpu"))
    assert not q.is_contiguous()
    o = ttx_tutorial.causal_product(q, k, v, method)
    assert_close(o, reference(q, k, v)[0], torch.float32)


def test_references_have_no_head_dim_limit():
    too_wide = ttx_tutorial.MAX_HEAD_DIM + 1  # beyond what the Triton kernels accept
    q, k, v = random_inputs(1, 1, 3, too_wide, 2, seed=2, device="cpu")
    for method in REFERENCES:
        o = ttx_tutorial.causal_product(q, k, v, method)
        assert_close(o, reference(q, k, v)[0], torch.float32, name=method)


# --- state semantics -------------------------------------------------------------------------

@pytest.mark.parametrize("method", REFERENCES)
def test_final_state_is_initial_state_plus_all_outer_products(method):
    q, k, v, s0 = random_inputs(2, 2, 11, 3, 5, dtype=torch.float64, device="cpu", seed=3,
                                initial_state=True)
    _, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
    # S_T = S_0 + sum_t k_t v_t^T = S_0 + K^T V
    assert_close(state, s0.double() + k.transpose(-1, -2) @ v, torch.float64)


@pytest.mark.parametrize("method", REFERENCES)
def test_default_initial_state_is_zeros(method):
    q, k, v = random_inputs(1, 2, 6, 4, 3, seed=4, device="cpu")
    zeros = torch.zeros(1, 2, 4, 3)
    o_default, state_default = ttx_tutorial.causal_product(q, k, v, method, return_state=True)
    o_zeros, state_zeros = ttx_tutorial.causal_product(q, k, v, method, initial_state=zeros,
                                                       return_state=True)
    torch.testing.assert_close(o_default, o_zeros, rtol=0, atol=0)
    torch.testing.assert_close(state_default, state_zeros, rtol=0, atol=0)


@pytest.mark.parametrize("method", REFERENCES)
def test_return_state_false_returns_only_the_output(method):
    q, k, v = random_inputs(1, 1, 4, 2, seed=5, device="cpu")
    o = ttx_tutorial.causal_product(q, k, v, method)
    assert isinstance(o, torch.Tensor) and o.shape == (1, 1, 4, 2)


@pytest.mark.parametrize("split", [1, 6, 12])
@pytest.mark.parametrize("method", REFERENCES)
def test_two_halves_chained_through_the_state_equal_the_whole(method, split):
    q, k, v, s0 = random_inputs(2, 3, 13, 4, 6, seed=6, device="cpu", initial_state=True)
    o_whole, state_whole = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0,
                                                       return_state=True)

    first, rest = slice(0, split), slice(split, None)
    o_first, state_first = ttx_tutorial.causal_product(
        q[:, :, first], k[:, :, first], v[:, :, first], method, initial_state=s0, return_state=True)
    o_rest, state_rest = ttx_tutorial.causal_product(
        q[:, :, rest], k[:, :, rest], v[:, :, rest], method, initial_state=state_first,
        return_state=True)

    assert_close(torch.cat([o_first, o_rest], dim=2), o_whole, torch.float32)
    assert_close(state_rest, state_whole, torch.float32)


@pytest.mark.parametrize("dtype", REFERENCE_DTYPES, ids=str)
@pytest.mark.parametrize("method", REFERENCES)
def test_empty_sequence_returns_the_initial_state(method, dtype):
    q, k, v, s0 = random_inputs(2, 3, 0, 4, 5, dtype=dtype, device="cpu", seed=7, initial_state=True)
    o, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
    assert o.shape == (2, 3, 0, 5) and o.dtype == dtype
    assert state.dtype == expected_state_dtype(dtype)
    torch.testing.assert_close(state, s0.to(state.dtype), rtol=0, atol=0)

    _, state_from_zeros = ttx_tutorial.causal_product(q, k, v, method, return_state=True)
    assert state_from_zeros.shape == (2, 3, 4, 5) and not state_from_zeros.any()


@pytest.mark.parametrize("method", REFERENCES)
def test_initial_state_is_not_modified(method):
    q, k, v, s0 = random_inputs(1, 2, 5, 3, seed=8, device="cpu", initial_state=True)
    before = s0.clone()
    ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
    torch.testing.assert_close(s0, before, rtol=0, atol=0)


@pytest.mark.parametrize("method", REFERENCES)
def test_low_precision_initial_state_is_used_in_float32(method):
    q, k, v, s0 = random_inputs(1, 1, 4, 3, seed=9, device="cpu", initial_state=True)
    s0_half = s0.half()
    o_half, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0_half,
                                                return_state=True)
    o_float = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0_half.float())
    assert state.dtype == torch.float32
    torch.testing.assert_close(o_half, o_float, rtol=0, atol=0)


# --- gradients -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", REFERENCES)
@pytest.mark.parametrize("shape", [(2, 1, 9, 3, 5), (1, 2, 1, 4, 4)], ids=["T=9-D<E", "T=1"])
def test_reference_gradients_match_float64(method, shape):
    B, H, T, D, E = shape
    inputs = random_inputs(B, H, T, D, E, seed=10, device="cpu", initial_state=True,
                           requires_grad=True)
    grad_o = torch.randn(B, H, T, E, dtype=torch.float64)
    grad_state = torch.randn(B, H, D, E, dtype=torch.float64)

    def gradients(fn, tensors):
        o, state = fn(*tensors)
        loss = (o.double() * grad_o).sum() + (state.double() * grad_state).sum()
        return torch.autograd.grad(loss, tensors)

    wide = [x.detach().double().requires_grad_() for x in inputs]
    expected = gradients(references.quadratic, wide)
    actual = gradients(
        lambda q, k, v, s0: ttx_tutorial.causal_product(q, k, v, method, initial_state=s0,
                                                        return_state=True),
        inputs)
    for name, got, want in zip(("q", "k", "v", "initial_state"), actual, expected):
        assert got.dtype == torch.float32
        assert_close(got, want, torch.float32, name=f"{method} d{name}")


# --- the testing helpers ---------------------------------------------------------------------

def test_float64_reference_is_float64_on_the_cpu_from_any_dtype():
    q, k, v, s0 = random_inputs(1, 2, 5, 3, dtype=torch.bfloat16, seed=11, device="cpu",
                                initial_state=True)
    o, state = reference(q, k, v, s0)
    assert o.dtype == state.dtype == torch.float64
    assert o.device.type == state.device.type == "cpu"
    wide = [x.double() for x in (q, k, v, s0)]
    torch.testing.assert_close(o, references.loop(*wide)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [7, 8, 9])
def test_chunked_reference_equals_the_one_shot_reference(T):
    q, k, v, s0 = random_inputs(2, 1, T, 3, 4, seed=T, device="cpu", initial_state=True)
    o_whole, state_whole = reference(q, k, v, s0)
    o_chunked, state_chunked = reference(q, k, v, s0, chunk=4)
    assert_close(o_chunked, o_whole, torch.float64)
    assert_close(state_chunked, state_whole, torch.float64)


def test_tolerances_cover_every_dtype_a_method_accepts():
    for name in ttx_tutorial.METHODS:
        assert set(ttx_tutorial.method_info(name).dtypes) <= set(TOLERANCES), name


def test_relative_error_is_the_norm_ratio():
    ref = torch.randn(3, 4, dtype=torch.float64)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref * 1.25, ref) == pytest.approx(0.25)
    # An all-zero reference falls back to the absolute error.
    out = torch.tensor([3.0, 4.0])
    assert relative_error(out, torch.zeros(2)) == pytest.approx(5.0)
    assert relative_error(torch.empty(0, 3), torch.empty(0, 3)) == 0.0


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf])
def test_relative_error_is_infinite_on_non_finite_output(bad_value):
    ref = torch.ones(2, 3)
    out = ref.clone()
    out[1, 2] = bad_value
    assert relative_error(out, ref) == math.inf
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(out, ref, torch.float32)


def test_relative_error_rejects_different_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))


def test_assert_close_uses_the_dtype_tolerance():
    ref = torch.ones(100, dtype=torch.float64)
    slightly_off = ref * (1 + TOLERANCES[torch.float16] / 2)
    assert_close(slightly_off, ref, torch.float16)
    with pytest.raises(AssertionError, match="float32"):
        assert_close(slightly_off, ref, torch.float32)


def test_poisoned_allocations_fill_floating_tensors_with_nan():
    template = torch.zeros(3, 2, dtype=torch.bfloat16)
    with poisoned_allocations():
        assert torch.empty(4, 5).isnan().all()
        assert torch.empty((2, 3), dtype=torch.float16).isnan().all()
        like = torch.empty_like(template)
        assert like.dtype == torch.bfloat16 and like.isnan().all()
        integers = torch.empty(3, dtype=torch.int32)  # NaN does not exist for integers
        assert integers.dtype == torch.int32


def test_poisoned_allocations_restore_torch_empty_even_after_an_error():
    original_empty, original_empty_like = torch.empty, torch.empty_like
    with pytest.raises(RuntimeError, match="inside the block"):
        with poisoned_allocations():
            assert torch.empty is not original_empty
            raise RuntimeError("inside the block")
    assert torch.empty is original_empty
    assert torch.empty_like is original_empty_like


@pytest.mark.parametrize("dtype", REFERENCE_DTYPES, ids=str)
def test_random_inputs_shapes_and_dtypes(dtype):
    q, k, v = random_inputs(2, 3, 5, 4, 7, dtype=dtype)
    assert q.shape == k.shape == (2, 3, 5, 4)
    assert v.shape == (2, 3, 5, 7)
    assert q.dtype == k.dtype == v.dtype == dtype
    assert q.device.type == k.device.type == v.device.type == ttx_tutorial.DEVICE.type
    assert not q.requires_grad

    *_, s0 = random_inputs(2, 3, 5, 4, dtype=dtype, initial_state=True)
    assert s0.shape == (2, 3, 4, 4) and s0.dtype == torch.float32  # E defaults to D


def test_random_inputs_device_seed_and_grad():
    first = random_inputs(1, 2, 3, 4, device="meta", seed=0, initial_state=True, requires_grad=True)
    assert all(x.device.type == "meta" and x.is_leaf and x.requires_grad for x in first)

    seed_0 = random_inputs(1, 2, 3, 4, device="cpu", seed=0)
    seed_0_again = random_inputs(1, 2, 3, 4, device="cpu", seed=0)
    seed_1 = random_inputs(1, 2, 3, 4, device="cpu", seed=1)
    for a, b in zip(seed_0, seed_0_again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(seed_0[0], seed_1[0])


def test_random_inputs_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    random_inputs(1, 1, 2, 2)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("method", ["loop", "cumsum", "quadratic"])
def test_empty_sequence_returns_a_new_state_tensor(method):
    q, k, v, s0 = random_inputs(1, 2, 0, 3, 4, initial_state=True)
    _, s = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
    s.add_(1)
    assert not torch.equal(s0, s)
