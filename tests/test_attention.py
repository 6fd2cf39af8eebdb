"""Normalised causal linear attention, the layer and token-by-token generation.

Every check compares against a float64 reference written independently of the ones-column
trick: the masked weights A = tril(phi(Q) phi(K)^T), out = A V / (A 1 + eps).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial.kernels import chunked, scan
from test_ops import calls, capturing_backend
from ttx_tutorial.testing import (TOLERANCES, assert_close, emulated_tensor_cores, poisoned_allocations,
                                  random_inputs, reference, relative_error)

TRITON_METHODS = ("recurrent", "chunked", "scan")
NORMALISED_BF16_DQ_TOLERANCE = 5e-2


def normalised_bf16_dq_tolerance(width):
    """bfloat16's tolerance for dq of the normalised attention with ``width`` features a key.

    dq's cancellation (see check_against_reference) grows with the width: on elu + 1 features of
    45 tokens (chunked, CPU mode, eps 1e-3) dq erred by 1.5e-2 at the median of 60 draws at
    D = 16, 2.2e-2 at 48, 3.3e-2 at 80 (300 draws: worst 5.8e-2, 2 % past 5e-2) and 4.0e-2 at 128,
    about as sqrt(D). The tolerance keeps D = 16's 5e-2 and grows as sqrt(D) beyond it."""
    return NORMALISED_BF16_DQ_TOLERANCE * max(1.0, math.sqrt(width / 16))
#: dq's cancellation (see check_against_reference) grows with the features' mean over their
#: spread: with features of 3 +- 0.25 bfloat16's dq errs by about 5 % in the chunked kernel (the
#: ones column, about 7 %).
LONG_BF16_DQ_TOLERANCE = 1e-1
#: The same check's float16 dq on a GPU, where float16's products are TF32 products of float32
#: copies: over 300 draws (T = 512, E = 4) scan's and chunked's dq erred by 6.7e-3 at the median
#: and 1.38e-2 at worst, 7 and 8 draws of 300 past float16's 1e-2; under the interpreter's exact
#: products about 4e-3, and with its tensor cores emulated (as the check runs in CPU mode)
#: 5.2e-3 to 1.1e-2 over 5 draws at T = 1024, E = 8.
LONG_FP16_DQ_TOLERANCE = 2e-2
ALL_METHODS = ttx_tutorial.METHODS + ("auto",)


def softplus(x):
    return F.softplus(x)


#: (feature map as passed, its float64 version for the reference, normalise?)
FEATURE_MAPS = {
    "elu": ("elu", lambda x: F.elu(x) + 1, True),
    "relu": ("relu", F.relu, True),
    "identity": ("identity", lambda x: x, False),  # signed: a normalised identity divides by ~0
    "callable": (softplus, F.softplus, True),
}


def float64(x):
    return x.detach().to("cpu", torch.float64)


def attention64(q, k, v, phi, normalize, eps, initial_state=None):
    """(out, state) from float64 tensors: the quadratic form of the weights, then the normaliser.
    The state is (S, z) as in causal_linear_attention: z is the last column when normalising."""
    pq, pk = phi(q), phi(k)
    weights = (pq @ pk.transpose(-1, -2)).tril()
    numerator, denominator = weights @ v, weights.sum(-1, keepdim=True)
    state = torch.cat([pk.transpose(-1, -2) @ v, pk.sum(2)[..., None]], dim=-1)
    if initial_state is not None:
        s0 = initial_state if normalize else torch.cat([initial_state, 0 * initial_state[..., :1]], -1)
        numerator = numerator + pq @ s0[..., :-1]
        denominator = denominator + pq @ s0[..., -1:]
        state = state + s0
    if not normalize:
        return numerator, state[..., :-1]
    return numerator / (denominator + eps), state


def reference_attention(q, k, v, phi, normalize, eps, initial_state=None):
    """float64 (out, state) on the CPU from tensors of any dtype and device."""
    s0 = None if initial_state is None else float64(initial_state)
    return attention64(float64(q), float64(k), float64(v), phi, normalize, eps, s0)


def reference_gradients(q, k, v, phi, normalize, eps, grad_out):
    leaves = [float64(x).requires_grad_() for x in (q, k, v)]
    out, _ = attention64(*leaves, phi, normalize, eps)
    return torch.autograd.grad(out, leaves, float64(grad_out))


def check_against_reference(method, feature, dtype, *, B=1, H=2, T=37, D=16, E=8, eps=1e-6):
    name, phi, normalize = FEATURE_MAPS[feature]
    q, k, v = random_inputs(B, H, T, D, E, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out = ttx_tutorial.causal_linear_attention(q, k, v, feature_map=name, normalize=normalize,
                                                   eps=eps, method=method)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert out.dtype == dtype and out.shape == (B, H, T, E)
    expected, _ = reference_attention(q, k, v, phi, normalize, eps)
    assert_close(out, expected, dtype, f"{method}/{feature} output")
    terms = gradient_terms_norms(q, k, v, phi, eps, grad_out) if normalize else None
    for label, leaf, grad in zip("qkv", (q, k, v), reference_gradients(q, k, v, phi, normalize, eps, grad_out)):
        if label == "q" and normalize and dtype == torch.bfloat16:
            # The output does not change when phi(q_t) is scaled, so dq is the difference of two
            # nearly equal terms, and bfloat16's rounding of the output and of its gradient is
            # amplified: PyTorch's own bfloat16 arithmetic of this formula errs by about 3e-2 too.
            error = relative_error(leaf.grad, grad)
            assert error <= NORMALISED_BF16_DQ_TOLERANCE, f"{method}/{feature} dq: {error:.3e}"
        elif label in "qk" and normalize:
            assert_close_to_terms(leaf.grad, grad, terms["qk".index(label)], dtype, f"{method}/{feature} d{label}")
        else:
            assert_close(leaf.grad, grad, dtype, f"{method}/{feature} d{label}")


@pytest.mark.parametrize("feature", FEATURE_MAPS)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_and_feature_map_matches_float64(method, feature):
    T = 21 if method == "recurrent" else 37  # the interpreter walks recurrent token by token
    check_against_reference(method, feature, torch.float32, T=T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_16_bit_inputs_match_float64(method, dtype):
    check_against_reference(method, "elu", dtype, T=21 if method == "recurrent" else 70)


def test_positive_identity_map_normalises():
    """The identity map with positive inputs: the denominator is the plain sum of the weights."""
    q, k, v = random_inputs(1, 2, 30, 8, 5)
    q, k = q.abs(), k.abs()
    out = ttx_tutorial.causal_linear_attention(q, k, v, feature_map="identity", method="chunked")
    expected, _ = reference_attention(q, k, v, lambda x: x, True, 1e-6)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("method", ["chunked", "scan", "quadratic"])
@pytest.mark.parametrize("normalize", [True, False])
def test_state_carries_the_normaliser(method, normalize):
    """Split a sequence anywhere: the returned state continues it exactly."""
    q, k, v = random_inputs(2, 2, 45, 16, 8)
    whole, state = ttx_tutorial.causal_linear_attention(q, k, v, normalize=normalize, method=method,
                                                        return_state=True)
    expected, expected_state = reference_attention(q, k, v, lambda x: F.elu(x) + 1, normalize, 1e-6)
    assert state.shape == (2, 2, 16, 9 if normalize else 8) and state.dtype == torch.float32
    assert_close(state, expected_state, torch.float32, "final state")
    first, middle = ttx_tutorial.causal_linear_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19],
                                                         normalize=normalize, method=method,
                                                         return_state=True)
    rest = ttx_tutorial.causal_linear_attention(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:],
                                                normalize=normalize, method=method, initial_state=middle)
    assert_close(torch.cat([first, rest], dim=2), expected, torch.float32, "continued output")
    assert_close(whole, expected, torch.float32, "whole output")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the plain product, on purpose
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_sequence_stays_finite(dtype):
    """Features of about 3 make phi(q).z pass float16's 65504 within 1024 tokens of 16 features:
    the plain product of the same features overflows, the normalised attention does not, and
    its gradients, whose dO / (d + eps) falls below float16's normal range, stay accurate."""
    check_long_sequence_stays_finite("chunked", dtype, 1024, 8, LONG_BF16_DQ_TOLERANCE)


def check_long_sequence_stays_finite(method, dtype, T, E, bf16_dq_tolerance):
    """causal_linear_attention(method=...) on T tokens of 16 features of about 3, whose
    denominator passes float16's range: the plain product of the same features overflows in
    float16, the normalised attention stays finite and matches float64, gradients included (dq
    within ``bf16_dq_tolerance`` in bfloat16, ``LONG_FP16_DQ_TOLERANCE`` in float16)."""
    q, k, v = random_inputs(1, 1, T, 16, E, dtype=torch.float64)
    q, k = (2 + q).to(dtype).requires_grad_(), (2 + k).to(dtype).requires_grad_()
    v = v.to(dtype).requires_grad_()
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    plain = ttx_tutorial.causal_product(phi(q.detach()), phi(k.detach()), torch.ones_like(v), method=method)
    if dtype == torch.float16:
        assert not torch.isfinite(plain).all(), "the check needs a denominator past float16's range"
    with emulated_tensor_cores():  # float16's products are TF32 products of float32 copies
        out = ttx_tutorial.causal_linear_attention(q, k, v, method=method)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert torch.isfinite(out).all()
    expected, _ = reference_attention(q, k, v, phi, True, 1e-6)
    assert_close(out, expected, dtype)
    for label, leaf, grad in zip("qkv", (q, k, v), reference_gradients(q, k, v, phi, True, 1e-6, grad_out)):
        tolerance = TOLERANCES[dtype]
        if label == "q":
            tolerance = bf16_dq_tolerance if dtype == torch.bfloat16 else LONG_FP16_DQ_TOLERANCE
        error = relative_error(leaf.grad, grad)
        assert error <= tolerance, f"d{label}: {error:.3e} > {tolerance:.0e}"


def test_autocast_takes_autocast_dtype():
    q, k, v = random_inputs(1, 2, 33, 16, 8)
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        out = ttx_tutorial.causal_linear_attention(q, k, v, method="chunked")
    assert out.dtype == torch.bfloat16
    expected, _ = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lambda x: F.elu(x) + 1,
                                      True, 1e-6)
    assert_close(out, expected, torch.bfloat16)


def test_eps_enters_the_denominator_only():
    """relu features of an all-negative query: phi(q) = 0, the output is 0 / (0 + eps) = 0."""
    q, k, v = random_inputs(1, 1, 12, 8, 4)
    q[:, :, 5] = -q[:, :, 5].abs() - 0.1
    out = ttx_tutorial.causal_linear_attention(q, k, v, feature_map="relu", eps=0.5, method="chunked")
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    expected, _ = reference_attention(q, k, v, F.relu, True, 0.5)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"feature_map": "gelu"}, ValueError, "feature_map must be one of"),
    ({"feature_map": 3}, ValueError, "feature_map must be one of"),
    ({"eps": -1.0}, ValueError, "eps must be finite and >= 0"),
    ({"eps": float("nan")}, ValueError, "eps must be finite"),
    ({"eps": "1e-6"}, TypeError, "eps must be a Python float"),
    ({"normalize": 1}, TypeError, "normalize must be a bool"),
    ({"initial_state": torch.zeros(1, 2, 16, 8)}, ValueError, r"\(B, H, D, E \+ 1\)"),
    ({"method": "fast"}, ValueError, "unknown method"),
])
def test_bad_arguments_are_named(kwargs, error, words):
    q, k, v = random_inputs(1, 2, 5, 16, 8)
    with pytest.raises(error, match=words):
        ttx_tutorial.causal_linear_attention(q, k, v, **kwargs)


def test_bad_tensors_are_named():
    q, k, v = random_inputs(1, 2, 5, 16, 8)
    with pytest.raises(ValueError, match="v must have 4 dimensions"):
        ttx_tutorial.causal_linear_attention(q, k, v[0])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ttx_tutorial.causal_linear_attention(q, k.tolist(), v)


@pytest.mark.parametrize("method", ["loop", "cumsum", "chunked", "auto"])
@pytest.mark.parametrize("change, error, words", [
    (lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta")), ValueError, "meta"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "supports dtypes"),
    (lambda q, k, v: (q, k.bfloat16(), v), TypeError, "same dtype"),
], ids=["meta", "int32", "mixed"])
def test_every_method_names_the_tensors_it_cannot_take(method, change, error, words):
    """Before the feature map or autocast looks at them (a reference's map used to fail inside
    elu on integers, autocast on meta tensors, and a reference converted mixed dtypes)."""
    q, k, v = change(*random_inputs(1, 2, 5, 8, 4))
    with pytest.raises(error, match=words):
        ttx_tutorial.causal_linear_attention(q, k, v, method=method)


@pytest.mark.parametrize("method", ["loop", "chunked"])
def test_return_state_and_a_shape_changing_map_are_refused(method):
    q, k, v = random_inputs(1, 2, 5, 8, 4)
    with pytest.raises(TypeError, match="return_state must be True or False"):
        ttx_tutorial.causal_linear_attention(q, k, v, method=method, return_state=1)
    with pytest.raises(ValueError, match="keep the shape"):
        ttx_tutorial.causal_linear_attention(q, k, v, method=method, feature_map=lambda x: x[..., :3])


# The normaliser inside the chunked kernel ----------------------------------------------------

def state_after_prefix(B, H, D, E, phi, length=50):
    """(S, z) after ``length`` earlier tokens of fresh random inputs, float32 leaf with a gradient."""
    q, k, v = random_inputs(B, H, length, D, E, dtype=torch.float64, device="cpu")
    _, state = attention64(q, k, v, phi, True, 0.0)
    return state.to(ttx_tutorial.DEVICE, torch.float32).requires_grad_()


def reference_with_state(inputs, initial_state, phi, eps, grad_out, grad_state, *, mapped=False):
    """float64 (out, state, gradients of q, k, v and the initial state) of <out, grad_out> +
    <state, grad_state>; ``mapped``: q and k are features already (phi is the identity)."""
    leaves = [float64(x).requires_grad_() for x in (*inputs, initial_state)]
    out, state = attention64(*leaves[:3], (lambda x: x) if mapped else phi, True, eps, leaves[3])
    return (out, state, *torch.autograd.grad((out, state), leaves, (float64(grad_out), float64(grad_state))))


def check_gradients(leaves, expected, dtype, what):
    for label, leaf, grad in zip(("q", "k", "v", "initial state"), leaves, expected):
        tolerance = TOLERANCES[dtype]
        if label == "q" and dtype == torch.bfloat16:
            tolerance = normalised_bf16_dq_tolerance(leaf.shape[-1])  # see check_against_reference
        error = relative_error(leaf.grad, grad)
        assert error <= tolerance, f"{what} d{label}: {error:.3e} > {tolerance:.0e}"


# 77 tokens: four chunks of 16 (float32) and one of 64 (16-bit inputs), each with a partial last chunk.
def check_kernel_normaliser_with_state(method, T, E, feature, dtype):
    """causal_linear_attention(method=...) normalising in its kernels: out, the (S, z) state it
    returns and the gradients of q, k, v and the initial state against float64, outputs
    poisoned beforehand (D = 16)."""
    name, phi, _ = FEATURE_MAPS[feature]
    q, k, v = random_inputs(1, 2, T, 16, E, dtype=dtype, requires_grad=True)
    s0 = state_after_prefix(1, 2, 16, E, phi)
    with poisoned_allocations():
        out, state = ttx_tutorial.causal_linear_attention(q, k, v, feature_map=name, method=method,
                                                          initial_state=s0, return_state=True)
        grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
        torch.autograd.backward((out, state), (grad_out, grad_state))
    assert out.dtype == dtype and state.shape == (1, 2, 16, E + 1) and state.dtype == torch.float32
    expected_out, expected_state, *expected_grads = reference_with_state((q, k, v), s0, phi, 1e-6, grad_out,
                                                                         grad_state)
    assert_close(out, expected_out, dtype, "output")
    # The feature map runs in the input dtype here, and in float64 in the reference.
    assert_close(state, expected_state, dtype, "final (S, z)")
    check_gradients((q, k, v, s0), expected_grads, dtype, f"{method} {feature} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("feature", ["elu", "relu", "callable"])
def test_kernel_normaliser_matches_float64_with_states_and_gradients(feature, dtype):
    """method="chunked" normalises in the kernel, on features PyTorch maps."""
    check_kernel_normaliser_with_state("chunked", 77, 24, feature, dtype)


#: (dtype, D, E, config): which backward runs and how many value blocks the forward splits E into.
KERNEL_PATHS = {
    "bf16 fused backward, 3 value blocks": (torch.bfloat16, 16, 40, {"BLOCK_E": 16}),
    "fp16 fused backward, 2 value blocks": (torch.float16, 32, 20, {"BLOCK_E": 16, "CHUNK": 16}),
    "bf16 passes (D > 64)": (torch.bfloat16, 80, 8, None),
    "fp16 passes (E > 64), in float32": (torch.float16, 8, 72, None),
    "fp32 passes, 2 value blocks": (torch.float32, 8, 20, None),
}


def check_normalised_entry(entry, dtype, T, D, E, config, with_state, what, feature="identity"):
    """A kernel file's normalised entry, ``entry(q, k, v, s0, eps=, config=)``, on elu + 1
    features of (1, 2, T, D, E) inputs, outputs poisoned: out, the (S, z) state and the gradients
    of q, k, v (and S_0 ``with_state``) against float64. With a named ``feature`` the entry
    takes the raw inputs and ``feature_map=feature``, and the gradients are those of the raw q, k."""
    phi = FEATURE_MAPS["elu" if feature == "identity" else feature][1]
    raw = random_inputs(1, 2, T, D, E, dtype=dtype)
    mapped = feature == "identity"
    q, k = ((phi(x) if mapped else x).detach().requires_grad_() for x in raw[:2])
    v = raw[2].requires_grad_()
    s0 = state_after_prefix(1, 2, D, E, phi) if with_state else None
    mapping = {} if mapped else {"feature_map": feature}
    with poisoned_allocations():
        out, state = entry(q, k, v, s0, eps=1e-3, config=config, **mapping)
        grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
        torch.autograd.backward((out, state), (grad_out, grad_state))
    s0_reference = torch.zeros_like(state) if s0 is None else s0
    expected_out, expected_state, *expected_grads = reference_with_state(
        (q, k, v), s0_reference, phi, 1e-3, grad_out, grad_state, mapped=mapped)
    assert_close(out, expected_out, dtype, f"{what} output")
    # Features mapped in the kernel are rounded to the input dtype, those of the reference are not.
    assert_close(state, expected_state, torch.float32 if mapped else dtype, f"{what} final (S, z)")
    check_gradients((q, k, v, s0), expected_grads[:3 if s0 is None else 4], dtype, what)


@pytest.mark.parametrize("entry", ["chunked", "scan"])
def test_passes_give_the_initial_state_its_gradient_when_k_needs_none(entry):
    """Heads over 64 take the backward in passes, where dz_0 (the z column of dS_0) comes from dk's
    terms walk: it must run for dS_0 even when k needs no gradient. q and S_0 against float64."""
    function = {"chunked": chunked.chunked_normalized_attention,
                "scan": lambda *a, **kw: scan.scan_normalized_attention(*a, config={"SEGMENT_LEN": 64}, **kw)}[entry]
    phi = FEATURE_MAPS["elu"][1]
    raw = random_inputs(1, 2, 150, 72, 8, dtype=torch.bfloat16)
    q = phi(raw[0]).detach().requires_grad_()
    k = phi(raw[1]).detach()
    v = raw[2].detach()
    s0 = state_after_prefix(1, 2, 72, 8, phi)
    with poisoned_allocations():
        out, state = function(q, k, v, s0, eps=1e-3)
        grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
        torch.autograd.backward((out, state), (grad_out, grad_state))
    _, _, expected_dq, _, _, expected_ds0 = reference_with_state((q, k, v), s0, phi, 1e-3, grad_out, grad_state,
                                                                  mapped=True)
    assert relative_error(q.grad, expected_dq) <= normalised_bf16_dq_tolerance(72)
    assert_close(s0.grad, expected_ds0, torch.bfloat16, "dS_0")


def check_packed_normalised_entry(entry, lengths, dtype, H=2, D=8, E=5):
    """``entry(q, k, v, s0, cu_seqlens)``, a kernel file's normalised entry, on elu + 1 features
    of sequences of ``lengths`` packed in one row, outputs poisoned: each sequence's output,
    final (S, z) and gradients equal float64 on that sequence alone, from its own initial state."""
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=ttx_tutorial.DEVICE)
    raw = random_inputs(1, H, sum(lengths), D, E, dtype=dtype)
    q, k = (phi(x).detach().requires_grad_() for x in raw[:2])
    v = raw[2].requires_grad_()
    s0 = torch.cat([state_after_prefix(1, H, D, E, phi).detach() for _ in lengths]).requires_grad_()
    with poisoned_allocations():
        out, state = entry(q, k, v, s0, offsets)
        grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
        torch.autograd.backward((out, state), (grad_out, grad_state))
    assert state.shape == (len(lengths), H, D, E + 1)
    for n, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        part = slice(start, stop)
        expected_out, expected_state, *expected_grads = reference_with_state(
            (q[:, :, part], k[:, :, part], v[:, :, part]), s0[n:n + 1], phi, 1e-6, grad_out[:, :, part],
            grad_state[n:n + 1], mapped=True)
        assert_close(out[:, :, part], expected_out, dtype, f"sequence {n} output")
        assert_close(state[n:n + 1], expected_state, torch.float32, f"sequence {n} final (S, z)")
        for label, leaf, grad in zip("qkv", (q, k, v), expected_grads):
            tolerance = NORMALISED_BF16_DQ_TOLERANCE if label == "q" and dtype == torch.bfloat16 else TOLERANCES[dtype]
            if stop > start:
                error = relative_error(leaf.grad[:, :, part], grad)
                assert error <= tolerance, f"sequence {n} d{label}: {error:.3e}"
        assert_close(s0.grad[n:n + 1], expected_grads[3], dtype, f"sequence {n} dS0")


def gradient_terms_norms(q, k, v, phi, eps, grad_out):
    """The sizes in float64 of the two terms whose sum is each of the normalised attention's
    dq and dk. With w_ts = phi(q_t) . phi(k_s), g_t = dO_t / d_t and r_t = -(g_t . out_t):
    dq_t = phi'(q_t) sum_{s<=t} (g_t . v_s + r_t) phi(k_s) and dk_s = phi'(k_s) sum_{t>=s}
    (g_t . v_s + r_t) phi(q_t), each split into its g . v part and its r part. The output does
    not change when phi(q_t) is scaled and moves with v_s only as far as v_s differs from out_t,
    so the parts cancel (most at large E, and with relu, whose features vanish): a float32 kernel
    errs by the rounding of the parts it adds, and dq and dk are measured against their size.
    Returns (for dq, for dk)."""
    q, k, v, grad_out = (float64(x).requires_grad_(i < 2) for i, x in enumerate((q, k, v, grad_out)))
    pq, pk = phi(q), phi(k)
    dphi_q, dphi_k = torch.autograd.grad(pq.sum() + pk.sum(), (q, k))
    pq, pk = pq.detach(), pk.detach()
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.float64).tril()                       # [t, s]: s <= t
    weights = (pq @ pk.transpose(-1, -2)) * causal
    denominator = weights.sum(-1, keepdim=True) + eps
    out = weights @ v / denominator
    g = grad_out / denominator
    r = -(g * out).sum(-1, keepdim=True)                                        # (B, H, T, 1)
    g_dot_v = (g @ v.transpose(-1, -2)) * causal                                # [t, s] = g_t . v_s
    r_part = r * causal
    q_terms = (g_dot_v @ pk).abs() + (r_part @ pk).abs()
    k_terms = (g_dot_v.transpose(-1, -2) @ pq).abs() + (r_part.transpose(-1, -2) @ pq).abs()
    return float((dphi_q * q_terms).norm()), float((dphi_k * k_terms).norm())


def assert_close_to_terms(gradient, expected, terms_norm, dtype, name):
    """``assert_close`` with ||gradient - expected|| taken over the size of the terms that make
    the gradient (``gradient_terms_norms``) instead of its own norm; inf where not finite."""
    error = relative_error(gradient, expected) * float(float64(expected).norm()) / terms_norm
    if not error <= TOLERANCES[dtype]:
        raise AssertionError(f"{name}: {error:.3e} of its terms' size exceeds {TOLERANCES[dtype]:.0e} for {dtype}")


def check_widest_values_normalise(method, T=6, D=4):
    """E = 256, where a ones column would not fit (E + 1 values): ``method``'s kernels carry the
    normaliser beside the state, forward and backward, against float64 (dq and dk against the
    size of their terms, ``gradient_terms_norms``)."""
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    q, k, v = random_inputs(1, 1, T, D, 256, requires_grad=True)
    with poisoned_allocations():
        out = ttx_tutorial.causal_linear_attention(q, k, v, method=method)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    expected, _ = reference_attention(q, k, v, phi, True, 1e-6)
    assert_close(out, expected, torch.float32)
    terms = gradient_terms_norms(q, k, v, phi, 1e-6, grad_out)
    for label, leaf, grad in zip("qkv", (q, k, v), reference_gradients(q, k, v, phi, True, 1e-6, grad_out)):
        if label in "qk":
            assert_close_to_terms(leaf.grad, grad, terms["qk".index(label)], torch.float32, f"d{label}")
        else:
            assert_close(leaf.grad, grad, torch.float32, f"d{label}")


def check_gradients_of_values_far_from_zero(entry, dtype, T, D, E, config, what):
    """``entry(q, k, v, config=)`` on elu + 1 features and values of mean 3 (the tests below say
    why): the gradients of k and v, and of q in float32, against float64."""
    q, k, v = random_inputs(1, 2, T, D, E, dtype=dtype)
    q, k = (F.elu(x) + 1 for x in (q, k))
    v = v + 3
    for x in (q, k, v):
        x.requires_grad_()
    with poisoned_allocations():
        out, _ = entry(q, k, v, config=config)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    expected = reference_gradients(q, k, v, lambda x: x, True, 1e-6, grad_out)
    for label, leaf, grad in zip("qkv", (q, k, v), expected):
        if label == "k" or label == "v":
            assert_close(leaf.grad, grad, dtype, f"{what}d{label}")
        elif dtype == torch.float32:
            # The cancellation magnifies float32's own rounding: PyTorch's float32 arithmetic of the
            # same formula errs by about 5e-6 on dq here (T = 45, D = 8, E = 20), and by up to 1e-5
            # on some draws. The bound is float32's tolerance or three times that error.
            error = relative_error(leaf.grad, grad)
            tolerance = max(TOLERANCES[torch.float32], 3 * float32_dq_error(q, k, v, grad_out))
            assert error <= tolerance, f"{what}dq: relative error {error:.3e}, tolerance {tolerance:.1e}"


def float32_dq_error(q, k, v, grad_out):
    """The relative error of dq computed by PyTorch in float32 (the quadratic form, identity
    features, eps 1e-6) against float64, on the same inputs."""
    leaves = [x.detach().to("cpu", torch.float32).requires_grad_() for x in (q, k, v)]
    out, _ = attention64(*leaves, lambda x: x, True, 1e-6)
    dq, = torch.autograd.grad(out, leaves[:1], grad_out.detach().to("cpu", torch.float32))
    return relative_error(dq, reference_gradients(q, k, v, lambda x: x, True, 1e-6, grad_out)[0])


def check_gradient_of_the_state_alone(method, dtype, T, D, E):
    """causal_linear_attention(method=...) where only the returned state is used: no output
    gradient reaches the backward; the gradients of k, v and S_0 against float64, none of q."""
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    q, k, v = random_inputs(1, 2, T, D, E, dtype=dtype, requires_grad=True)
    s0 = state_after_prefix(1, 2, D, E, phi)
    _, state = ttx_tutorial.causal_linear_attention(q, k, v, method=method, initial_state=s0,
                                                    return_state=True)
    grad_state = torch.randn_like(state)
    state.backward(grad_state)
    leaves = [float64(x).requires_grad_() for x in (q, k, v, s0)]
    _, expected_state = attention64(*leaves[:3], phi, True, 1e-6, leaves[3])
    expected = torch.autograd.grad(expected_state, leaves[1:], float64(grad_state))
    assert q.grad is None or not q.grad.any()  # the state does not depend on q
    for label, leaf, grad in zip(("k", "v", "initial state"), (k, v, s0), expected):
        assert_close(leaf.grad, grad, dtype, f"d{label}")


@pytest.mark.parametrize("with_state", [True, False], ids=["with a state", "from nothing"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_normaliser_value_blocks_and_backward_paths(path, with_state):
    """The kernel file's entry on features: every value block's program computes its own
    denominator, and both backward paths (the fused kernel, the passes on g) match float64.
    From nothing, the tokens of the sequence's own chunks carry the whole gradient."""
    dtype, D, E, config = KERNEL_PATHS[path]
    check_normalised_entry(chunked.chunked_normalized_attention, dtype, 45, D, E, config, with_state, path)


@pytest.mark.parametrize("path", [path for path, (dtype, *_) in KERNEL_PATHS.items() if dtype != torch.bfloat16])
def test_kernel_normaliser_gradients_of_values_far_from_zero(path):
    """Values of mean 3: out_t is near 3 too, so the denominator's gradient r_t = -(g_t . out_t)
    is as large as the numerator's terms and cancels most of them in dk and dq: a missing or
    misplaced term of the denominator shows at once. The cancellation also magnifies every
    rounding before it: r_t comes from the stored output, rounded to the input dtype, which
    leaves float16's dq about 1 % off; bfloat16's rounded state and scores leave its dk 1-2 %
    and dq 10 % off (the ones column: 3 % and 30 %), so it is left out here (the fused kernel
    is the same code for both 16-bit dtypes). test_kernel_normaliser_value_blocks_and_backward_paths
    checks every path and dtype on values of mean 0."""
    dtype, D, E, config = KERNEL_PATHS[path]
    check_gradients_of_values_far_from_zero(chunked.chunked_normalized_attention, dtype, 45, D, E, config, f"{path} ")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_normaliser_gradient_of_the_state_alone(dtype):
    """Only the returned state is used: no output gradient reaches the backward."""
    check_gradient_of_the_state_alone("chunked", dtype, 40, 16, 8)


def test_chunked_normalises_where_a_ones_column_would_not_fit():
    """E = 256: a ones column would make the values 257 wide, past every kernel's limit;
    "chunked" computes the normaliser in the kernel and takes it (so do "recurrent" and "scan",
    tested in their files)."""
    check_widest_values_normalise("chunked", T=20, D=16)


def test_kernel_normaliser_errors_are_named():
    q, k, v = random_inputs(1, 2, 5, 16, 8)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\), z as the last "
                                         r"column, = \(1, 2, 16, 9\), got \(1, 2, 16, 8\)"):
        chunked.chunked_normalized_attention(q, k, v, torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\)"):
        ttx_tutorial.causal_linear_attention(q, k, v, method="chunked", initial_state=torch.zeros(2, 2, 16, 9))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        chunked.chunked_normalized_attention(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite and >= 0, got inf"):
        chunked.chunked_normalized_attention(q, k, v, eps=float("inf"))
    with pytest.raises(TypeError, match="eps must be a Python float"):
        chunked.chunked_normalized_attention(q, k, v, eps=None)
    for method in ("chunked", "loop"):  # the references check the map as the kernels do
        with pytest.raises(ValueError, match=r"feature_map must keep the shape and dtype of q \(torch.float32"):
            ttx_tutorial.causal_linear_attention(q, k, v, method=method, feature_map=lambda x: x.double().exp())
    with pytest.raises(ValueError, match=r"feature_map must keep the shape and dtype of q .*got ndarray"):
        ttx_tutorial.causal_linear_attention(q, k, v, method="loop", feature_map=lambda x: x.cpu().numpy())


# The layer ---------------------------------------------------------------------------------

def make_layer(method, dim=32, heads=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return ttx_tutorial.CausalLinearAttention(dim, heads, method=method).to(ttx_tutorial.DEVICE, dtype)


def reference_layer(layer, x):
    """The layer's forward in float64 with the reference attention."""
    params = {name: p.detach().to("cpu", torch.float64) for name, p in layer.named_parameters()}
    x = x.detach().to("cpu", torch.float64)

    def project(name):
        y = x @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        return y.unflatten(-1, (layer.heads, layer.head_dim)).transpose(1, 2)

    o, _ = reference_attention(project("q_proj"), project("k_proj"), project("v_proj"),
                               lambda t: F.elu(t) + 1, True, layer.eps)
    return o.transpose(1, 2).flatten(2) @ params["out_proj.weight"].T + params["out_proj.bias"]


@pytest.mark.parametrize("method", ["chunked", "scan", "quadratic"])
def test_layer_matches_float64_and_trains(method):
    layer = make_layer(method)
    x = torch.randn(2, 29, 32, device=ttx_tutorial.DEVICE)
    y = layer(x)
    assert y.shape == x.shape
    assert_close(y, reference_layer(layer, x), torch.float32)
    y.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# The chunked kernel takes 16-token chunks in float32, 64 in 16-bit: prompts that fill whole
# chunks and prompts that end inside one.
@pytest.mark.parametrize("method, prompt", [("chunked", 16), ("chunked", 32), ("chunked", 13),
                                            ("chunked", 21), ("scan", 19), ("recurrent", 7)])
def test_generation_equals_the_whole_sequence(method, prompt):
    layer = make_layer(method)
    x = torch.randn(2, prompt + 9, 32, device=ttx_tutorial.DEVICE)
    with torch.no_grad():
        whole = layer(x)
        first, state = layer(x[:, :prompt], return_state=True)
        steps = [layer.step(x[:, t], state) for t in range(prompt, x.shape[1])]
    generated = torch.cat([first, torch.stack(steps, dim=1)], dim=1)
    assert_close(generated, whole, torch.float32, "generated")
    assert_close(generated, reference_layer(layer, x), torch.float32, "against float64")


def test_generation_from_nothing_in_bfloat16():
    layer = make_layer("chunked", dtype=torch.bfloat16)
    x = torch.randn(2, 40, 32, device=ttx_tutorial.DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        state = layer.initial_state(2)
        steps = torch.stack([layer.step(x[:, t], state) for t in range(40)], dim=1)
        whole = layer(x)
    assert steps.dtype == torch.bfloat16
    expected = reference_layer(layer, x)
    assert_close(steps, expected, torch.bfloat16, "steps")
    assert_close(whole, expected, torch.bfloat16, "whole")


def test_step_memory_does_not_grow():
    layer = make_layer("chunked")
    state = layer.initial_state(3)
    pointer, size = state.data_ptr(), state.numel()
    with torch.no_grad():
        for _ in range(5):
            layer.step(torch.randn(3, 32, device=ttx_tutorial.DEVICE), state)
    assert state.data_ptr() == pointer and state.numel() == size == 3 * 2 * 16 * 17


def test_layer_errors():
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by heads \(4\)"):
        ttx_tutorial.CausalLinearAttention(30, 4)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        ttx_tutorial.CausalLinearAttention(32, 0)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        ttx_tutorial.CausalLinearAttention(32, 2, feature_map="tanh")
    layer = make_layer("chunked")
    with pytest.raises(ValueError, match=r"x must have 3 dimensions \(batch, seq, dim\)"):
        layer(torch.randn(5, 32))
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        layer.step(torch.randn(2, 1, 32), layer.initial_state(2))
    with pytest.raises(ValueError, match=r"state must be float32 of shape \(2, 2, 16, 17\)"):
        layer.step(torch.randn(2, 32), torch.zeros(2, 2, 16, 16))
    for batch, error in ((2.0, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="batch must be"):
            layer.initial_state(batch)


# Under torch.compile -------------------------------------------------------------------------

NORMALIZED_OP = torch.ops.ttx_tutorial.normalized_causal_product.default
NORMALIZED_BACKWARD_OP = torch.ops.ttx_tutorial.normalized_causal_product_backward.default


def attention_model(q, k, v, s0, feature_map, method):
    """Operators on both sides of the attention, its state continued and returned."""
    out, state = ttx_tutorial.causal_linear_attention(2 * q, k, v, feature_map=feature_map, method=method,
                                                      initial_state=s0, return_state=True)
    return torch.tanh(out), state.square().sum()


def attention_model64(q, k, v, s0, phi, chunk=1024):
    """attention_model from float64 tensors on any device, (S, z) carried chunk by chunk (memory
    O(chunk^2) for long sequences), autograd following it."""
    state, outputs = s0, []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        out, state = attention64(2 * q[:, :, part], k[:, :, part], v[:, :, part], phi, True, 1e-6, state)
        outputs.append(out)
    return torch.tanh(torch.cat(outputs, dim=2)), state.square().sum()


@pytest.mark.parametrize("method, feature", [("chunked", "elu"), ("chunked", "relu"), ("chunked", "callable"),
                                             ("auto", "elu")])
def test_compiled_attention_is_one_fused_operator_and_matches(method, feature):
    """fullgraph=True (a graph break raises): outputs and the gradients of q, k, v and the initial
    state equal eager and float64; the graph holds the normalised operator once, and no ones
    column (no concatenation, no plain product)."""
    name, phi, _ = FEATURE_MAPS[feature]
    q, k, v = random_inputs(1, 2, 37, 16, 8, requires_grad=True)
    s0 = state_after_prefix(1, 2, 16, 8, phi)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(attention_model, fullgraph=True, backend=capturing_backend(graphs))
    with poisoned_allocations():
        outputs = compiled(q, k, v, s0, name, method)
    grad_out = torch.randn_like(outputs[0])
    leaves = (q, k, v, s0)
    compiled_grads = torch.autograd.grad(outputs, leaves, (grad_out, torch.ones(())))
    eager = attention_model(q, k, v, s0, name, method)
    eager_grads = torch.autograd.grad(eager, leaves, (grad_out, torch.ones(())))
    for label, a, b in zip(("out", "state", "dq", "dk", "dv", "ds0"), (*outputs, *compiled_grads),
                           (*eager, *eager_grads)):
        assert_close(a, b, torch.float32, f"compiled against eager: {label}")
    leaves64 = [float64(x).requires_grad_() for x in leaves]
    expected = attention_model64(*leaves64, phi)
    expected_grads = torch.autograd.grad(expected, leaves64, (float64(grad_out), torch.ones((), dtype=torch.float64)))
    for label, a, b in zip(("out", "state", "dq", "dk", "dv", "ds0"), (*outputs, *compiled_grads),
                           (*expected, *expected_grads)):
        assert_close(a, b, torch.float32, f"compiled against float64: {label}")
    assert len(calls(graphs["forward"], NORMALIZED_OP)) == 1
    assert len(calls(graphs["backward"], NORMALIZED_BACKWARD_OP)) == 1
    for operator in (torch.ops.aten.cat.default, torch.ops.ttx_tutorial.causal_product.default):
        assert not calls(graphs["forward"], operator), operator


@pytest.mark.parametrize("backend", ["capturing aot_eager", "inductor"])
def test_compiled_layer_matches_eager_and_float64(backend):
    """The layer under torch.compile(fullgraph=True): output against eager and float64, the
    gradients of x and every parameter against eager. Its state is not an output, so nothing
    fills a gradient for it: the backward operator receives None (no zeros to write and read)."""
    layer = make_layer("auto")
    x = torch.randn(2, 29, 32, device=ttx_tutorial.DEVICE, requires_grad=True)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True,
                             backend=capturing_backend(graphs) if backend.startswith("capturing") else backend)
    y = compiled(x)
    grad_y = torch.randn_like(y)
    leaves = (x, *layer.parameters())
    compiled_grads = torch.autograd.grad(y, leaves, grad_y)
    y_eager = layer(x)
    eager_grads = torch.autograd.grad(y_eager, leaves, grad_y)
    assert_close(y, y_eager, torch.float32, "y against eager")
    assert_close(y, reference_layer(layer, x), torch.float32, "y against float64")
    for (name, _), a, b in zip([("x", x), *layer.named_parameters()], compiled_grads, eager_grads):
        assert_close(a, b, torch.float32, f"d{name}")
    if graphs:
        (backward_call,) = calls(graphs["backward"], NORMALIZED_BACKWARD_OP)
        assert backward_call.args[7] is None  # grad_final_state
        assert not calls(graphs["backward"], torch.ops.aten.zeros.default)


def test_compiled_attention_under_autocast_takes_autocast_dtype():
    """float32 inputs under bfloat16 autocast: bfloat16 out, as in eager mode, through the operator."""
    q, k, v = random_inputs(1, 2, 33, 16, 8)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ttx_tutorial.causal_linear_attention(q, k, v, method="chunked"),
                             fullgraph=True, backend=capturing_backend(graphs))
    with torch.autocast(q.device.type, dtype=torch.bfloat16):
        out = compiled(q, k, v)
        eager = ttx_tutorial.causal_linear_attention(q, k, v, method="chunked")
    assert out.dtype == eager.dtype == torch.bfloat16
    assert len(calls(graphs["forward"], NORMALIZED_OP)) == 1
    assert_close(out, eager, torch.bfloat16, "against eager")
    expected, _ = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lambda x: F.elu(x) + 1,
                                      True, 1e-6)
    assert_close(out, expected, torch.bfloat16, "against float64")


# On the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", TRITON_METHODS + ("auto",))
def test_gpu_65536_tokens_stay_finite(method, dtype):
    q, k, v = random_inputs(1, 4, 65536, 64, 64, dtype=dtype, requires_grad=True)
    out = ttx_tutorial.causal_linear_attention(q, k, v, method=method)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all()
    for leaf in (q, k, v):
        assert torch.isfinite(leaf.grad).all()
    # The quadratic reference would need T x T weights: the float64 product chunk by chunk
    # (testing.reference) of the features with a ones column, on the first head.
    phi_q, phi_k = (F.elu(x[:, :1].detach().double()) + 1 for x in (q, k))
    values = v[:, :1].detach().double()
    product, _ = reference(phi_q, phi_k, torch.cat([values, torch.ones_like(values[..., :1])], dim=-1))
    expected = product[..., :-1] / (product[..., -1:] + 1e-6)
    assert_close(out[:, :1], expected, dtype)


def attention64_by_chunks(q, k, v, phi, eps, chunk=1024):
    """attention64's output for long float64 sequences on any device: chunk by chunk with
    (S, z) carried, so memory is O(chunk^2) and autograd can follow it."""
    state = q.new_zeros((*q.shape[:2], q.shape[-1], v.shape[-1] + 1))
    outputs = []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        out, state = attention64(q[:, :, part], k[:, :, part], v[:, :, part], phi, True, eps, state)
        outputs.append(out)
    return torch.cat(outputs, dim=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernel_normaliser_gradients_at_65536_tokens(dtype):
    """The chunked kernel's normaliser over 65536 tokens, one launch forward and one backward:
    out and the gradients of q, k and v against float64 (on the GPU, chunk by chunk)."""
    q, k, v = random_inputs(1, 2, 65536, 64, 64, dtype=dtype, requires_grad=True)
    out = ttx_tutorial.causal_linear_attention(q, k, v, method="chunked")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = attention64_by_chunks(*leaves, lambda x: F.elu(x) + 1, 1e-6)
    assert_close(out, expected, dtype, "output")
    for label, leaf, grad in zip("qkv", (q, k, v), torch.autograd.grad(expected, leaves, grad_out.double())):
        # dq's cancellation (check_against_reference) magnifies the rounding of the float32 state:
        # to bfloat16, and for float16 to TF32 (products of float32 operands on a GPU). In CPU mode,
        # which multiplies in full float32, bfloat16's dq errs by 2.8e-2 at this size.
        tolerance = NORMALISED_BF16_DQ_TOLERANCE if label == "q" else TOLERANCES[dtype]
        error = relative_error(leaf.grad, grad)
        assert error <= tolerance, f"d{label}: {error:.3e} > {tolerance:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("method, shape", [("chunked", (2, 4, 300)), ("auto", (2, 4, 300)),
                                           ("auto", (1, 2, 8192))], ids=["chunked", "auto", "auto chooses scan"])
def test_gpu_compiled_attention_reduce_overhead_matches_eager(method, shape):
    """CUDA graphs through torch.compile(mode="reduce-overhead") of the normalised attention
    (its operator), the graph without a break: forward and backward replayed, the output equal
    to eager, outputs and gradients against float64. Two heads of 8192 tokens leave the GPU
    idle, and "auto" chooses scan (the operator's ones column, the chunked backward)."""
    B, H, T = shape
    if method == "auto":
        probe = torch.empty(B, H, T, 64, device="cuda", dtype=torch.bfloat16)
        assert ttx_tutorial.choose_method(probe, probe) == ("scan" if T == 8192 else "chunked")
    torch._dynamo.reset()
    compiled = torch.compile(attention_model, fullgraph=True, mode="reduce-overhead")
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    for _ in range(3):  # warm-up, recording, then replays
        q, k, v = random_inputs(B, H, T, 64, 64, dtype=torch.bfloat16, requires_grad=True)
        s0 = state_after_prefix(B, H, 64, 64, phi)
        leaves = (q, k, v, s0)
        torch.compiler.cudagraph_mark_step_begin()
        outputs = compiled(q, k, v, s0, "elu", method)
        grad_out = torch.randn_like(outputs[0])
        ones = torch.ones((), device="cuda")
        compiled_grads = torch.autograd.grad(outputs, leaves, (grad_out, ones))
        eager = attention_model(q, k, v, s0, "elu", method)
        assert_close(outputs[0], eager[0], torch.bfloat16, "out against eager")
        leaves64 = [x.detach().double().requires_grad_() for x in leaves]
        expected = attention_model64(*leaves64, phi)
        expected_grads = torch.autograd.grad(expected, leaves64, (grad_out.double(), ones.double()))
        names = ("out", "state sum", "dq", "dk", "dv", "ds0")
        for name, a, b in zip(names, (*outputs, *compiled_grads), (*expected, *expected_grads)):
            tolerance = NORMALISED_BF16_DQ_TOLERANCE if name == "dq" else TOLERANCES[torch.bfloat16]
            error = relative_error(a, b)
            assert error <= tolerance, f"{name} against float64: {error:.3e} > {tolerance:.0e}"


@pytest.mark.gpu
def test_gpu_step_replays_from_a_cuda_graph():
    layer = make_layer("auto", dim=1024, heads=16, dtype=torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    state = layer.initial_state(8)
    eager_state = state.clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
            layer.step(x, state.clone())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step; runs nothing
            y = layer.step(x, state)
        for _ in range(3):  # each replay advances the captured state by one token
            graph.replay()
            assert_close(y, layer.step(x, eager_state), torch.bfloat16, "replayed output")
            assert_close(state, eager_state, torch.float32, "replayed state")


# Packed sequences ------------------------------------------------------------------------------

PACKED_LENGTHS = (5, 0, 17, 9)


def packed_reference(q, k, v, s0, lengths, eps):
    """Each sequence on its own through attention64 (float64 inputs, on the CPU), outputs packed
    back, one state each."""
    outputs, states, start = [], [], 0
    for n, length in enumerate(lengths):
        part = slice(start, start + length)
        out, state = attention64(q[:, :, part], k[:, :, part], v[:, :, part], lambda x: F.elu(x) + 1, True, eps,
                                 s0[n:n + 1])
        outputs.append(out)
        states.append(state)
        start += length
    return torch.cat(outputs, dim=2), torch.cat(states, dim=0)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_packed_sequences_match_each_sequence_alone(method):
    """cu_seqlens: no state crosses a boundary, an empty sequence keeps its S_0, gradients too
    (recurrent and scan normalise in their kernels, the others through the ones column)."""
    offsets = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], device=ttx_tutorial.DEVICE)
    q, k, v = random_inputs(1, 2, sum(PACKED_LENGTHS), 8, 6, seed=31, requires_grad=True)
    s0 = torch.rand(len(PACKED_LENGTHS), 2, 8, 7, device=ttx_tutorial.DEVICE, requires_grad=True)
    out, state = ttx_tutorial.causal_linear_attention(q, k, v, method=method, initial_state=s0, return_state=True,
                                                      cu_seqlens=offsets)
    leaves = [float64(x).requires_grad_() for x in (q, k, v, s0)]
    expected_out, expected_state = packed_reference(*leaves, PACKED_LENGTHS, 1e-6)
    assert_close(out, expected_out, torch.float32, "out")
    assert_close(state, expected_state, torch.float32, "state")
    grad_out, grad_state = torch.randn_like(out), torch.randn_like(state)
    found = torch.autograd.grad((out, state), (q, k, v, s0), (grad_out, grad_state))
    expected = torch.autograd.grad((expected_out, expected_state), leaves, (float64(grad_out), float64(grad_state)))
    for name, a, b in zip(("dq", "dk", "dv", "ds0"), found, expected):
        assert_close(a, b, torch.float32, name)


def test_the_layer_takes_packed_sequences():
    """A packed batch through the layer equals each sequence through it alone, states included."""
    torch.manual_seed(5)
    layer = ttx_tutorial.CausalLinearAttention(16, 2).to(ttx_tutorial.DEVICE)
    x = torch.randn(1, sum(PACKED_LENGTHS), 16, device=ttx_tutorial.DEVICE)
    offsets = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], device=ttx_tutorial.DEVICE)
    with torch.no_grad():
        y, state = layer(x, return_state=True, cu_seqlens=offsets)
        start = 0
        for n, length in enumerate(PACKED_LENGTHS):
            alone, alone_state = layer(x[:, start:start + length], return_state=True)
            assert_close(y[:, start:start + length], alone, torch.float32, f"sequence {n}")
            assert_close(state[n:n + 1], alone_state, torch.float32, f"state {n}")
            start += length


@pytest.mark.parametrize("method, kernel_file", [("recurrent", "recurrent"), ("scan", "scan"), ("chunked", None)])
def test_recurrent_and_scan_normalise_packed_sequences_in_their_kernels(method, kernel_file, monkeypatch):
    """The ones column is for the methods without a packed normaliser of their own."""
    from ttx_tutorial import attention
    called = []
    for name, module in (("recurrent", attention._recurrent), ("scan", attention._scan)):
        original = module._run_normalized_validated
        monkeypatch.setattr(module, "_run_normalized_validated",
                            lambda *a, _name=name, _original=original, **kw: called.append(_name) or _original(*a, **kw))
    offsets = torch.tensor([0, 3, 10], device=ttx_tutorial.DEVICE)
    q, k, v = random_inputs(1, 2, 10, 8, 6, seed=32)
    ttx_tutorial.causal_linear_attention(q, k, v, method=method, cu_seqlens=offsets)
    assert called == ([kernel_file] if kernel_file else [])


def test_packed_sequences_as_wide_as_the_kernels_take():
    """E = 256 packed: no room for a ones column, so "chunked" says so and "auto" takes a kernel
    that normalises packed sequences itself."""
    offsets = torch.tensor([0, 2, 5], device=ttx_tutorial.DEVICE)
    q, k, v = random_inputs(1, 1, 5, 4, 256, seed=33)
    with pytest.raises(ValueError, match=r"E \+ 1 <= 256; E = 256 runs with 'recurrent' or 'scan'"):
        ttx_tutorial.causal_linear_attention(q, k, v, method="chunked", cu_seqlens=offsets)
    s0 = torch.zeros(2, 1, 4, 257, device=ttx_tutorial.DEVICE)
    out = ttx_tutorial.causal_linear_attention(q, k, v, cu_seqlens=offsets)
    expected, _ = packed_reference(*(float64(x) for x in (q, k, v, s0)), (2, 3), 1e-6)
    assert_close(out, expected, torch.float32, "out")
