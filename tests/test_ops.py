"""The causal product as a torch.library operator: opcheck, torch.compile, autocast, CUDA graphs."""

import pytest
import torch

import ttx_tutorial
from ttx_tutorial import ops
from ttx_tutorial.references import quadratic
from ttx_tutorial.testing import assert_close, random_inputs, reference

TRITON_METHODS = ("recurrent", "chunked", "scan")


@pytest.mark.parametrize("method, with_initial_state", [
    *((m, True) for m in TRITON_METHODS + ("auto",)), ("chunked", False)])
def test_opcheck(method, with_initial_state):
    """Schema, fake (shape-only) implementation, autograd registration, and the traced graph."""
    T = 9 if method == "recurrent" else 19  # the interpreter walks recurrent token by token
    inputs = random_inputs(1, 2, T, 16, 8, initial_state=with_initial_state, requires_grad=True)
    q, k, v, s0 = inputs if with_initial_state else (*inputs, None)
    torch.library.opcheck(ops.causal_product_op, (q, k, v, s0, method))


def test_operator_matches_float64_with_gradients():
    q, k, v, s0 = random_inputs(2, 2, 23, 16, 8, initial_state=True, requires_grad=True)
    o, state = ops.causal_product_op(q, k, v, s0, "chunked")
    expected_o, expected_state = reference(q, k, v, s0)
    assert_close(o, expected_o, torch.float32, "o")
    assert_close(state, expected_state, torch.float32, "final state")
    grad_o, grad_state = torch.randn_like(o), torch.randn_like(state)
    torch.autograd.backward((o, state), (grad_o, grad_state))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    ref_o, ref_state = quadratic(*leaves)
    torch.autograd.backward((ref_o, ref_state), (grad_o.double(), grad_state.double()))
    for name, leaf, ref in zip(("q", "k", "v", "initial_state"), (q, k, v, s0), leaves):
        assert_close(leaf.grad, ref.grad, torch.float32, f"d{name}")


def test_empty_sequence_returns_a_fresh_state():
    q, k, v, s0 = random_inputs(1, 2, 0, 16, 8, initial_state=True)
    o, state = ops.causal_product_op(q, k, v, s0, "chunked")
    assert o.shape == (1, 2, 0, 8) and torch.equal(state, s0) and state.data_ptr() != s0.data_ptr()


def test_eager_calls_skip_the_operator(monkeypatch):
    """The dispatcher is for the compiler: eager calls go straight to the kernel wrapper."""
    def refuse(*args):
        raise AssertionError("eager causal_product went through the operator")

    monkeypatch.setattr(ops, "causal_product_op", refuse)
    q, k, v = random_inputs(1, 1, 8, 16, 8)
    ttx_tutorial.causal_product(q, k, v, method="chunked")


def model(q, k, v, s0, method):
    """A small graph around the product, so the compiler has operators to fuse on both sides."""
    o, state = ttx_tutorial.causal_product(torch.sigmoid(q), k * 2, v, method, initial_state=s0,
                                           return_state=True)
    # A sum of squares, not of signed entries: a sum that cancels to near zero would magnify the
    # compiler's different summation order into a large relative error of a correct result.
    return torch.tanh(o), state.square().sum()


def compare_compiled(method, backend):
    T = 9 if method == "recurrent" else 21
    q, k, v, s0 = random_inputs(1, 2, T, 16, 8, initial_state=True, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    outputs = compiled(q, k, v, s0, method)
    grad_o = torch.randn_like(outputs[0])
    compiled_grads = torch.autograd.grad(outputs, (q, k, v, s0), (grad_o, torch.ones(())))
    eager = model(q, k, v, s0, method)
    eager_grads = torch.autograd.grad(eager, (q, k, v, s0), (grad_o, torch.ones(())))
    for name, a, b in zip(("o", "state sum"), outputs, eager):
        assert_close(a, b, torch.float32, name)
    for name, a, b in zip(("dq", "dk", "dv", "ds0"), compiled_grads, eager_grads):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_compile_fullgraph_matches_eager(method):
    """aot_eager: the graph and its backward as torch.compile builds them, without code generation."""
    compare_compiled(method, "aot_eager")


def test_compile_fullgraph_inductor_matches_eager():
    """The default backend, which generates C++ on the CPU around the operator."""
    compare_compiled("auto", "inductor")


def test_compiled_layer_matches_eager():
    torch.manual_seed(0)
    layer = ttx_tutorial.CausalLinearAttention(32, 2, method="chunked").to(ttx_tutorial.DEVICE)
    x = torch.randn(2, 19, 32, device=ttx_tutorial.DEVICE, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    y_eager = layer(x)
    (dx_eager,) = torch.autograd.grad(y_eager.square().sum(), x)
    assert_close(y, y_eager, torch.float32, "y")
    assert_close(dx, dx_eager, torch.float32, "dx")


@pytest.mark.parametrize("method", ["chunked", "quadratic"])
def test_autocast_follows_pytorch_attention(method):
    q, k, v = random_inputs(1, 2, 17, 16, 8)
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        o = ttx_tutorial.causal_product(q, k, v, method)
        expected_dtype = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).dtype
    assert o.dtype == expected_dtype == torch.bfloat16
    assert_close(o, reference(q.bfloat16(), k.bfloat16(), v.bfloat16())[0], torch.bfloat16)


def test_autocast_leaves_float64_alone():
    q, k, v = random_inputs(1, 1, 9, 8, 4, dtype=torch.float64)
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        assert ttx_tutorial.causal_product(q, k, v, "quadratic").dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS + ("auto",))
def test_gpu_reduce_overhead_matches_eager(method):
    """CUDA graphs through torch.compile: forward and backward replayed, equal to eager."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, recording, then replays
        q, k, v, s0 = random_inputs(2, 4, 300, 64, 64, dtype=torch.bfloat16, initial_state=True,
                                    requires_grad=True)
        outputs = compiled(q, k, v, s0, method)
        grad_o = torch.randn_like(outputs[0])
        compiled_grads = torch.autograd.grad(outputs, (q, k, v, s0), (grad_o, torch.ones((), device="cuda")))
        eager = model(q, k, v, s0, method)
        eager_grads = torch.autograd.grad(eager, (q, k, v, s0), (grad_o, torch.ones((), device="cuda")))
        names = ("o", "state sum", "dq", "dk", "dv", "ds0")
        # At the inputs' tolerance: the compiled backward runs the forward kernel again (see
        # ttx_tutorial.ops) and may take another path to the same gradients, rounded differently.
        for name, a, b in zip(names, (*outputs, *compiled_grads), (*eager, *eager_grads)):
            assert_close(a, b, torch.bfloat16, name)
