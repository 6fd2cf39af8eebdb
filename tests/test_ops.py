"""The causal product as a torch.library operator: opcheck, torch.compile, autocast, CUDA graphs."""

import pytest
import torch

import ttx_tutorial
from ttx_tutorial import ops
from ttx_tutorial.references import quadratic
from ttx_tutorial.testing import TOLERANCES, assert_close, poisoned_allocations, random_inputs, reference, relative_error

TRITON_METHODS = ("recurrent", "chunked", "scan")


@pytest.mark.parametrize("method, with_initial_state, dtype", [
    *((m, True, torch.float32) for m in TRITON_METHODS + ("auto",)), ("chunked", False, torch.float32),
    ("chunked", True, torch.bfloat16), ("scan", False, torch.float16)])
def test_opcheck(method, with_initial_state, dtype):
    """Schema, fake (shape-only) implementation, autograd registration, and the traced graph; in
    16 bits too, where the final state (float32) and the output (the input dtype) differ."""
    T = 9 if method == "recurrent" else 19  # the interpreter walks recurrent token by token
    inputs = random_inputs(1, 2, T, 16, 8, dtype=dtype, initial_state=with_initial_state, requires_grad=True)
    q, k, v, s0 = inputs if with_initial_state else (*inputs, None)
    torch.library.opcheck(ops.causal_product_op, (q, k, v, s0, method))


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_backward_opcheck_on_transposed_inputs(method):
    """The backward operator's gradients are laid out as its fake one says (each as its input),
    also for inputs that are views with other strides than contiguous tensors'."""
    q, k, v, s0 = random_inputs(1, 2, 9, 16, 8, initial_state=True)
    q, k = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k))  # D fastest no more
    v = v.transpose(0, 1).contiguous().transpose(0, 1)
    grad_o, grad_state = torch.randn_like(v), torch.randn_like(s0)
    torch.library.opcheck(ops._causal_product_backward_op, (q, k, v, s0, grad_o, grad_state, method))


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


# The normalised operator ----------------------------------------------------------------------

def features(B, H, T, D, E, dtype=torch.float32, initial_state=False):
    """Positive q, k (features, as the operator takes them), v, and (S_0, z_0) when asked, all
    leaves requiring a gradient."""
    q, k, v = random_inputs(B, H, T, D, E, dtype=dtype)
    q, k = (torch.nn.functional.elu(x.float()).add(1).to(dtype) for x in (q, k))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    if initial_state:  # the state after earlier tokens: z_0 positive, as the sum of features is
        s0 = torch.randn(B, H, D, E + 1, device=q.device)
        s0[..., -1] = s0[..., -1].abs() * 5
        leaves.append(s0.requires_grad_())
    return leaves


def normalized64(q, k, v, initial_state, eps):
    """(out, final_state, denominator) from float64 tensors: the masked weights, no ones column."""
    weights = (q @ k.transpose(-1, -2)).tril()
    numerator, denominator = weights @ v, weights.sum(-1)
    state = torch.cat([k.transpose(-1, -2) @ v, k.sum(2).unsqueeze(-1)], dim=-1)
    if initial_state is not None:
        numerator = numerator + q @ initial_state[..., :-1]
        denominator = denominator + (q @ initial_state[..., -1:]).squeeze(-1)
        state = state + initial_state
    return numerator / (denominator + eps).unsqueeze(-1), state, denominator + eps


@pytest.mark.parametrize("method, with_initial_state", [
    ("chunked", True), ("chunked", False), ("auto", True), ("scan", True)])
def test_normalized_opcheck(method, with_initial_state):
    """As test_opcheck, for the normalised operator: "scan" takes its ones-column path (on a
    GPU "auto" may choose it; in CPU mode "auto" is always chunked)."""
    leaves = features(1, 2, 19, 16, 8, initial_state=with_initial_state)
    q, k, v, s0 = leaves if with_initial_state else (*leaves, None)
    torch.library.opcheck(ops.normalized_causal_product_op, (q, k, v, s0, 1e-3, method))


def test_normalized_operator_refuses_a_reference_method():
    q, k, v = features(1, 1, 5, 8, 4)
    with pytest.raises(ValueError, match="method must be a Triton method or 'auto'.*'quadratic'"):
        ops.normalized_causal_product_op(q, k, v, None, 1e-6, "quadratic")


def test_normalized_backward_opcheck():
    q, k, v, s0 = features(1, 2, 19, 16, 8, initial_state=True)
    o, _, denominator = ops.normalized_causal_product_op(q, k, v, s0, 1e-3, "chunked")
    grad_o, grad_state = torch.randn_like(o), torch.randn_like(s0)
    # Detached: the backward operator is differentiable once, like the kernels' backward.
    arguments = [x.detach() for x in (q, k, v, s0, o, denominator, grad_o, grad_state)]
    torch.library.opcheck(ops._normalized_causal_product_backward_op, arguments)


@pytest.mark.parametrize("method, dtype", [("chunked", torch.float32), ("chunked", torch.bfloat16),
                                           ("scan", torch.float32), ("scan", torch.float16)])
def test_normalized_operator_matches_float64_with_gradients(method, dtype):
    """out, (S, z), the denominator and every gradient, outputs poisoned, against float64. The
    backward is the chunked kernel file's whichever method ran the forward."""
    q, k, v, s0 = features(2, 2, 23, 16, 8, dtype=dtype, initial_state=True)
    eps = 0.5  # large enough to count: a denominator that left it out would miss by percents
    with poisoned_allocations():
        o, state, denominator = ops.normalized_causal_product_op(q, k, v, s0, eps, method)
        grad_o, grad_state = torch.randn_like(o), torch.randn_like(state)
        torch.autograd.backward((o, state), (grad_o, grad_state))
    assert not denominator.requires_grad
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, s0)]
    expected_o, expected_state, expected_denominator = normalized64(*leaves, eps)
    assert o.dtype == dtype and state.dtype == denominator.dtype == torch.float32
    assert_close(o, expected_o, dtype, "o")
    assert_close(state, expected_state, torch.float32, "final (S, z)")
    assert_close(denominator, expected_denominator, dtype, "denominator")
    expected_grads = torch.autograd.grad((expected_o, expected_state), leaves,
                                         (grad_o.double().cpu(), grad_state.double().cpu()))
    for name, leaf, expected in zip(("q", "k", "v", "initial_state"), (q, k, v, s0), expected_grads):
        # bfloat16's dq is a difference of nearly equal terms (tests/test_attention.py).
        tolerance = 5e-2 if name == "q" and dtype == torch.bfloat16 else TOLERANCES[dtype]
        error = relative_error(leaf.grad, expected)
        assert error <= tolerance, f"d{name}: {error:.3e} > {tolerance:.0e}"


def test_normalized_operator_empty_sequence_returns_a_fresh_state():
    q, k, v, s0 = features(1, 2, 0, 16, 8, initial_state=True)
    o, state, denominator = ops.normalized_causal_product_op(q, k, v, s0, 1e-6, "chunked")
    assert o.shape == (1, 2, 0, 8) and denominator.shape == (1, 2, 0)
    assert torch.equal(state, s0) and state.data_ptr() != s0.data_ptr()


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


def capturing_backend(graphs):
    """torch.compile's aot_eager with the forward and backward graphs kept in ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(graph_module, example_inputs):
            graphs[name] = graph_module.graph
            return make_boxed_func(graph_module.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def calls(graph, operator):
    return [node for node in graph.nodes if node.op == "call_function" and node.target == operator]


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_compile_fullgraph_matches_eager(method):
    """aot_eager: the graph and its backward as torch.compile builds them, without code generation."""
    compare_compiled(method, "aot_eager")


def test_compile_fullgraph_inductor_matches_eager():
    """The default backend, which generates C++ on the CPU around the operator."""
    compare_compiled("auto", "inductor")


def test_compiled_backward_gets_no_gradient_for_an_unused_state():
    """return_state=False: the state is no output of the graph, so the compiled backward passes
    None for its gradient (no zeros written and read by the backward kernel)."""
    q, k, v = random_inputs(1, 2, 21, 16, 8, requires_grad=True)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ttx_tutorial.causal_product(q, k, v, "chunked").square().sum(),
                             fullgraph=True, backend=capturing_backend(graphs))
    torch.autograd.grad(compiled(q, k, v), (q, k, v))
    (backward_call,) = calls(graphs["backward"], torch.ops.ttx_tutorial.causal_product_backward.default)
    assert backward_call.args[5] is None  # grad_final_state
    assert not calls(graphs["backward"], torch.ops.aten.zeros.default)


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


# The generation step as an operator -----------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_opcheck(normalize, dtype):
    """The state declared as mutated, the fake output's shape and dtype, no autograd to register;
    D and E differ, so an output sized by the wrong one fails."""
    q, k = (torch.randn(2, 3, 8, dtype=dtype, device=ttx_tutorial.DEVICE) for _ in range(2))
    v = torch.randn(2, 3, 5, dtype=dtype, device=ttx_tutorial.DEVICE)
    state = torch.zeros(2, 3, 8, 5 + normalize, device=ttx_tutorial.DEVICE)
    torch.library.opcheck(ops.linear_attention_step_op, (q, k, v, state, "elu", normalize, 1e-6))


def decode(layer, prompt, tokens, step):
    """Prefill, then one ``step`` a token: the outputs and the state after each."""
    with torch.no_grad():
        _, state = layer(prompt, return_state=True)
        outputs = []
        for token in tokens:  # cloned: a CUDA graph's replay overwrites its output
            outputs.append(step(token, state).clone())
        return torch.stack(outputs), state


@pytest.mark.parametrize("feature_map", ["elu", torch.nn.functional.softplus], ids=["elu", "callable"])
def test_compiled_step_matches_eager_in_one_graph(feature_map):
    """A compiled decode step (fullgraph: a break would raise) updates the state as the eager one."""
    torch.manual_seed(3)
    layer = ttx_tutorial.CausalLinearAttention(32, 2, feature_map=feature_map).to(ttx_tutorial.DEVICE)
    prompt = torch.randn(2, 7, 32, device=ttx_tutorial.DEVICE)
    tokens = torch.randn(4, 2, 32, device=ttx_tutorial.DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(layer.step, fullgraph=True)
    eager_outputs, eager_state = decode(layer, prompt, tokens, layer.step)
    compiled_outputs, compiled_state = decode(layer, prompt, tokens, compiled)
    assert_close(compiled_outputs, eager_outputs, torch.float32, "outputs")
    assert_close(compiled_state, eager_state, torch.float32, "state")
    with torch.no_grad():
        graph = torch._dynamo.explain(layer.step)(tokens[0], eager_state.clone())
    assert graph.graph_count == 1 and graph.graph_break_count == 0


@pytest.mark.gpu
def test_gpu_reduce_overhead_step_replays_and_matches_eager():
    """The compiled step under mode="reduce-overhead", token after token, equal to eager, and
    captured in a CUDA graph: the state it mutates is marked static (cudagraph trees skip a graph
    that mutates any other input)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(4)
    layer = ttx_tutorial.CausalLinearAttention(1024, 16).to("cuda", torch.bfloat16)
    prompt = torch.randn(8, 33, 1024, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randn(6, 8, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer.step, fullgraph=True, mode="reduce-overhead")

    def static_step(token, state):
        torch._dynamo.mark_static_address(state)
        return compiled(token, state)

    eager_outputs, eager_state = decode(layer, prompt, tokens, layer.step)
    compiled_outputs, compiled_state = decode(layer, prompt, tokens, static_step)
    assert_close(compiled_outputs, eager_outputs, torch.bfloat16, "outputs")
    assert_close(compiled_state, eager_state, torch.float32, "state")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
