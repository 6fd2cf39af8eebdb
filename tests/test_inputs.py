"""Inputs nobody tried: each gives the float64 answer or a clear error, never a raw Triton or
CUDA error and never wrong numbers (plainly bad inputs: tests/test_validation.py).

* layouts: transposed, strided, sliced and expanded (stride-0) views of q, k, v and the initial
  state, with upstream gradients that are themselves expanded or transposed; forward and
  backward against float64 autograd, for every method;
* edge cases: an empty sequence keeps the autograd graph, an empty batch, other float dtypes
  of the initial state; on a GPU: tensors on a second GPU, more heads (B * H) than a CUDA grid
  axis holds, single heads of more than 2**31 elements;
* overflow: float16 sequences whose float32 state passes float16's largest value (65504) while
  every output still fits in float16: short ones under the interpreter, T = 65536 on a GPU.
"""

from __future__ import annotations

import math
import re
import textwrap

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS, cotangents, method_gradients, run_method
from ttx_tutorial import references, testing

DEVICE = ttx_tutorial.DEVICE
FLOAT16_MAX = torch.finfo(torch.float16).max


def least_precise(*dtypes):
    return max(dtypes, key=testing.tolerance)


# --------------------------------------------------------------------------- layouts

class Leaves:
    """Draws the base tensors a layout takes its views of, then replays them in float64.

    Called as ``make(role, *shape)``: q and k ~ N(0, 1/D), v ~ N(0, 1) in the test dtype, the
    state ("s") in float32, all leaves that require a gradient. ``float64_replay()`` gives a maker
    that hands back the same values, in the same order, as float64 CPU leaves, so the reference
    sees exactly the views the method saw.
    """

    def __init__(self, dtype, D, seed):
        self.dtype, self.D = dtype, D
        self.generator = torch.Generator().manual_seed(seed)
        self.made = []

    def __call__(self, role, *shape):
        scale = 1 / math.sqrt(self.D) if role in ("q", "k") else 1.0
        dtype = torch.float32 if role == "s" else self.dtype
        x = (torch.randn(*shape, generator=self.generator, dtype=torch.float64) * scale).to(DEVICE, dtype)
        self.made.append(x.requires_grad_())
        return x

    def float64_replay(self):
        copies = [x.detach().to("cpu", torch.float64).requires_grad_() for x in self.made]
        queue = list(copies)
        return (lambda role, *shape: queue.pop(0)), copies


# name -> (views of the leaves: (make, B, H, T, D, E) -> (q, k, v, initial_state), how the loss reads o)
# Upstream gradients: "weighted" (a random weighting, contiguous), "summed" (o.sum(): ones expanded
# with stride 0), "transposed" (through o.transpose(1, 2): a transposed gradient).
LAYOUTS = {
    "tokens_and_heads_transposed": (lambda m, B, H, T, D, E: (
        m("q", B, T, H, D).transpose(1, 2), m("k", B, T, H, D).transpose(1, 2),
        m("v", B, T, H, E).transpose(1, 2), None), "transposed"),
    "every_other_token": (lambda m, B, H, T, D, E: (
        m("q", B, H, 2 * T, D)[:, :, ::2], m("k", B, H, 2 * T, D)[:, :, 1::2],
        m("v", B, H, 2 * T, E)[:, :, ::2], m("s", B, H, D, E)), "weighted"),
    "slice_of_a_wider_last_dimension": (lambda m, B, H, T, D, E: (
        m("q", B, H, T, D + 5)[..., 3:D + 3], m("k", B, H, T, 2 * D)[..., D:],
        m("v", B, H, T, E + 1)[..., :E], m("s", B, H, D + 2, E + 3)[:, :, 1:D + 1, 2:E + 2]), "summed"),
    "last_dimension_strided": (lambda m, B, H, T, D, E: (
        m("q", B, H, T, 2 * D)[..., ::2], m("k", B, H, T, D, 3)[..., 1],
        m("v", B, H, T, 2 * E)[..., 1::2], m("s", B, H, D, 2 * E)[..., ::2]), "weighted"),
    "k_expanded_over_heads": (lambda m, B, H, T, D, E: (
        m("q", B, H, T, D), m("k", B, 1, T, D).expand(B, H, T, D), m("v", B, H, T, E), None), "summed"),
    "v_and_state_expanded_over_batch": (lambda m, B, H, T, D, E: (
        m("q", B, H, T, D), m("k", B, H, T, D), m("v", 1, H, T, E).expand(B, H, T, E),
        m("s", 1, 1, D, E).expand(B, H, D, E)), "transposed"),
    "q_expanded_over_tokens": (lambda m, B, H, T, D, E: (
        m("q", B, H, 1, D).expand(B, H, T, D), m("k", B, H, T, D), m("v", B, H, T, E), None), "weighted"),
    "state_transposed": (lambda m, B, H, T, D, E: (
        m("q", B, H, T, D), m("k", B, H, T, D), m("v", B, H, T, E),
        m("s", B, H, E, D).transpose(-1, -2)), "summed"),
}


def loss_of(o, state, upstream, w_o, w_state):
    """A float64 scalar reading o as ``upstream`` says; ``w_o`` is (B, T, H, E) contiguous."""
    if upstream == "weighted":
        loss_o = (o.double() * w_o.transpose(1, 2)).sum()
    elif upstream == "summed":
        loss_o = o.sum().double()
    else:
        loss_o = (o.transpose(1, 2).double() * w_o).sum()
    return loss_o + (state.double() * w_state).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ttx_tutorial.METHODS)
def test_views_give_the_float64_answer_and_gradients(method, layout, dtype):
    B, H, T, D, E = 2, 3, 37, 20, 12
    views, upstream = LAYOUTS[layout]
    make = Leaves(dtype, D, seed=len(layout))
    generator = torch.Generator().manual_seed(1)
    w_o = torch.randn(B, T, H, E, generator=generator, dtype=torch.float64).to(dtype).double()  # exact in dtype
    w_state = torch.randn(B, H, D, E, generator=generator, dtype=torch.float64).float().double()

    with testing.poisoned_allocations():
        o, state = run_method(method, *views(make, B, H, T, D, E))
        loss_of(o, state, upstream, w_o.to(DEVICE), w_state.to(DEVICE)).backward()

    replay, ref_leaves = make.float64_replay()
    ref_o, ref_state = references.quadratic(*views(replay, B, H, T, D, E))
    loss_of(ref_o, ref_state, upstream, w_o, w_state).backward()

    where = f"{method}, {layout}, upstream gradient {upstream}, {dtype}"
    testing.assert_close(o, ref_o, dtype, name=f"o ({where})")
    testing.assert_close(state, ref_state, dtype, name=f"final state ({where})")
    for leaf, ref_leaf in zip(make.made, ref_leaves):
        grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        testing.assert_close(grad, ref_leaf.grad, least_precise(dtype, leaf.dtype),
                             name=f"gradient of the {tuple(leaf.shape)} leaf ({where})")


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # three-pass and fused backwards
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_outputs_and_gradients_are_laid_out_as_their_inputs(method, dtype, packed):
    """q, k, v as (B, H, T, D) views of (B, T, H, D) buffers, as a layer's heads are: o comes back
    laid out as v and each gradient as its input, so that reshaping o back and handing a leaf its
    gradient copy nothing; the values still match float64."""
    B, T, H, D = (1, 45, 2, 16) if packed else (2, 37, 3, 16)
    cu_seqlens = torch.tensor([0, 20, 20, 45], device=DEVICE) if packed else None
    generator = torch.Generator().manual_seed(7)
    buffers = [(torch.randn(B, T, H, D, generator=generator) * scale).to(DEVICE, dtype)
               for scale in (D ** -0.5, D ** -0.5, 1.0)]
    q, k, v = (x.transpose(1, 2).requires_grad_() for x in buffers)
    grad_o = torch.randn(B, T, H, D, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    with testing.poisoned_allocations():
        o = ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens)
        grads = torch.autograd.grad(o, (q, k, v), grad_o)
    assert o.stride() == v.stride(), f"o: strides {o.stride()}, v's {v.stride()}"
    for name, grad, x in zip("qkv", grads, (q, k, v)):
        assert grad.stride() == x.stride(), f"d{name}: strides {grad.stride()}, {name}'s {x.stride()}"
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_o = ttx_tutorial.causal_product(*leaves, "cumsum", cu_seqlens=cu_seqlens)
    ref_grads = torch.autograd.grad(ref_o, leaves, grad_o.double())
    testing.assert_close(o, ref_o, dtype, f"{method} o")
    for name, grad, ref in zip("qkv", grads, ref_grads):
        testing.assert_close(grad, ref, dtype, f"{method} d{name}")


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_initial_state_of_another_float_dtype_is_used_in_float32(method, state_dtype):
    q, k, v, s0 = testing.random_inputs(1, 2, 21, 9, 7, seed=3, initial_state=True)
    s0 = s0.to(state_dtype)
    with testing.poisoned_allocations():
        o, state = run_method(method, q, k, v, s0)
    ref_o, ref_state = testing.reference(q, k, v, s0)
    assert state.dtype == torch.float32
    testing.assert_close(o, ref_o, torch.float32, name=f"o with a {state_dtype} initial state")
    testing.assert_close(state, ref_state, torch.float32, name=f"final state with a {state_dtype} initial state")


# --------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("method", ttx_tutorial.METHODS)
def test_empty_sequence_keeps_outputs_in_the_autograd_graph(method, with_state):
    """T = 0: o is empty and S_T = S_0. o is still a function of q, k, v and S_T of S_0, so both
    carry the graph and o.sum().backward() works as for any other length (empty gradients for
    q, k, v; the identity for S_0). Without S_0, S_T is the constant 0 and may be cut off."""
    drawn = testing.random_inputs(2, 3, 0, 5, 4, seed=0, initial_state=with_state, requires_grad=True)
    q, k, v, s0 = (*drawn, None) if len(drawn) == 3 else drawn
    o, state = run_method(method, q, k, v, s0)
    assert o.shape == (2, 3, 0, 4) and state.shape == (2, 3, 5, 4)
    assert o.requires_grad, f"{method} with T=0 returns an o cut off from the autograd graph"
    loss = o.sum()
    if s0 is not None:
        assert state.requires_grad, f"{method} with T=0 returns an S_T cut off from S_0"
        loss = loss + state.sum()
    loss.backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.grad is None or (x.grad.shape == x.shape and x.grad.numel() == 0), name
    if s0 is not None:
        assert torch.equal(s0.grad, torch.ones_like(s0)), "dS_T/dS_0 is the identity when T = 0"


@pytest.mark.parametrize("empty", ["B", "H"])
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_empty_batch_or_heads_returns_empty_or_names_the_dimension(method, empty):
    sizes = {"B": 2, "H": 3, empty: 0}
    q, k, v = testing.random_inputs(sizes["B"], sizes["H"], 9, 5, 4, seed=0)
    try:
        o, state = run_method(method, q, k, v)
    except ValueError as error:
        assert re.search(rf"\b{empty}\b", str(error)), f"the error does not name {empty}: {error}"
        return
    assert o.shape == (sizes["B"], sizes["H"], 9, 4) and state.shape == (sizes["B"], sizes["H"], 5, 4)


# --------------------------------------------------------------------------- overflow

def positive_float16_inputs(B, H, T, D, E, *, kv_range, q_high, seed):
    """Float16 q ~ U(0, q_high) and k, v ~ U(kv_range): every product adds to the state."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(low, high, *shape):
        x = low + (high - low) * torch.rand(*shape, generator=generator, dtype=torch.float64)
        return x.to(DEVICE, torch.float16)

    return (uniform(0, q_high, B, H, T, D), uniform(*kv_range, B, H, T, D), uniform(*kv_range, B, H, T, E))


def check_state_beyond_float16_range(method, q, k, v, initial_state=None):
    ref_o, ref_state = testing.reference(q, k, v, initial_state, device=DEVICE)
    # The problem is the one intended: a state float16 cannot hold, outputs it can.
    assert ref_state.abs().max() > 1.5 * FLOAT16_MAX, "the test's state does not pass float16's range"
    assert ref_o.abs().max() < 0.5 * FLOAT16_MAX, "the test's outputs do not fit in float16"
    with testing.poisoned_allocations():
        o, state = run_method(method, q, k, v, initial_state)
    assert torch.isfinite(o).all(), f"{method}: float16 outputs overflowed although every exact output fits"
    assert torch.isfinite(state).all(), f"{method}: the float32 state overflowed"
    testing.assert_close(o, ref_o, torch.float16, name=f"{method} o")
    testing.assert_close(state, ref_state, torch.float16, name=f"{method} final state")


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_float16_sequence_whose_state_passes_float16_range(method):
    """Cheap under the interpreter: 800 tokens with k, v in [8, 16) add about 144 per token to
    each state entry (about 1.15e5 at the end, above 65504); q in [0, 1/48) keeps every output
    near 16 * (1/96) * 1.15e5 = 1.9e4, inside float16."""
    q, k, v = positive_float16_inputs(1, 1, 800, 16, 16, kv_range=(8, 16), q_high=1 / 48, seed=0)
    check_state_beyond_float16_range(method, q, k, v)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_float16_initial_state_beyond_float16_range(method):
    """An initial state of about 1e5 per entry, which float16 cannot hold, and a short sequence;
    outputs near 16 * (1/96) * 1e5 = 1.7e4."""
    q, k, v = positive_float16_inputs(2, 2, 70, 16, 16, kv_range=(0, 1), q_high=1 / 48, seed=1)
    initial_state = torch.full((2, 2, 16, 16), 1e5, device=DEVICE) + torch.rand(
        2, 2, 16, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    check_state_beyond_float16_range(method, q, k, v, initial_state)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_float16_backward_whose_state_gradient_passes_float16_range(method):
    """The backward's reverse state R = dS_T + sum of q^T dO over the later tokens, here about
    1e5 per entry (dS_T), which float16 cannot hold, while every gradient fits: small k and v keep
    dk = R v and dv = R^T k near 16 * (1/96) * 1e5 = 1.7e4. Also the initial state's gradient,
    which is R at the start, where v needs no gradient (its own backward branch)."""
    q, k, v = positive_float16_inputs(1, 2, 70, 16, 16, kv_range=(0, 1 / 48), q_high=1 / 48, seed=4)
    s0 = torch.rand(1, 2, 16, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    grad_o = torch.randn(1, 2, 70, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    grad_state = torch.full((1, 2, 16, 16), 1e5, device=DEVICE) + torch.rand(
        1, 2, 16, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    _, _, expected = testing.reference_gradients(q, k, v, s0, grad_o, grad_state)
    assert expected["initial_state"].abs().max() > 1.5 * FLOAT16_MAX, "R does not pass float16's range"
    assert max(expected[name].abs().max() for name in "qkv") < 0.5 * FLOAT16_MAX, "a gradient does not fit"
    for needs_v in (True, False):
        leaves = {"q": q.clone().requires_grad_(), "k": k.clone().requires_grad_(),
                  "v": v.clone().requires_grad_(needs_v), "initial_state": s0.clone().requires_grad_()}
        with testing.poisoned_allocations():
            o, state = ttx_tutorial.causal_product(leaves["q"], leaves["k"], leaves["v"], method,
                                                   initial_state=leaves["initial_state"], return_state=True)
            torch.autograd.backward((o, state), (grad_o, grad_state))
        for name, leaf in leaves.items():
            if leaf.requires_grad:
                testing.assert_close(leaf.grad, expected[name], torch.float16, name=f"{method} d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_float16_65536_tokens_of_unit_features(method):
    """T = 65536 tokens with k, v in [1, 2): each state entry sums to about 2.25 * 65536 = 1.5e5;
    q in [0, 1/256) with D = 64 keeps outputs near 64 * (1/512) * 1.5e5 = 1.8e4."""
    q, k, v = positive_float16_inputs(2, 4, 65536, 64, 64, kv_range=(1, 2), q_high=1 / 256, seed=3)
    check_state_beyond_float16_range(method, q, k, v)


# --------------------------------------------------------------------------- GPU-only edge cases

@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_tensors_on_a_gpu_other_than_the_current_one(method):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    current = torch.cuda.current_device()
    other = torch.device("cuda", (current + 1) % torch.cuda.device_count())
    q, k, v, s0 = testing.random_inputs(2, 3, 300, 40, 24, device=other, seed=0, initial_state=True)
    grad_o, grad_state = cotangents(q, v, seed=1)
    with testing.poisoned_allocations():
        o, state, grads = method_gradients(method, q, k, v, s0, grad_o, grad_state)
    ref_o, ref_state, ref_grads = testing.reference_gradients(q, k, v, s0, grad_o, grad_state)
    assert torch.cuda.current_device() == current, "the call changed the current device"
    assert o.device == state.device == other
    testing.assert_close(o, ref_o, torch.float32, name=f"o on {other}")
    testing.assert_close(state, ref_state, torch.float32, name=f"final state on {other}")
    for name, grad in grads.items():
        assert grad.device == other, f"gradient of {name} on {grad.device}"
        testing.assert_close(grad, ref_grads[name], torch.float32, name=f"gradient of {name} on {other}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_initial_state_on_another_gpu_is_refused(method):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, s0 = testing.random_inputs(1, 2, 5, 4, 3, device="cuda:0", seed=0, initial_state=True)
    with pytest.raises(ValueError, match=r"initial_state.*cuda:0.*cuda:1|initial_state.*cuda:1"):
        ttx_tutorial.causal_product(q, k, v, method, initial_state=s0.to("cuda:1"))


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_more_heads_than_a_cuda_grid_axis_holds(method):
    """B * H = 77100 > 65535, the limit of a CUDA grid's second and third axes: a kernel that
    puts (batch, head) there fails to launch unless the wrapper folds it elsewhere."""
    q, k, v, s0 = testing.random_inputs(300, 257, 5, 8, 8, seed=0, initial_state=True)
    try:
        with testing.poisoned_allocations():
            o, state = run_method(method, q, k, v, s0)
    except ValueError as error:
        assert re.search(r"\bB\b.*\bH\b|\bH\b.*\bB\b", str(error)) and "65535" in str(error), error
        return
    ref_o, ref_state = testing.reference(q, k, v, s0, device=DEVICE)
    testing.assert_close(o, ref_o, torch.float32, name=f"{method} o with 77100 heads")
    testing.assert_close(state, ref_state, torch.float32, name=f"{method} final state with 77100 heads")


# One head of q, k, v spanning more than 2**31 elements: int32 offsets inside a head would wrap.
# Run in a child process, so that an illegal memory access cannot take the test session's CUDA
# context down with it. Only the first and last 40 tokens are non-zero, so a cheap reference
# on those 80 tokens gives every output.
_HUGE_HEAD_CHILD = textwrap.dedent(r"""
    import re, sys
    import torch
    import ttx_tutorial
    from ttx_tutorial import testing
    method = sys.argv[1]
    D = 256
    T = 2**31 // D + 37
    ends = torch.cat([torch.arange(40), torch.arange(T - 40, T)])
    x = torch.zeros(1, 1, T, D, dtype=torch.float16, device="cuda")
    x[:, :, ends] = (torch.randn(1, 1, 80, D, generator=torch.Generator().manual_seed(0)) / 16).half().cuda()
    try:
        o, state = ttx_tutorial.causal_product(x, x, x, method, return_state=True)
    except ValueError as error:
        assert re.search(r"\bT\b", str(error)) and re.search(r"2\*\*31|2\^31|2147483648", str(error)), error
        print("refused:", error)
        sys.exit(0)
    ref_o, ref_state = testing.reference(x[:, :, ends], x[:, :, ends], x[:, :, ends], device="cuda")
    testing.assert_close(o[:, :, ends], ref_o, torch.float16, name="o at the non-zero tokens")
    testing.assert_close(state, ref_state, torch.float16, name="final state")
    middle = o[:, :, 40:T - 40]
    assert torch.count_nonzero(middle) == 0, "outputs between the non-zero tokens must be 0"
    print("computed")
""")


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_one_head_of_more_than_2_31_elements_is_computed_or_refused(method):
    free_bytes, _ = torch.cuda.mem_get_info()
    if free_bytes < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory")
    child = testing.run_python(_HUGE_HEAD_CHILD, method, timeout=600)
    assert child.returncode == 0, (f"{method} on a head of 2**31+ elements:\n"
                                   f"{child.stdout[-2000:]}{child.stderr[-4000:]}")
