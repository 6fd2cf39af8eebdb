"""The "scan" method (ttx_tutorial/kernels/scan.py) against float64 references.

Every case checks the output, the final state and the gradients of q, k, v and the initial
state, with NaN-poisoned allocations so that an element no kernel writes fails the comparison.
Most cases force short chunks and segments through ``config``, so that a few dozen tokens
already cross chunk and segment boundaries (partial last chunk, partial last segment, several
segments, one segment) and the interpreter stays fast; a few use the wrapper's own rule.
"""

from __future__ import annotations

import pytest
import torch

import ttx_tutorial
from ttx_tutorial.kernels import scan
from ttx_tutorial.references import quadratic
from ttx_tutorial.testing import assert_close, poisoned_allocations, random_inputs, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CHUNK = 16
SHORT = {"CHUNK": CHUNK, "SEGMENT_LEN": 2 * CHUNK}   # segments of two chunks


def loss_weights(o, final_state, seed):
    """Random cotangents for o (in its dtype) and for the final state (float32)."""
    generator = torch.Generator().manual_seed(seed)
    grad_o = torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.dtype)
    grad_state = torch.randn(final_state.shape, generator=generator, dtype=torch.float64).float()
    return grad_o.to(o.device), grad_state.to(final_state.device)


def check_against_float64(q, k, v, initial_state, run, *, dtype, seed=0):
    """``run(q, k, v, s0) -> (o, S_T)``: its outputs and gradients must match float64 autograd."""
    leaves = [x for x in (q, k, v, initial_state) if x is not None]
    with poisoned_allocations():
        o, final_state = run(q, k, v, initial_state)
        grad_o, grad_state = loss_weights(o, final_state, seed)
        grads = torch.autograd.grad((o, final_state), leaves, (grad_o, grad_state))

    # The states never leave float32, and products of 16-bit inputs are exact in float32, so the
    # final state and the gradient of the initial state meet float32's tolerance in every dtype.
    ref_o, ref_state = reference(q, k, v, initial_state)
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, F32, "final state")

    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in leaves]
    ref_initial = ref_leaves[3] if initial_state is not None else None
    ref_o, ref_state = quadratic(*ref_leaves[:3], ref_initial)
    ref_grads = torch.autograd.grad((ref_o, ref_state), ref_leaves,
                                    (grad_o.cpu().double(), grad_state.cpu().double()))
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "d initial state"), grads, ref_grads):
        assert grad.shape == ref_grad.shape, name
        assert_close(grad, ref_grad, F32 if name == "d initial state" else dtype, name)


def scan_with(config):
    return lambda q, k, v, s0: scan.scan_causal_product(q, k, v, s0, config=config)


# (dtype, B, H, T, D, E, config, with initial state)
CASES = [
    pytest.param(F32, 1, 2, 0, 5, 24, SHORT, True, id="T=0"),
    pytest.param(BF16, 1, 1, 1, 24, 5, SHORT, True, id="T=1"),
    pytest.param(F16, 1, 2, CHUNK - 1, 5, 24, SHORT, False, id="T=C-1"),
    pytest.param(F32, 1, 2, CHUNK + 1, 24, 5, SHORT, True, id="T=C+1"),
    pytest.param(BF16, 2, 1, 2 * CHUNK + 3, 65, 24, SHORT, True, id="T=L+3-D=65"),
    pytest.param(F16, 1, 2, 5 * CHUNK + 7, 24, 65, SHORT, True, id="3-segments-partial-E=65"),
    pytest.param(F32, 1, 1, 5 * CHUNK + 7, 65, 5, {"CHUNK": CHUNK, "SEGMENT_LEN": 3 * CHUNK}, False,
                 id="2-segments-of-3-chunks"),
    pytest.param(BF16, 1, 1, 20, 256, 3, {"CHUNK": CHUNK, "SEGMENT_LEN": CHUNK}, True, id="D=256"),
    pytest.param(F16, 1, 1, 20, 3, 250, SHORT, True, id="E=250-several-value-blocks"),
    pytest.param(F32, 1, 1, 40, 24, 70, {**SHORT, "BLOCK_E": 16}, True, id="E=70-BLOCK_E=16"),
    pytest.param(BF16, 2, 1, 5 * CHUNK + 7, 24, 40, SHORT, True, id="fused-backward-3-segments"),
    pytest.param(F16, 1, 2, 4 * CHUNK, 64, 33, SHORT, False, id="fused-backward-float16-D=64"),
]
# The wrapper's own rule; under the interpreter it cuts work as for 132 SMs, so these cross
# segment boundaries too (checked below).
DEFAULT_RULE_CASES = [(BF16, 1, 2, 300, 16, 16), (F16, 1, 1, 200, 5, 24), (F32, 1, 1, 130, 24, 5)]
CASES += [pytest.param(dtype, B, H, T, D, E, None, dtype != F32, id=f"default-rule-{dtype}")
          for dtype, B, H, T, D, E in DEFAULT_RULE_CASES]


@pytest.mark.parametrize("dtype, B, H, T, D, E, config, with_state", CASES)
def test_outputs_state_and_gradients_match_float64(dtype, B, H, T, D, E, config, with_state):
    q, k, v, s0 = random_inputs(B, H, T, D, E, dtype=dtype, seed=T * 1000 + D * 10 + E,
                                initial_state=True, requires_grad=True)
    check_against_float64(q, k, v, s0 if with_state else None, scan_with(config), dtype=dtype)


@pytest.mark.parametrize("dtype, B, H, T, D, E", DEFAULT_RULE_CASES)
def test_default_rule_cases_cross_segments(dtype, B, H, T, D, E):
    """Else the default-rule cases would silently test a single segment."""
    q = torch.empty(B, H, T, D, dtype=dtype)
    v = torch.empty(B, H, T, E, dtype=dtype)
    length = scan._resolve_config(q, v, None)["SEGMENT_LEN"]
    assert -(-T // length) >= 2


def test_scan_carries_across_many_segments():
    """Many segments, so that pass 2's running carry and its arrival count matter, forward and
    reverse (the backward scans suffix sums)."""
    segments = 19
    T = segments * CHUNK - 5
    q, k, v, s0 = random_inputs(1, 1, T, 3, 4, dtype=F32, seed=7, initial_state=True, requires_grad=True)
    config = {"CHUNK": CHUNK, "SEGMENT_LEN": CHUNK}
    assert -(-T // config["SEGMENT_LEN"]) == segments
    check_against_float64(q, k, v, s0, scan_with(config), dtype=F32)


def test_non_contiguous_inputs():
    """Strided views everywhere: T-major layouts, a stride-2 head dimension, a transposed state."""
    B, H, T, D, E = 2, 2, 45, 6, 5
    generator = torch.Generator().manual_seed(3)

    def draw(*shape):  # on the session's device first: moving a strided view there would copy it
        return torch.randn(*shape, generator=generator).to(ttx_tutorial.DEVICE)

    q = draw(B, T, H, D).transpose(1, 2)             # (B, H, T, D), T-major
    k = draw(B, H, T, 2 * D)[..., ::2]               # stride 2 along D
    v = draw(B, H, E, T).transpose(-1, -2)           # stride 1 along T
    s0 = draw(B, H, E, D).transpose(-1, -2)          # (B, H, D, E) transposed
    leaves = [x.requires_grad_() for x in (q, k, v, s0)]
    assert not any(x.is_contiguous() for x in leaves)
    check_against_float64(*leaves, scan_with(SHORT), dtype=F32)


@pytest.mark.parametrize("dtype", [F32, BF16])  # three pass-3 launches, and the fused backward
@pytest.mark.parametrize("used", ["o", "final state"])
def test_gradient_of_one_output_alone(used, dtype):
    """Autograd hands the backward None for an output the loss does not use."""
    q, k, v, s0 = random_inputs(1, 1, 40, 7, 9, dtype=dtype, seed=11, initial_state=True,
                                requires_grad=True)
    with poisoned_allocations():
        o, final_state = scan.scan_causal_product(q, k, v, s0, config=SHORT)
        output = o if used == "o" else final_state
        grads = torch.autograd.grad(output.float().sum(), (q, k, v, s0))
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    ref_o, ref_state = quadratic(*ref_leaves)
    ref_grads = torch.autograd.grad((ref_o if used == "o" else ref_state).sum(), ref_leaves,
                                    allow_unused=True, materialize_grads=True)  # S_T ignores q
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "d initial state"), grads, ref_grads):
        assert_close(grad, ref_grad, F32 if name == "d initial state" else dtype, name)


def test_fused_backward_without_dq(monkeypatch):
    """q needs no gradient: the fused backward skips its forward walk (and is the path taken)."""
    calls = []
    fused = scan._launch_backward
    monkeypatch.setattr(scan, "_launch_backward", lambda *a, **kw: calls.append(kw["compute_dq"]) or fused(*a, **kw))
    q, k, v, s0 = random_inputs(1, 2, 3 * CHUNK + 2, 20, 12, dtype=BF16, seed=12, initial_state=True)
    for x in (k, v, s0):
        x.requires_grad_()
    with poisoned_allocations():
        o, final_state = scan.scan_causal_product(q, k, v, s0, config=SHORT)
        grad_o, grad_state = loss_weights(o, final_state, seed=1)
        grads = torch.autograd.grad((o, final_state), (k, v, s0), (grad_o, grad_state))
    assert calls == [False]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    ref_o, ref_state = quadratic(*ref_leaves)
    ref_grads = torch.autograd.grad((ref_o, ref_state), ref_leaves[1:], (grad_o.double(), grad_state.double()))
    for name, grad, ref_grad in zip(("dk", "dv", "d initial state"), grads, ref_grads):
        assert_close(grad, ref_grad, F32 if name == "d initial state" else BF16, name)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_through_causal_product(dtype):
    """The public entry point, with its own validation and the wrapper's default rule."""
    q, k, v, s0 = random_inputs(1, 2, 150, 12, 20, dtype=dtype, seed=5, initial_state=True,
                                requires_grad=True)

    def run(q, k, v, s0):
        return ttx_tutorial.causal_product(q, k, v, method="scan", initial_state=s0, return_state=True)

    check_against_float64(q, k, v, s0, run, dtype=dtype)


def test_segment_length_rule_on_the_main_benchmark_shape():
    """(1, 8, 65536, 64) in bfloat16: few heads, one long sequence. With the rule's four stages
    pass 3 hides its own loads, so the rule gives the fewest segments that still put at most one
    program on each of an H100's or H200's 132 multiprocessors (4096 tokens, the fastest length
    of the recorded sweep, benchmarks/NOTES.md); with two stages, about two programs a
    multiprocessor (2048). Both keep the float32 states' traffic (each written and read about
    four times) under a quarter of the q, k, v, o traffic."""
    B, H, T, D, E, sm_count = 1, 8, 65536, 64, 64, 132
    blocks = scan._default_blocks(D, E, BF16)
    e_blocks = -(-E // blocks["BLOCK_E"])
    assert blocks["num_stages"] == 4
    for one_program, expected, (fewest, most) in ((True, 4096, (sm_count / 2, sm_count)),
                                                  (False, 2048, (sm_count, 4 * sm_count))):
        length = scan._segment_length(T, B * H, D, E, blocks["CHUNK"], e_blocks, 2, sm_count, one_program)
        segments = -(-T // length)
        assert length % blocks["CHUNK"] == 0
        assert length == expected, one_program
        assert fewest <= B * H * segments * e_blocks <= most, one_program
        state_bytes = 4 * B * H * segments * D * E * 4
        token_bytes = B * H * T * (2 * D + 2 * E) * 2
        assert state_bytes <= token_bytes / 4


@pytest.mark.parametrize("B, H, T, D, expected", [
    (8, 16, 4096, 64, 4096),      # 128 heads fill the GPU alone: one segment
    (8, 16, 4096, 128, 4096),     # 256 programs: one segment
    (2, 16, 16384, 128, 8192),    # 64 programs a segment: two segments
    (1, 4, 131072, 64, 4096),     # at most 33 segments of 4 programs: 32 of 4096 tokens
    (1, 8, 4096, 64, 512),        # 16 segments
])
def test_deep_pipeline_keeps_at_most_one_program_a_multiprocessor(B, H, T, D, expected):
    """bfloat16 with the rule's four stages: the shortest power-of-two segments that do not put
    more pass-3 programs than multiprocessors on the GPU, one segment where the heads alone
    fill it; the lengths of the fastest points of the recorded sweep."""
    config = scan.default_config(B, H, T, D, D, BF16, 132)
    programs = B * H * -(-T // config["SEGMENT_LEN"]) * -(-D // config["BLOCK_E"])
    assert config["num_stages"] == 4
    assert config["SEGMENT_LEN"] == expected
    assert programs <= 132 or config["SEGMENT_LEN"] >= T


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_default_config_passes_back_as_config(dtype):
    """What ``default_config`` returns is a config the wrapper takes: the keys of
    ``CONFIG_KEYS`` only, and as ``config=`` the same outputs as the wrapper's own choice."""
    B, H, T, D, E = 1, 2, 40, 16, 16
    q, k, v = random_inputs(B, H, T, D, E, dtype=dtype, seed=4)
    multiprocessors, shared_memory = scan._device_limits(q.device)
    config = scan.default_config(B, H, T, D, E, dtype, multiprocessors, scan.float32_precision(),
                                 shared_memory=shared_memory)
    assert set(config) == set(scan.CONFIG_KEYS)
    o_rule, state_rule = scan.scan_causal_product(q, k, v)
    o_given, state_given = scan.scan_causal_product(q, k, v, config=config)
    assert torch.equal(o_given, o_rule) and torch.equal(state_given, state_rule)


def test_packed_sequences_are_cut_as_one_sequence(monkeypatch):
    """Segments straddle the boundaries of packed sequences, so the wrapper cuts a packed row
    into the segments of one sequence of the same length: the same rule, the same length."""
    lengths = []
    table = scan._segment_table
    monkeypatch.setattr(scan, "_segment_table", lambda cu, length, T: lengths.append(length) or table(cu, length, T))
    q, k, v = random_inputs(1, 2, 300, 4, 4, dtype=F32, seed=0)
    offsets = torch.tensor([0, 15, 15, 200, 300], device=q.device)
    ttx_tutorial.causal_product(q, k, v, "scan", cu_seqlens=offsets)
    assert lengths == [scan._resolve_config(q, v, None)["SEGMENT_LEN"]]


def test_config_is_checked():
    q, k, v = random_inputs(1, 1, 20, 4, 4, dtype=F32, seed=0)
    with pytest.raises(ValueError, match="unknown config keys"):
        scan.scan_causal_product(q, k, v, config={"BLOCK_T": 16})
    with pytest.raises(ValueError, match="multiple of CHUNK"):
        scan.scan_causal_product(q, k, v, config={"CHUNK": 16, "SEGMENT_LEN": 24})
    with pytest.raises(ValueError, match="power of two"):
        scan.scan_causal_product(q, k, v, config={"BLOCK_E": 24})


def test_full_precision_float32_on_a_16_by_16_state_keeps_to_4_warps():
    """Triton 3.6 miscompiles 3xTF32 pass 3 on 8 warps with a 16 x 16 state (an out-of-bounds
    shared-memory read on an H200): the float32 rule gives 4 warps, and asking for 8 there is
    refused under every split precision; tiles with a side of 32 or more (32 x 16 ran right on
    8 warps) may take 8."""
    for D, E in ((8, 8), (16, 16), (8, 64), (64, 64), (128, 128)):
        assert scan.default_config(1, 2, 20, D, E, F32, 132)["num_warps"] == 4, (D, E)
    q, k, v = random_inputs(1, 1, 20, 8, 8, dtype=F32, seed=0)
    with pytest.raises(ValueError, match="num_warps must be at most 4"):
        scan.scan_causal_product(q, k, v, config={"num_warps": 8})
    for precision in scan._SPLIT_PRECISIONS:
        with pytest.raises(ValueError, match="num_warps must be at most 4"):
            scan._resolved_config(1, 1, 20, 8, 8, F32, 132, (("num_warps", 8),), precision)
    assert scan._resolved_config(1, 1, 20, 8, 64, F32, 132, (("num_warps", 8),), "bf16x3")["num_warps"] == 8
    assert scan._resolved_config(1, 1, 20, 32, 16, F32, 132, (("num_warps", 8),), "tf32x3")["num_warps"] == 8


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_tuning_candidates_are_valid_configs(dtype):
    for candidate in scan.TUNING_CANDIDATES:
        for head_dim in (64, 128):
            q = torch.empty(1, 8, 65536, head_dim, dtype=dtype)
            resolved = scan._resolve_config(q, q, candidate)
            assert resolved["SEGMENT_LEN"] % resolved["CHUNK"] == 0


#: (D, E, dtype, float32 products) -> (CHUNK, BLOCK_E, num_warps) of the rule, at the edges of
#: its branches (``_default_blocks``): bfloat16 in 64-token chunks with at most 64 value columns
#: and 8192 state entries; float16 in chunks of 64 up to heads of 128, of 32 beyond, within 4096
#: entries; float32 under 3xTF32 in chunks of 64 up to heads of 64, of 32 beyond, within 4096
#: entries; float32 under TF32 from D = 65 to 128 with whole value heads up to 128 columns,
#: chunks of 16 where E is as wide, else 32, on 8 warps past 8192 entries.
RULE_EDGES = [
    (16, 128, BF16, "tf32", (64, 64, 4)),
    (256, 256, BF16, "tf32", (64, 32, 4)),
    (128, 128, F16, "tf32", (64, 32, 4)),
    (129, 16, F16, "tf32", (32, 16, 4)),
    (16, 129, F16, "tf32", (32, 64, 4)),
    (64, 64, F32, "tf32x3", (64, 64, 4)),
    (65, 16, F32, "tf32x3", (32, 16, 4)),
    (16, 65, F32, "tf32x3", (32, 64, 4)),
    (64, 64, F32, "tf32", (64, 64, 4)),
    (128, 64, F32, "tf32", (32, 64, 4)),
    (128, 128, F32, "tf32", (16, 128, 4)),
    (128, 256, F32, "tf32", (32, 128, 8)),
]


@pytest.mark.parametrize("D, E, dtype, precision, expected", RULE_EDGES,
                         ids=[f"{D}x{E}-{str(dtype)[6:]}-{p}" for D, E, dtype, p, _ in RULE_EDGES])
def test_rule_blocks_at_the_edges_of_its_branches(D, E, dtype, precision, expected):
    """The blocks the rule gives on each side of its thresholds, as its docstring states them:
    each keeps pass 3 within the registers measured on sm_90, and a threshold moved by one
    power of two gives tiles that spill or chunks the backward cannot share."""
    config = scan.default_config(1, 8, 65536, D, E, dtype, 132, precision)
    assert (config["CHUNK"], config["BLOCK_E"], config["num_warps"]) == expected


def test_16_bit_keys_from_33_to_128_wide_pipeline_deeper_where_they_fit():
    """Pass 3 keeps four chunks of q, k and v in flight for bfloat16 keys 33 to 128 wide (160 KB
    at D = 128), three for float16's, where the GPU's shared memory holds them (an H100/H200's;
    at D = 128 in bfloat16 not an A100's), except in the normalised forward; everything else
    keeps two."""
    h100, a100 = 232448, 166912
    for D, E, dtype, shared_memory, stages in ((128, 128, BF16, h100, 4), (65, 16, BF16, h100, 4),
                                               (128, 128, BF16, a100, 2), (64, 128, BF16, h100, 4),
                                               (64, 64, BF16, a100, 4), (33, 64, BF16, h100, 4),
                                               (32, 64, BF16, h100, 2), (64, 64, F16, h100, 3),
                                               (256, 256, BF16, h100, 2), (128, 128, F16, h100, 3),
                                               (256, 256, F16, h100, 2),
                                               (128, 128, F32, h100, 2)):
        config = scan.default_config(2, 16, 16384, D, E, dtype, 132, shared_memory=shared_memory)
        assert config["num_stages"] == stages, (D, E, dtype, shared_memory)
        if stages > 2:
            assert scan._pipelined_bytes(scan._block(D), config["BLOCK_E"], config["CHUNK"], stages, 2) <= shared_memory
    q = torch.empty(2, 16, 16384, 128, dtype=BF16)
    assert scan._resolve_config(q, q, None)["num_stages"] == 4
    assert scan._resolve_config(q, q, None, normalized=True)["num_stages"] == 4  # the normalised backward's passes
    assert scan._resolve_config(q, q, None, normalized=True, denominator=True)["num_stages"] == 2
    assert scan._resolve_config(q, q, {"num_stages": 3})["num_stages"] == 3
    # and the segments that go with the depth: the normalised forward's two stages keep two
    # programs a multiprocessor (four segments), which its backward reuses
    assert scan._resolve_config(q, q, None)["SEGMENT_LEN"] == 8192
    assert scan._resolve_config(q, q, None, normalized=True, denominator=True)["SEGMENT_LEN"] == 4096
    assert scan._resolve_config(q, q, {"num_stages": 2})["SEGMENT_LEN"] == 4096
    # float16 as deep keeps two programs a multiprocessor (measured faster so): 4096, not 16384
    assert scan._resolved_config(2, 16, 16384, 128, 128, F16, 132, (("num_stages", 4),), "tf32")["SEGMENT_LEN"] == 4096


def test_fused_backward_takes_heads_up_to_64_in_their_own_chunks():
    """The fused backward holds R, two score tiles and a chunk's dK and dV in registers: heads up
    to 64 wide (D and E), 16-bit or float32 under one TF32 product, take it; wider ones and
    float32 under "highest" the passes. Its chunks are the forward's, at most 64 tokens for
    bfloat16 and 32 for float16 and float32, whose float32 intermediates take twice the
    registers."""
    assert scan.fused_backward_config(64, 64, BF16)["CHUNK"] == 64
    assert scan.fused_backward_config(64, 64, F16)["CHUNK"] == 32
    assert scan.fused_backward_config(64, 5, F16, {"CHUNK": 16})["CHUNK"] == 16
    assert scan.fused_backward_config(64, 64, F32, precision="tf32")["CHUNK"] == 32
    for D, E, dtype in ((65, 16, BF16), (16, 65, F16), (16, 16, F32), (65, 16, F32)):
        assert scan.fused_backward_config(D, E, dtype, precision="tf32" if D > 64 else None) is None, (D, E, dtype)
    for precision in ("tf32x3", "bf16x3_manual"):
        assert scan.fused_backward_config(64, 64, F32, precision=precision) is None


def test_the_split_needs_outputs_of_split_min_elements_or_more():
    """float32 calls take the bfloat16 split only where each output holds at least
    SPLIT_MIN_ELEMENTS elements (heads * min(B * T * min(D, E), sequences * D * E)): exactly
    1024 qualifies, 1023 does not."""
    assert scan.SPLIT_MIN_ELEMENTS == 1024
    q, v = torch.empty(1, 1, 32, 32), torch.empty(1, 1, 32, 32)
    assert scan.split_is_accurate(q, v, 1)       # min(32 * 32, 32 * 32) = 1024
    q, v = torch.empty(1, 1, 31, 33), torch.empty(1, 1, 31, 33)
    assert not scan.split_is_accurate(q, v, 1)   # min(31 * 33, 33 * 33) = 1023
