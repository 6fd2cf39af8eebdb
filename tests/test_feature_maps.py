"""kernels/feature_map.py: phi(q) and phi(k) in one launch, their gradients in one more."""

import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial import testing
from ttx_tutorial.kernels import feature_map

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REFERENCE_MAPS = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu}


def layouts(B, H, T, D, dtype, device, generator):
    """(q, k) laid out as a layer makes them, (B, T, H, D) storage seen as (B, H, T, D), and as
    plain contiguous tensors; k never shares q's strides."""
    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).mul_(2).to(dtype).to(device)

    yield "contiguous", draw(B, H, T, D), draw(B, H, T, D).transpose(2, 3).contiguous().transpose(2, 3)
    yield "heads of a projection", draw(B, T, H, D).transpose(1, 2), draw(B, H, T, D)


@pytest.mark.parametrize("name", feature_map.FEATURE_MAPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 45, 17), (1, 2, 300, 64)])
def test_features_and_gradients_match_float64(name, dtype, shape, device):
    """Poisoned outputs, fresh inputs of either layout, several tiles along T (300 tokens of 64
    columns are five 64-token tiles, the last partial), D padded (17): the features, dq and dk
    against PyTorch's map in float64, and laid out as their inputs."""
    generator = torch.Generator().manual_seed(hash((name, str(dtype), shape)) % 2**31)
    for layout, q, k in layouts(*shape, dtype, device, generator):
        q.requires_grad_(True)
        k.requires_grad_(True)
        with testing.poisoned_allocations():
            phi_q, phi_k = feature_map.feature_maps(q, k, name)
            grad_q, grad_k = torch.randn_like(phi_q, dtype=torch.float32), torch.randn_like(phi_k, dtype=torch.float32)
            dq, dk = torch.autograd.grad((phi_q, phi_k), (q, k), (grad_q.to(dtype), grad_k.to(dtype)))
        leaves = [x.detach().double().requires_grad_(True) for x in (q, k)]
        expected = [REFERENCE_MAPS[name](x) for x in leaves]
        expected_grads = torch.autograd.grad(expected, leaves, (grad_q.to(dtype).double(), grad_k.to(dtype).double()))
        for label, got, want in (("phi(q)", phi_q, expected[0]), ("phi(k)", phi_k, expected[1]),
                                 ("dq", dq, expected_grads[0]), ("dk", dk, expected_grads[1])):
            testing.assert_close(got, want, dtype, f"{layout} {name} {label} (seed {generator.initial_seed()})")
        assert phi_q.stride() == q.stride() and phi_k.stride() == k.stride(), layout
        assert dq.stride() == q.stride() and dk.stride() == k.stride(), layout


@pytest.mark.parametrize("name", feature_map.FEATURE_MAPS)
def test_non_finite_inputs_give_what_pytorch_gives(name, device):
    """NaN and +-inf in q and k: the features and the gradients are non-finite exactly where
    PyTorch's map and its backward make them so, and equal elsewhere (float32)."""
    q = torch.tensor([[[[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -3.0, 2.0]]]],
                     device=device)
    k = q.flip(-1).contiguous()
    leaves = [x.clone().requires_grad_(True) for x in (q, k)]
    phi_q, phi_k = feature_map.feature_maps(*leaves, name)
    grads = [torch.full_like(q, 2.0), torch.full_like(k, -0.5)]
    dq, dk = torch.autograd.grad((phi_q, phi_k), leaves, grads)
    reference = [x.cpu().clone().requires_grad_(True) for x in (q, k)]
    expected = [REFERENCE_MAPS[name](x) for x in reference]
    expected_grads = torch.autograd.grad(expected, reference, [g.cpu() for g in grads])
    for got, want in zip((phi_q, phi_k, dq, dk), (*expected, *expected_grads)):
        torch.testing.assert_close(got.cpu(), want.detach(), equal_nan=True, rtol=1e-6, atol=0)


def test_only_the_inputs_that_need_it_get_a_gradient(device):
    q, k = (torch.randn(1, 2, 10, 8, device=device) for _ in range(2))
    q.requires_grad_(True)
    phi_q, phi_k = feature_map.feature_maps(q, k, "elu")
    (dq,) = torch.autograd.grad(phi_q.sum() + phi_k.sum(), (q,))
    torch.testing.assert_close(dq, torch.where(q > 0, 1.0, q.exp()))
    assert k.grad is None


def test_empty_inputs(device):
    q = torch.randn(2, 3, 0, 8, device=device, requires_grad=True)
    k = torch.randn(2, 3, 0, 8, device=device, requires_grad=True)
    phi_q, phi_k = feature_map.feature_maps(q, k, "relu")
    assert phi_q.shape == q.shape and phi_k.shape == k.shape
    dq, dk = torch.autograd.grad((phi_q.sum() + phi_k.sum()), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("loss", [lambda phi: phi.sum(), lambda phi: (phi**2).sum()], ids=["sum", "squares"])
def test_a_gradient_of_a_gradient_is_refused(loss, device):
    """create_graph=True is refused whether or not the incoming gradient needs a graph itself: with
    phi.sum() it does not, and a backward left untracked would drop phi'' from the second order."""
    q = torch.randn(1, 1, 4, 8, device=device, requires_grad=True)
    phi_q, _ = feature_map.feature_maps(q, q.detach(), "elu")
    with pytest.raises(RuntimeError, match=r"create_graph=True\) is not supported"):
        torch.autograd.grad(loss(phi_q), (q,), create_graph=True)


@pytest.mark.parametrize("change, error, words", [
    ({"feature_map": "identity"}, ValueError, "feature_map must be one of"),
    ({"feature_map": None}, ValueError, "feature_map must be one of"),
    ({"k": "k"}, TypeError, "k must be a torch.Tensor"),
    ({"q": torch.zeros(2, 10, 8)}, ValueError, r"q must have 4 dimensions \(B, H, T, D\)"),
    ({"k": torch.zeros(1, 2, 11, 8)}, ValueError, "q and k must have the same shape"),
    ({"k": torch.zeros(1, 2, 10, 8, dtype=torch.float16)}, TypeError, "same dtype"),
    ({"q": torch.zeros(1, 2, 10, 8, dtype=torch.float64), "k": torch.zeros(1, 2, 10, 8, dtype=torch.float64)},
     TypeError, "support dtypes float32, float16, bfloat16"),
    ({"q": torch.zeros(1, 2, 10, 257), "k": torch.zeros(1, 2, 10, 257)}, ValueError, r"1 <= D <= 256 .* got D=257"),
])
def test_bad_inputs_are_named(change, error, words, device):
    arguments = {"q": torch.zeros(1, 2, 10, 8), "k": torch.zeros(1, 2, 10, 8), "feature_map": "elu", **change}
    for name in ("q", "k"):
        if isinstance(arguments[name], torch.Tensor):
            arguments[name] = arguments[name].to(device)
    with pytest.raises(error, match=words):
        feature_map.feature_maps(arguments["q"], arguments["k"], arguments["feature_map"])


def test_inputs_on_the_wrong_device_are_named():
    wrong = "cpu" if ttx_tutorial.on_gpu() else "meta"
    q = torch.zeros(1, 2, 10, 8, device=wrong)
    with pytest.raises(ValueError, match="q and k must be on"):
        feature_map.feature_maps(q, q, "elu")


class LaunchCount:
    """Counts the feature-map forward launches while it is entered."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = feature_map._launch

        def counted(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(feature_map, "_launch", counted)


@pytest.mark.parametrize("method, normalize, feature, launches", [
    ("chunked", True, "elu", 1), ("auto", True, "relu", 1), ("recurrent", False, "elu", 1),
    ("scan", True, "relu", 1), ("chunked", False, "identity", 0), ("chunked", True, F.softplus, 0),
    ("quadratic", True, "elu", 0), ("cumsum", False, "relu", 0),
])
def test_attention_maps_named_features_in_the_kernel(method, normalize, feature, launches, monkeypatch, device):
    """causal_linear_attention maps "elu" and "relu" with the kernel for the Triton methods, and
    leaves the reference methods, "identity" and callables to PyTorch; the result is the same."""
    count = LaunchCount(monkeypatch)
    q, k, v = testing.random_inputs(1, 2, 37, 16, 8, device=device, seed=3)
    out = ttx_tutorial.causal_linear_attention(q, k, v, feature_map=feature, normalize=normalize, method=method)
    assert count.calls == launches
    phi = feature if callable(feature) else {**REFERENCE_MAPS, "identity": lambda x: x}[feature]
    pq, pk = phi(q.double().cpu()), phi(k.double().cpu())
    weights = (pq @ pk.transpose(-1, -2)).tril()
    expected = weights @ v.double().cpu()
    if normalize:
        expected = expected / (weights.sum(-1, keepdim=True) + 1e-6)
    testing.assert_close(out, expected, torch.float32, f"{method} {feature}")


def attention64(q, k, v, s0, phi, eps=1e-6):
    """float64 (out, state) of the normalised attention, state (S, z) continued from s0."""
    pq, pk = phi(q), phi(k)
    weights = (pq @ pk.transpose(-1, -2)).tril()
    numerator = weights @ v + pq @ s0[..., :-1]
    denominator = weights.sum(-1, keepdim=True) + pq @ s0[..., -1:]
    state = s0 + torch.cat([pk.transpose(-1, -2) @ v, pk.sum(2)[..., None]], dim=-1)
    return numerator / (denominator + eps), state


@pytest.mark.parametrize("name", feature_map.FEATURE_MAPS)
@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 16), (torch.float16, 64), (torch.bfloat16, 72),
                                      (torch.float32, 16)])
def test_chunked_backward_takes_the_maps_derivative(name, dtype, D, monkeypatch, device):
    """method="chunked" with a named map: the fused backward (16-bit, D <= 64) or the passes'
    terms walks (float32, wider heads) store the raw inputs' gradients themselves, and the map's
    own backward never runs. Out, state and every gradient (dS_0 included) against float64,
    outputs poisoned."""
    backward_launches = []
    original = feature_map._launch_backward
    monkeypatch.setattr(feature_map, "_launch_backward", lambda *a: backward_launches.append(1) or original(*a))
    q, k, v = testing.random_inputs(2, 2, 150, D, 24, dtype=dtype, device=device, seed=11, requires_grad=True)
    s0 = torch.rand(2, 2, D, 25, device=device).mul_(4).requires_grad_(True)
    with testing.poisoned_allocations():
        out, state = ttx_tutorial.causal_linear_attention(q, k, v, feature_map=name, method="chunked",
                                                          initial_state=s0, return_state=True)
        grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
        grads = torch.autograd.grad((out, state), (q, k, v, s0), (grad_out, grad_state))
    assert not backward_launches
    leaves = [x.detach().double().cpu().requires_grad_(True) for x in (q, k, v, s0)]
    expected = attention64(*leaves, REFERENCE_MAPS[name])
    expected_grads = torch.autograd.grad(expected, leaves, (grad_out.double().cpu(), grad_state.double().cpu()))
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}[dtype]  # dq's cancellation
    for label, got, want in (("out", out, expected[0]), ("state", state, expected[1]),
                             *zip(("dq", "dk", "dv", "dS_0"), grads, expected_grads)):
        error = testing.relative_error(got, want)
        assert error <= tolerance, f"{name} {dtype} D={D} {label}: {error:.2e}"


@pytest.mark.parametrize("name", feature_map.FEATURE_MAPS)
@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 16), (torch.float32, 16)])
def test_chunked_derivative_in_the_token_walks_matches_the_maps_backward(name, dtype, D, device):
    """An inf in one key and a NaN in one query send the chunked backward's programs to their
    token-by-token walks, which take the map's derivative too: the same non-finite places and
    the same finite values (to rounding) as the map's own backward after the kernels on features."""
    q, k, v = testing.random_inputs(1, 2, 100, D, 8, dtype=dtype, device=device, seed=12)
    k[0, 0, 40, 3] = float("inf")
    q[0, 1, 70, 5] = float("nan")
    grad_out = torch.randn(1, 2, 100, 8, dtype=dtype, device=device)
    results = []
    for fused_derivative in (True, False):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        if fused_derivative:
            out = ttx_tutorial.causal_linear_attention(*leaves, feature_map=name, method="chunked")
        else:
            phi_q, phi_k = feature_map.feature_maps(leaves[0], leaves[1], name)
            out = ttx_tutorial.causal_linear_attention(phi_q, phi_k, leaves[2], feature_map="identity",
                                                       method="chunked")
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for label, fused, separate in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(torch.isnan(fused), torch.isnan(separate)), f"{label}: NaN in other places"
        assert torch.equal(torch.isinf(fused), torch.isinf(separate)), f"{label}: inf in other places"
        finite = torch.isfinite(fused)
        assert finite.any(), label
        torch.testing.assert_close(fused[finite].float(), separate[finite].float(),
                                   rtol=testing.tolerance(dtype), atol=testing.tolerance(dtype))
