"""The normaliser inside the scan kernels (NORMALIZE, NORMALIZER_GRADIENT): method "scan" of
causal_linear_attention and ``scan.scan_normalized_attention``, against float64.

The reference is test_attention's, written independently of the ones column: the masked
weights A = tril(phi(Q) phi(K)^T), out = A V / (A 1 + eps), the state (S, z). Every output is
allocated poisoned (NaN), so an element a pass forgets to write fails the comparison. Short
segments (``SHORT``: 16 tokens, chunks of 16) put several segments in a short sequence, so
that z crosses passes 1, 2 and 3, forward and backward.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial import references, testing
from ttx_tutorial.kernels import scan
from ttx_tutorial.testing import (TOLERANCES, assert_close, poisoned_allocations, random_inputs, relative_error,
                                  run_python)
from test_attention import (NORMALISED_BF16_DQ_TOLERANCE, attention64, attention64_by_chunks,
                            check_gradient_of_the_state_alone, check_gradients_of_values_far_from_zero,
                            check_kernel_normaliser_with_state, check_long_sequence_stays_finite,
                            check_normalised_entry, check_packed_normalised_entry, check_widest_values_normalise,
                            reference_attention, reference_gradients, state_after_prefix)
from test_recurrent import _RECORD_AND_COMPILE
from test_reliability import assert_same_results, with_garbage

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: Segments of 16 tokens in chunks of 16: a 45-token sequence walks three segments.
SHORT = {"CHUNK": 16, "SEGMENT_LEN": 16}


def phi(x):
    return F.elu(x) + 1


# The rule's configuration: one segment at this length (CPU mode assumes an H200's multiprocessors).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", ["elu", "relu", "callable"])
def test_method_scan_matches_float64_with_states_and_gradients(feature, dtype):
    """causal_linear_attention(method="scan") normalises in its kernels."""
    check_kernel_normaliser_with_state("scan", 77, 24, feature, dtype)


def test_method_scan_normalises_in_the_kernel(monkeypatch):
    """The route: one normalised forward of the kernel file (NORMALIZE), v as given, no ones
    column; a plain product on [v, 1] would show as E + 1 columns without eps."""
    seen = []
    launch = scan._launch

    def recording_launch(q, k, v, *args, **kwargs):
        seen.append((v.shape[-1], kwargs.get("eps") is not None))
        return launch(q, k, v, *args, **kwargs)

    monkeypatch.setattr(scan, "_launch", recording_launch)
    q, k, v = random_inputs(1, 2, 9, 8, 5)
    ttx_tutorial.causal_linear_attention(q, k, v, method="scan")
    assert seen == [(5, True)]


#: (dtype, D, E, config): which backward runs, how many segments cut the 45 tokens and how many
#: value blocks split E in the forward.
PATHS = {
    "bf16 fused backward, 3 segments, 3 value blocks": (torch.bfloat16, 16, 40, {**SHORT, "BLOCK_E": 16}),
    "fp16 fused backward, 2 segments, 2 value blocks": (torch.float16, 32, 20,
                                                        {"CHUNK": 16, "SEGMENT_LEN": 32, "BLOCK_E": 16}),
    "bf16 passes on g (D > 64), 3 segments": (torch.bfloat16, 80, 8, SHORT),
    "fp16 passes on g (E > 64), in float32": (torch.float16, 8, 72, SHORT),
    "fp32 passes on g, 2 value blocks": (torch.float32, 8, 20, {**SHORT, "BLOCK_E": 16, "num_warps": 4}),
    "bf16 fused backward, one segment": (torch.bfloat16, 16, 12, None),
}


@pytest.mark.parametrize("with_state", [True, False], ids=["with a state", "from nothing"])
@pytest.mark.parametrize("path", PATHS)
def test_segments_value_blocks_and_backward_paths_match_float64(path, with_state):
    """The kernel file's entry on features: z through passes 1 to 3, every value block's program
    computing its own denominator, and both backwards; out, state and the four gradients
    against float64."""
    dtype, D, E, config = PATHS[path]
    check_normalised_entry(scan.scan_normalized_attention, dtype, 45, D, E, config, with_state, path)


@pytest.mark.parametrize("feature, with_state", [("elu", True), ("relu", False)])
@pytest.mark.parametrize("path", PATHS)
def test_feature_maps_inside_the_kernels_on_every_path(path, feature, with_state):
    """The kernels map raw q and k themselves (``feature_map``), forward and backward: passes 1
    to 3, the suffix states' pass 1, the fused backward's two walks (dq and dk through phi') and
    the passes on g, which map in PyTorch as the kernels do, and the terms' walks. D and E are not powers of two
    on most paths, and 45 tokens end inside a chunk: the padding, which loads as 0 and which
    elu + 1 would map to 1, must stay 0."""
    dtype, D, E, config = PATHS[path]
    check_normalised_entry(scan.scan_normalized_attention, dtype, 45, D, E, config, with_state,
                           f"{feature} {path}", feature)


@pytest.mark.parametrize("feature", ["elu", "relu"])
def test_named_feature_maps_with_method_scan(feature):
    """causal_linear_attention(method="scan") maps q and k in PyTorch and runs the scan kernels'
    normaliser on the features: out and the gradients of the raw q, k, v against float64."""
    reference_map = {"elu": phi, "relu": F.relu}[feature]
    q, k, v = random_inputs(1, 2, 37, 12, 8, dtype=torch.bfloat16)
    # Shifted up, so that relu leaves no query with a denominator near eps: there bfloat16's dk and
    # dq lose digits to the normaliser's cancellation.
    q, k = (x + 0.5 for x in (q, k))
    for x in (q, k, v):
        x.requires_grad_()
    out = ttx_tutorial.causal_linear_attention(q, k, v, feature_map=feature, method="scan")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected, _ = reference_attention(q, k, v, reference_map, True, 1e-6)
    assert_close(out, expected, torch.bfloat16, "output")
    for label, leaf, grad in zip("qkv", (q, k, v), reference_gradients(q, k, v, reference_map, True, 1e-6, grad_out)):
        tolerance = NORMALISED_BF16_DQ_TOLERANCE if label == "q" else TOLERANCES[torch.bfloat16]
        error = relative_error(leaf.grad, grad)
        assert error <= tolerance, f"d{label}: {error:.3e} > {tolerance:.0e}"


@pytest.mark.parametrize("path", [path for path, (dtype, *_) in PATHS.items() if dtype != torch.bfloat16])
def test_gradients_of_values_far_from_zero(path):
    """Values of mean 3: r_t = -(g_t . out_t) then cancels most of dk's and dq's other terms, so
    a missing or misplaced term of the denominator shows at once (bfloat16's rounding leaves too
    little of dq: see test_attention's test of the chunked kernel)."""
    dtype, D, E, config = PATHS[path]
    check_gradients_of_values_far_from_zero(scan.scan_normalized_attention, dtype, 45, D, E, config, f"{path} ")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_of_the_state_alone(dtype):
    """Only the returned state is used: no output gradient reaches the backward."""
    check_gradient_of_the_state_alone("scan", dtype, 40, 16, 8)


def test_gradient_of_the_state_alone_across_segments():
    """The same through three segments: the suffix states' passes 1 and 2 carry dz on their own."""
    raw = random_inputs(1, 2, 40, 8, 5)
    q, k = (phi(x).detach() for x in raw[:2])
    v = raw[2]
    for x in (k, v):
        x.requires_grad_()
    s0 = state_after_prefix(1, 2, 8, 5, phi)
    with poisoned_allocations():
        _, state = scan.scan_normalized_attention(q, k, v, s0, config=SHORT)
        grad_state = torch.randn_like(state)
        state.backward(grad_state)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    _, expected_state = attention64(*leaves[:3], lambda x: x, True, 1e-6, leaves[3])
    expected = torch.autograd.grad(expected_state, leaves[1:], grad_state.double())
    for label, leaf, grad in zip(("k", "v", "initial state"), (k, v, s0), expected):
        assert_close(leaf.grad, grad, torch.float32, f"d{label}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", [[20, 0, 1, 35], [16, 0, 16, 7, 25, 0]], ids=["inside", "on edges"])
def test_packed_sequences_match_each_sequence_alone(lengths, dtype):
    """cu_seqlens with an empty sequence and, first, boundaries at tokens 20 and 21 of the packed
    row, inside its 16-token segments, then boundaries on segment edges (16, 32, 64) with empty
    sequences on them: the segments straddle the boundaries, and each sequence's output, final
    (S, z) and gradients equal float64 on that sequence alone, from its own initial state."""
    check_packed_normalised_entry(
        lambda q, k, v, s0, offsets: scan.scan_normalized_attention(q, k, v, s0, config=SHORT, cu_seqlens=offsets),
        lengths, dtype)


def test_packed_sequences_through_the_passes_match_each_sequence_alone():
    """bfloat16 heads over 64 take the plain passes and then the terms' walks, whose running
    sums of the keys (dq) and of r_t q_t (dk) start again at every packed sequence, from its
    own z_0 and G_z: each sequence against float64 on that sequence alone."""
    check_packed_normalised_entry(
        lambda q, k, v, s0, offsets: scan.scan_normalized_attention(q, k, v, s0, config=SHORT, cu_seqlens=offsets),
        [20, 0, 1, 35], torch.bfloat16, D=72, E=8)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the plain product, on purpose
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_sequence_stays_finite(dtype):
    """Features of about 3 make phi(q).z pass float16's 65504 within 512 tokens of 16 features:
    the normalised passes keep it in float32 and stay finite and accurate, gradients included."""
    check_long_sequence_stays_finite("scan", dtype, 512, 4, 1e-1)


def test_widest_values_normalise_with_gradients():
    """E = 256, where a ones column would not fit (E + 1 values): the passes carry the
    normaliser beside the state, forward and backward."""
    check_widest_values_normalise("scan")


def normalized_with_gradients(q, k, v, grad_o, *, reference, feature_map="identity"):
    """(out, S_T, dq, dk, dv) of scan's normalised attention (eps 1e-6, segments of 64 tokens)
    with the kernels' ``feature_map``, or of its float64 reference: ``cumsum`` of the mapped q, k
    on v with a column of ones appended, whose last output column is the denominator phi(q_t) . z_t."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with testing.poisoned_allocations():
        if reference:
            mapping = {"identity": lambda x: x, "elu": phi}[feature_map]
            ones = torch.ones_like(leaves[2][..., :1])
            extended, state = references.cumsum(mapping(leaves[0]), mapping(leaves[1]),
                                                torch.cat([leaves[2], ones], -1))
            out = extended[..., :-1] / (extended[..., -1:] + 1e-6)
        else:
            out, state = scan.scan_normalized_attention(*leaves, eps=1e-6, config={"SEGMENT_LEN": 64},
                                                        feature_map=feature_map)
        out.backward(grad_o.to(out.device, out.dtype))
    return out.detach(), state.detach(), *(x.grad for x in leaves)


# 130 tokens in segments of 64 (one chunk each at this head): the garbage at token 100
# sits in the middle segment, late in a chunk. bfloat16 takes the fused backward, float32 the
# passes on g.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("argument, garbage", [("q", math.inf), ("k", math.nan), ("v", math.inf), ("do", math.nan)],
                         ids=["q-inf", "k-nan", "v-inf", "do-nan"])
def test_non_finite_values_stay_causal(argument, garbage, dtype):
    q, k, v, grad_o = with_garbage(1, 2, 130, 16, 16, dtype, ttx_tutorial.DEVICE, argument, garbage, 100, seed=6)
    q, k = q.abs(), k.abs()  # positive features: denominators far from 0
    found = normalized_with_gradients(q, k, v, grad_o, reference=False)
    expected = normalized_with_gradients(*(x.detach().cpu().double() for x in (q, k, v, grad_o)), reference=True)
    assert_same_results("normalised scan", ("out", "S_T", "dq", "dk", "dv"), found, expected, dtype,
                        tolerances={"dq": NORMALISED_BF16_DQ_TOLERANCE} if dtype == torch.bfloat16 else None)


# The walks token by token map q and k as the chunk loops do (the fused backward's: bfloat16), and
# at D = 12 the padding of q and k, mapped to 1 by elu + 1, must stay out of them.
@pytest.mark.parametrize("argument, garbage", [("q", -math.inf), ("k", math.inf), ("v", math.nan), ("do", math.inf)],
                         ids=["q--inf", "k-inf", "v-nan", "do-inf"])
def test_non_finite_values_stay_causal_with_a_feature_map(argument, garbage):
    q, k, v, grad_o = with_garbage(1, 2, 130, 12, 16, torch.bfloat16, ttx_tutorial.DEVICE, argument, garbage, 100,
                                   seed=7)
    found = normalized_with_gradients(q, k, v, grad_o, reference=False, feature_map="elu")
    expected = normalized_with_gradients(*(x.detach().cpu().double() for x in (q, k, v, grad_o)), reference=True,
                                         feature_map="elu")
    assert_same_results("normalised scan elu", ("out", "S_T", "dq", "dk", "dv"), found, expected, torch.bfloat16,
                        tolerances={"dq": NORMALISED_BF16_DQ_TOLERANCE})


def test_errors_are_named():
    q, k, v = random_inputs(1, 2, 5, 40, 8)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\), z as the last "
                                         r"column, = \(1, 2, 40, 9\), got \(1, 2, 40, 8\)"):
        scan.scan_normalized_attention(q, k, v, torch.zeros(1, 2, 40, 8, device=q.device))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(N, H, D, E \+ 1\) with cu_seqlens"):
        scan.scan_normalized_attention(q[:1], k[:1], v[:1], torch.zeros(2, 2, 40, 8, device=q.device),
                                       cu_seqlens=torch.tensor([0, 2, 5], device=q.device))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        scan.scan_normalized_attention(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        scan.scan_normalized_attention(q, k, v, eps=None)
    with pytest.raises(ValueError, match="unknown config keys"):
        scan.scan_normalized_attention(q, k, v, config={"WALK": "blocks"})
    for bad in ("gelu", F.elu, None):
        with pytest.raises(ValueError, match=r"feature_map must be one of \('elu', 'relu', 'identity'\)"):
            scan.scan_normalized_attention(q, k, v, feature_map=bad)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, D, E \+ 1\)"):
        ttx_tutorial.causal_linear_attention(q, k, v, method="scan", initial_state=torch.zeros(2, 2, 40, 9))


# On the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_65536_tokens_match_float64(dtype):
    """The normalised scan over 65536 tokens (the rule's segments), and its fused backward:
    finite, and out and the gradients of q, k and v against float64 (on the GPU, chunk by chunk)."""
    q, k, v = random_inputs(1, 2, 65536, 64, 64, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out, _ = scan.scan_normalized_attention(*(phi(x) for x in (q, k)), v)
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

@pytest.mark.parametrize("feature_map", ["identity", "elu"])
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_benchmark_launches_compile_without_spills(target, feature_map):
    """The normalised forward and backward as launched on (8, 16, 4096, 64, 64) bfloat16 with an
    initial state (features given, or elu + 1 inside the kernels, causal_linear_attention's
    default), compiled for ``target`` with that GPU's limits: every launch (passes 1 and 2, pass
    3, the denominator's gradient, the suffix passes 1 and 2 and the fused backward) compiles and
    fits, and on sm_90 all but the fused backward spill nothing (ptxas' STACK). The fused backward spills some, and so does pass 3 with
    elu + 1 on sm_80 (see the kernel file's header)."""
    limits = {"sm_90": (132, 232448), "sm_80": (108, 166912)}[target]
    result = run_python(_RECORD_AND_COMPILE + f"""
        from ttx_tutorial.kernels import scan
        scan._device_limits = lambda device: {limits}
        kernels = {{name: getattr(scan, name) for name in
                   ("scan_summaries_kernel", "scan_outputs_kernel", "normalizer_gradient_kernel",
                    "scan_backward_kernel")}}
        launches = []
        for name, kernel in kernels.items():
            kernel.run = lambda *args, grid, warmup, name=name, **kwargs: launches.append((name, args, kwargs))
        q, k, v = (torch.zeros(8, 16, 4096, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        s0 = torch.zeros(8, 16, 64, 65, requires_grad=True)
        o, state = scan._run_normalized_validated(q, k, v, s0, 1e-6, feature_map="{feature_map}")
        torch.autograd.backward((o, state), (torch.zeros_like(o), torch.zeros_like(state)))
        for kernel in kernels.values():
            del kernel.run
        assert [name for name, _, _ in launches] == [
            "scan_summaries_kernel", "scan_outputs_kernel", "normalizer_gradient_kernel", "scan_summaries_kernel",
            "scan_backward_kernel"], launches
        for name, args, kwargs in launches:
            assert name == "normalizer_gradient_kernel" or kwargs["NORMALIZE"], (name, kwargs)
            compiled = compiler.compile_launch(kernels[name], *args, target="{target}", **kwargs)
            assert compiled.ok, compiled.summary()
            print(name, "NORMALIZER_GRADIENT" if kwargs.get("NORMALIZER_GRADIENT") else "")
            print_resources(compiled)
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout
    print(report)
    passes = report.split("scan_backward_kernel")[0]
    if target == "sm_90":
        assert passes.count("STACK:0") == 4, report


# A program whose chunks met an inf or NaN rewrites its segment's outputs one token at a time:
# 70 tokens in 16-token segments, an inf in v at token 40 (the third segment, inside its
# chunk). eps as large as the denominators (about 20 there), so that one left out of the
# rewritten denominators, or added twice, moves every output the rewrite writes.
def test_outputs_rewritten_token_by_token_add_eps_once():
    """The token-by-token rewrite after a non-finite chunk divides by q_t . z_t + eps, as the
    chunk loop does: the finite outputs of the rewritten segment match float64 with a large eps."""
    eps = 4.0
    q, k, v, _ = with_garbage(1, 2, 70, 8, 8, torch.float32, ttx_tutorial.DEVICE, "v", math.inf, 40, seed=9)
    q, k = q.abs(), k.abs()  # positive features: denominators far from 0
    with testing.poisoned_allocations():
        out, state = scan.scan_normalized_attention(q, k, v, eps=eps, config=SHORT)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    extended, expected_state = references.cumsum(q64, k64, torch.cat([v64, torch.ones_like(v64[..., :1])], -1))
    expected = extended[..., :-1] / (extended[..., -1:] + eps)
    assert_same_results("normalised scan, eps 4", ("out", "S_T"), (out, state), (expected, expected_state),
                        torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_denominator_gradient_takes_the_numerator_gradient_as_rounded_for_the_products(dtype):
    """``normalizer_gradient_kernel`` makes g_t = dO_t / (d_t + eps) rounded as the backward's
    products take it (bfloat16 for bfloat16 inputs, float32 otherwise) and r_t = -(g_t . out_t)
    from that same rounded g: the score gradients g_t . v_s + r_t then cancel where v_s ~ out_t,
    where a g rounded for one and not the other leaves bfloat16's rounding error behind. Two
    programs of tokens (70 > 64), a head not a power of two."""
    B, H, T, E = 1, 2, 70, 12
    generator = torch.Generator().manual_seed(21)
    grad_o, o = (torch.randn(B, H, T, E, generator=generator).to(ttx_tutorial.DEVICE, dtype) for _ in range(2))
    denominator = (0.5 + 3 * torch.rand(B, H, T, generator=generator)).to(ttx_tutorial.DEVICE)
    with testing.poisoned_allocations():
        grad_denominator, numerator = scan._normalizer_gradient(grad_o, o, denominator, with_numerator=True)
    # bfloat16 rounds the float32 quotient to nearest, ties to even
    expected_numerator = (grad_o.float() / denominator[..., None]).to(
        torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    terms = expected_numerator.double() * o.double()
    # float32 sums of E terms: within a few units of float32's last place of the terms' magnitudes
    assert ((grad_denominator.double() + terms.sum(-1)).abs() <= 2.0**-20 * terms.abs().sum(-1)).all()
    assert numerator.dtype == expected_numerator.dtype
    if ttx_tutorial.INTERPRETED:  # NumPy's float32 division rounds correctly, as PyTorch's does
        assert torch.equal(numerator, expected_numerator)
    else:  # Triton compiles float32 division to PTX div.full.f32, within 2 units in the last
        # place: two float32 units, which may move a bfloat16 rounding by one of its own
        units = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
        torch.testing.assert_close(numerator.double(), expected_numerator.double(), rtol=units, atol=0)


def test_eps_may_be_zero_and_must_be_finite():
    """eps = 0 is a valid choice (features whose denominators stay positive need none) and gives
    out = numerator / denominator exactly as float64 does; an infinite eps would turn every output
    into 0 and is refused, as a negative one is."""
    q, k, v = random_inputs(1, 2, 21, 8, 5, seed=13)
    q, k = q.abs(), k.abs()
    with testing.poisoned_allocations():
        out, _ = scan.scan_normalized_attention(q, k, v, eps=0.0, config=SHORT)
    expected, _ = reference_attention(q, k, v, lambda x: x, True, 0.0)
    assert_close(out, expected, torch.float32, "out with eps = 0")
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        scan.scan_normalized_attention(q, k, v, eps=math.inf)
