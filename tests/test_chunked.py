"""The chunked kernel family: forward, backward and compilation, against float64 references.

Most cases pass ``SMALL_CHUNKS`` (16-token chunks, 16-column value blocks) so that the CPU
interpreter stays quick and several chunks are crossed; the cases through ``causal_product``
use the wrapper's own rule.
"""

import itertools

import pytest
import torch
import triton

import ttx_tutorial
from ttx_tutorial.kernels import chunked
from test_ops import normalized64
from ttx_tutorial.testing import (assert_close, poisoned_allocations, random_inputs, reference, reference_gradients,
                                  relative_error)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMALL_CHUNKS = {"BLOCK_E": 16, "CHUNK": 16, "num_warps": 4, "num_stages": 2}
C = SMALL_CHUNKS["CHUNK"]

# (T, D, E, with initial state): empty, one token, either side of a chunk boundary, a partial
# third chunk; D != E, sizes that are not powers of two, and one near the 256 limit.
SHAPES = [
    (0, 5, 7, True),
    (1, 5, 7, False),
    (C - 1, 24, 5, True),
    (C + 1, 16, 33, False),
    (2 * C + 3, 65, 24, True),
    (C + 3, 256, 250, False),
]


def _ids(shape):
    T, D, E, with_state = shape
    return f"T{T}-D{D}-E{E}" + ("-S0" if with_state else "")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_matches_float64_reference(shape, dtype, device):
    T, D, E, with_state = shape
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=dtype, device=device, seed=T + D, initial_state=True)
    s0 = s0 if with_state else None
    with poisoned_allocations():
        o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
    ref_o, ref_state = reference(q, k, v, s0)
    assert o.dtype == dtype and final_state.dtype == torch.float32
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:5], ids=_ids)
def test_gradients_match_float64_autograd(shape, dtype, device):
    T, D, E, with_state = shape
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=dtype, device=device, seed=T + E,
                                initial_state=True, requires_grad=True)
    s0 = s0 if with_state else None
    grad_o = torch.randn(1, 2, T, E, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grad_final_state = torch.randn(1, 2, D, E, generator=torch.Generator().manual_seed(2)).to(device)
    with poisoned_allocations():
        o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
        torch.autograd.backward((o, final_state), (grad_o, grad_final_state))
    ref_s0 = torch.zeros(1, 2, D, E) if s0 is None else s0
    expected = list(reference_gradients(q, k, v, ref_s0, grad_o, grad_final_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv"), (q, k, v), expected):
        assert x.grad.dtype == dtype
        assert_close(x.grad, ref, dtype, name)
    if s0 is not None:
        assert s0.grad.dtype == torch.float32
        assert_close(s0.grad, expected[3], dtype, "d initial state")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D, E", [(64, 64), (33, 20)])
def test_fused_backward_across_chunks(D, E, dtype, device, monkeypatch):
    """16-bit heads up to 64 wide take the fused backward (one launch for dQ, dK, dV and dS_0);
    checked over several chunks, with an initial state and a gradient reaching the final state."""
    fused_calls = []
    launch_backward = chunked._launch_backward
    monkeypatch.setattr(chunked, "_launch_backward",
                        lambda *args, **kwargs: fused_calls.append(1) or launch_backward(*args, **kwargs))
    T = 3 * C + 5
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=dtype, device=device, seed=D + E,
                                initial_state=True, requires_grad=True)
    grad_o = torch.randn(1, 2, T, E, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    grad_final_state = torch.randn(1, 2, D, E, generator=torch.Generator().manual_seed(4)).to(device)
    with poisoned_allocations():
        o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
        torch.autograd.backward((o, final_state), (grad_o, grad_final_state))
    assert fused_calls == [1]
    expected = list(reference_gradients(q, k, v, s0, grad_o, grad_final_state)[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "d initial state"), (q, k, v, s0), expected):
        assert_close(x.grad, ref, dtype, name)


@pytest.mark.parametrize("used", ["o", "final state"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-S0", "S0"])
def test_fused_backward_with_absent_gradients(used, with_state, device):
    """The fused backward's flags: q needs no gradient (no dQ walk), and only one output is used,
    so autograd passes None for the other (G = 0, or dO = 0)."""
    T, D, E = 2 * C + 7, 24, 40
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=torch.bfloat16, device=device, seed=9,
                                initial_state=True)
    s0 = s0.requires_grad_() if with_state else None
    for x in (k, v):
        x.requires_grad_()
    grad_o = torch.randn(1, 2, T, E, generator=torch.Generator().manual_seed(5)).to(device, q.dtype)
    grad_final_state = torch.randn(1, 2, D, E, generator=torch.Generator().manual_seed(6)).to(device)
    with poisoned_allocations():
        o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
        if used == "o":
            o.backward(grad_o)
            grad_final_state = torch.zeros_like(grad_final_state)
        else:
            final_state.backward(grad_final_state)
            grad_o = torch.zeros_like(grad_o)
    assert q.grad is None
    ref_s0 = torch.zeros(1, 2, D, E) if s0 is None else s0
    expected = list(reference_gradients(q, k, v, ref_s0, grad_o, grad_final_state)[2].values())
    for name, x, ref in zip(("dk", "dv", "d initial state"), (k, v, s0), expected[1:]):
        if x is not None:
            assert_close(x.grad, ref, torch.bfloat16, name)


def _backward_gradients(q, k, v, s0, grad_o, grad_final_state, normalized, feature_map):
    leaves = [x.detach().clone().requires_grad_(x is not q or grad_o is not None) for x in (q, k, v, s0)]
    leaves[0].requires_grad_(normalized != "no dq")
    with poisoned_allocations():
        if normalized in ("plain", "no dq"):
            o, state = chunked.chunked_causal_product(*leaves, config=SMALL_CHUNKS)
        else:
            features = None
            if feature_map != "identity":
                features = (feature_map, *(torch.nn.functional.elu(x.detach().float()).add(1).to(x.dtype)
                                           for x in leaves[:2]))
            o, state = chunked._run_normalized_validated(*leaves, 1e-6, SMALL_CHUNKS, features)
        torch.autograd.backward((o, state), (grad_o, grad_final_state))
    return [x.grad for x in leaves]


def _single_and_split(monkeypatch, gradients):
    """``gradients()`` with the fused backward's reverse walk as one program, then as two
    (SPLIT_WALKS): on a GPU the rule itself splits at the tests' few heads."""
    plan = chunked._backward_plan
    results = []
    for split_walks in (False, True):
        monkeypatch.setattr(chunked, "_backward_plan", lambda *a, **kw: {**plan(*a, **kw), "SPLIT_WALKS": split_walks})
        results.append(gradients())
    return results


@pytest.mark.parametrize("case", ["plain", "no dq", "normalized identity", "normalized elu"])
@pytest.mark.parametrize("poison", [None, "q", "do"])
def test_fused_backward_split_walks_match_the_single_reverse_walk(case, poison, device, monkeypatch):
    """SPLIT_WALKS (dV and dK in two programs, each carrying R) computes each gradient with the
    operations of the single reverse walk: the same values, bit for bit. With an inf in an
    input each walk redoes token by token only the gradient it found non-finite (the single
    walk redoes both): the same non-finite positions, and elsewhere values within bfloat16's
    tolerance of each other. An inf in q (as one in v) spoils only dK's chunk products, one in dO
    (as one in k) dV's too, so each walk's redo is needed by some case."""
    normalized, _, feature_map = case.partition(" ")
    T, D, E = 3 * C + 5, 24, 40
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=torch.bfloat16, device=device, seed=11, initial_state=True)
    if normalized != "normalized":
        normalized = case
    else:
        q, k = q.abs(), k.abs()
        s0 = torch.cat([s0, torch.rand(1, 2, D, 1, device=device)], dim=-1)
    grad_o = torch.randn(1, 2, T, E, generator=torch.Generator().manual_seed(7)).to(device, q.dtype)
    if poison is not None:
        {"v": v, "q": q, "k": k, "do": grad_o}[poison][0, 1, T - C, 3] = float("inf")
    grad_final_state = torch.randn(s0.shape, generator=torch.Generator().manual_seed(8)).to(device)
    single, split = _single_and_split(monkeypatch, lambda: _backward_gradients(
        q, k, v, s0, grad_o, grad_final_state, normalized, feature_map or "identity"))
    for name, a, b in zip(("dq", "dk", "dv", "dS0"), single, split):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if poison is None:
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=name)
        else:
            assert torch.equal(a.isfinite(), b.isfinite()) and torch.equal(a.isnan(), b.isnan()), name
            finite = a.isfinite()
            assert relative_error(b[finite], a[finite]) < 2e-2, name


@pytest.mark.parametrize("with_dq", [True, False], ids=["dq", "no dq"])
@pytest.mark.parametrize("with_final_grad", [True, False], ids=["G", "no G"])
def test_fused_backward_split_walks_match_with_packed_sequences(with_dq, with_final_grad, device, monkeypatch):
    """Packed sequences (one of them empty) through the split walks: each program row takes its
    sequence's tokens and state, and the gradients equal the single walk's bit for bit, with and
    without dQ's walk and the gradient of the final states."""
    lengths = (7, 2 * C + 3, 0, C + 5)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    q, k, v = random_inputs(1, 2, sum(lengths), 24, 40, dtype=torch.bfloat16, device=device, seed=13)
    s0 = torch.randn(len(lengths), 2, 24, 40, generator=torch.Generator().manual_seed(14)).to(device)
    grad_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(15)).to(device, v.dtype)
    grad_final_state = torch.randn(s0.shape, generator=torch.Generator().manual_seed(16)).to(device)

    def gradients():
        leaves = [x.detach().clone().requires_grad_(x is not q or with_dq) for x in (q, k, v, s0)]
        with poisoned_allocations():
            o, state = chunked.chunked_causal_product(*leaves, config=SMALL_CHUNKS, cu_seqlens=cu_seqlens)
            if with_final_grad:
                torch.autograd.backward((o, state), (grad_o, grad_final_state))
            else:
                o.backward(grad_o)
        return [x.grad for x in leaves]

    for name, a, b in zip(("dq", "dk", "dv", "dS0"), *_single_and_split(monkeypatch, gradients)):
        assert (a is None) == (b is None) == (name == "dq" and not with_dq), name
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_fused_backward_rule():
    assert chunked.fused_backward_config(64, 64, torch.bfloat16)["CHUNK"] == 64
    assert chunked.fused_backward_config(64, 64, torch.float16)["CHUNK"] == 32  # 64 would spill
    assert chunked.fused_backward_config(64, 64, torch.float16, SMALL_CHUNKS)["CHUNK"] == C
    assert chunked.fused_backward_config(65, 64, torch.bfloat16) is None  # BLOCK_D = 128
    # float32 only as one TF32 product ("high", "medium"): "highest"'s split takes the passes
    assert chunked.fused_backward_config(64, 64, torch.float32) is None
    for precision in ("bf16x3_manual", "tf32x3"):
        assert chunked.fused_backward_config(64, 64, torch.float32, precision=precision) is None
    assert chunked.fused_backward_config(64, 64, torch.float32, precision="tf32")["CHUNK"] == 32
    assert chunked.fused_backward_config(128, 64, torch.float32, precision="tf32") is None
    # 4 stages of loads, 3 for the normalised backward (two programs then share a multiprocessor)
    assert chunked.fused_backward_config(64, 64, torch.bfloat16)["num_stages"] == 4
    assert chunked.fused_backward_config(64, 64, torch.bfloat16, normalize=True)["num_stages"] == 3
    # SPLIT_WALKS only where all three programs of every head find a multiprocessor of their own
    assert not chunked.fused_backward_config(64, 64, torch.bfloat16)["SPLIT_WALKS"]
    for heads, split in ((1, True), (8, True), (44, True), (45, False), (128, False)):
        fused = chunked.fused_backward_config(64, 64, torch.bfloat16, heads=heads, multiprocessors=132)
        assert fused["SPLIT_WALKS"] is split, heads
    # float32's plain product takes the fused backward only where its walks split; the normalised
    # backward takes it at any number of heads
    for heads, fused in ((8, True), (44, True), (45, False), (128, False)):
        plain = chunked.fused_backward_config(64, 64, torch.float32, heads=heads, multiprocessors=132, precision="tf32")
        assert (plain is not None) is fused, heads
        assert chunked.fused_backward_config(64, 64, torch.float32, heads=heads, multiprocessors=132,
                                             precision="tf32", normalize=True) is not None, heads
    limits = (132, chunked._NOMINAL_LIMITS[1])
    assert chunked._backward_plan(128, 4096, 64, 64, torch.float32, limits, False, (), precision="tf32") is None
    assert chunked._backward_plan(128, 4096, 64, 64, torch.float32, limits, True, (), precision="tf32") is not None
    assert chunked._backward_plan(8, 4096, 64, 64, torch.bfloat16, limits, False, ())["SPLIT_WALKS"]
    assert not chunked._backward_plan(8, 4096, 64, 64, torch.bfloat16, limits, True, ())["SPLIT_WALKS"]


def test_gradients_only_for_inputs_that_need_them(device):
    """Only k needs a gradient: the other passes are skipped and dk is still right."""
    q, k, v, s0 = random_inputs(1, 1, 2 * C + 3, 8, 12, device=device, seed=3, initial_state=True)
    k.requires_grad_()
    o, _ = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
    o.sum().backward()
    expected = list(reference_gradients(q, k, v, s0, torch.ones_like(o), torch.zeros_like(s0))[2].values())
    assert q.grad is None and v.grad is None
    assert_close(k.grad, expected[1], torch.float32, "dk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(dtype, device):
    """q in (B, T, H, D) memory order, k every other token, v a slice of wider rows."""
    B, H, T, D, E = 2, 3, 2 * C + 5, 12, 20
    generator = torch.Generator().manual_seed(4)

    def draw(*shape):
        return (torch.randn(*shape, generator=generator) * 0.3).to(device, dtype)

    q = draw(B, T, H, D).transpose(1, 2)
    k = draw(B, H, 2 * T, D)[:, :, ::2]
    v = draw(B, H, T, E + 9)[..., 3:3 + E]
    s0 = torch.randn(B, H, E, D, generator=generator).to(device).transpose(-1, -2)
    for x in (q, k, v, s0):
        assert not x.is_contiguous()
        x.requires_grad_()
    o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
    ref_o, ref_state = reference(q, k, v, s0)
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")
    # o.sum() gives a gradient with stride 0 along every axis.
    (o.sum() + final_state.sum()).backward()
    expected = list(reference_gradients(q, k, v, s0, torch.ones(B, H, T, E), torch.ones(B, H, D, E))[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "d initial state"), (q, k, v, s0), expected):
        assert_close(x.grad, ref, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_product_api_with_the_default_rule(dtype, device):
    """Through ttx_tutorial.causal_product, with the wrapper's own configuration (D != E, so the
    backward passes, which swap D and E, choose their own), forward and backward."""
    q, k, v, s0 = random_inputs(1, 2, 130, 32, 48, dtype=dtype, device=device, seed=5,
                                initial_state=True, requires_grad=True)
    with poisoned_allocations():
        o, final_state = ttx_tutorial.causal_product(q, k, v, method="chunked", initial_state=s0,
                                                     return_state=True)
        (o.float().square().sum() + final_state.sum()).backward()
    ref_o, ref_state = reference(q, k, v, s0)
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")
    expected = list(reference_gradients(q, k, v, s0, 2 * o.detach().float(), torch.ones_like(ref_state))[2].values())
    for name, x, ref in zip(("dq", "dk", "dv", "d initial state"), (q, k, v, s0), expected):
        assert_close(x.grad, ref, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("beyond", ["state", "scores"])
def test_intermediates_beyond_float16_range(beyond, dtype, device):
    """A state of ~1e5, or scores q.k of 1.6e5, exceed float16's 65504 while the inputs and the
    outputs fit: the kernel must not round them to float16 (float16 inputs) on the way."""
    B, H, T, D, E = 1, 1, C + 4, 4, 16
    generator = torch.Generator().manual_seed(6)
    if beyond == "state":
        q = torch.randn(B, H, T, D, generator=generator).mul(1e-3).to(device, dtype)
        k = torch.randn(B, H, T, D, generator=generator).to(device, dtype)
        v = torch.randn(B, H, T, E, generator=generator).to(device, dtype)
        s0 = torch.randn(B, H, D, E, generator=generator).mul(1e5).to(device)
    else:
        q = torch.full((B, H, T, D), 200.0, dtype=dtype, device=device)
        k = torch.full((B, H, T, D), 200.0, dtype=dtype, device=device)
        v = torch.randn(B, H, T, E, generator=generator).mul(1e-4).to(device, dtype)
        s0 = None
    o, final_state = chunked.chunked_causal_product(q, k, v, s0, config=SMALL_CHUNKS)
    ref_o, ref_state = reference(q, k, v, s0)
    assert ref_o.abs().max() < 6e4  # the true output fits float16
    assert_close(o, ref_o, dtype, "o")
    assert_close(final_state, ref_state, dtype, "final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_sequences_sum_the_state_with_a_carry(dtype, device, monkeypatch):
    """Past ``COMPENSATED_FROM_CHUNKS`` chunks the state adds each chunk's product with a Kahan
    carry. Here from the first chunk on: a state of 2**24, whose float32 unit in the last place is
    2, gets 1 from every chunk (k = 1, v = 1 / CHUNK), which a plain float32 sum rounds away every
    time (2**24 + 1 is a tie, rounded to even); with the carry the final state holds every one."""
    monkeypatch.setattr(chunked, "COMPENSATED_FROM_CHUNKS", 0)
    chunked._launch_plan.cache_clear()  # plans made before hold the threshold they were made with
    try:
        chunks, chunk, D, E = 12, 16, 16, 16
        k = torch.ones(1, 1, chunks * chunk, D, dtype=dtype, device=device)
        v = torch.full((1, 1, chunks * chunk, E), 1 / chunk, dtype=dtype, device=device)
        s0 = torch.full((1, 1, D, E), 2.0 ** 24, device=device)
        _, final_state = chunked.chunked_causal_product(k, k, v, s0, config={"CHUNK": chunk, "BLOCK_E": 16})
    finally:
        chunked._launch_plan.cache_clear()
    assert torch.equal(final_state - 2.0 ** 24, torch.full_like(final_state, float(chunks)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_sequences_sum_the_normaliser_with_a_carry(dtype, device, monkeypatch):
    """The normalised forward carries z, the sum of the keys, beside the state, and past
    ``COMPENSATED_FROM_CHUNKS`` chunks adds each chunk's keys to it with a Kahan carry of its own.
    Here from the first chunk on: a z_0 of 2**24 (float32's unit in the last place is 2) gets 1
    from every chunk (k = 1 / CHUNK), which a plain float32 sum rounds away every time; with the
    carry the final z holds every one, as the state beside it does."""
    monkeypatch.setattr(chunked, "COMPENSATED_FROM_CHUNKS", 0)
    chunked._launch_plan.cache_clear()  # plans made before hold the threshold they were made with
    try:
        chunks, chunk, D, E = 12, 16, 16, 16
        k = torch.full((1, 1, chunks * chunk, D), 1 / chunk, dtype=dtype, device=device)
        v = torch.ones(1, 1, chunks * chunk, E, dtype=dtype, device=device)
        s0 = torch.full((1, 1, D, E + 1), 2.0 ** 24, device=device)
        _, final_state = chunked.chunked_normalized_attention(k, k, v, s0, config={"CHUNK": chunk, "BLOCK_E": 16})
    finally:
        chunked._launch_plan.cache_clear()
    assert torch.equal(final_state - 2.0 ** 24, torch.full_like(final_state, float(chunks)))


def test_the_carry_starts_past_the_threshold_counting_a_partial_chunk():
    """The state is summed with a carry beyond ``COMPENSATED_FROM_CHUNKS`` chunks, a partial last
    chunk counted as one (it is walked like the others): not at exactly that many chunks, but
    with one token more."""
    limit = chunked.COMPENSATED_FROM_CHUNKS
    for chunk in (16, 64):
        assert not chunked._compensated(limit * chunk, chunk)
        assert chunked._compensated(limit * chunk + 1, chunk)


def test_unknown_config_key_is_refused(device):
    q, k, v = random_inputs(1, 1, 4, 8, dtype=torch.float32, device=device, seed=8)
    with pytest.raises(ValueError, match="BLOCK_e"):
        chunked.chunked_causal_product(q, k, v, config={"BLOCK_e": 32})


@pytest.mark.parametrize("shared_memory", [chunked._NOMINAL_LIMITS[1], 166912, 101376])
def test_default_config_fits_the_shared_memory_it_is_given(shared_memory):
    """H100/H200, A100 and RTX 4090 budgets: the rule's own estimate must fit each."""
    for dtype in DTYPES:
        for D in (1, 16, 100, 128, 256):
            for E in (1, 64, 256):
                config = chunked.default_config(D, E, dtype, shared_memory=shared_memory)
                assert chunked._shared_memory_estimate(chunked._block(D), config, dtype) <= shared_memory


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_default_config_splits_value_blocks_only_for_few_heads(dtype):
    """With fewer programs than half the multiprocessors the value block is halved (down to 32
    columns); with many heads it is left whole, so that q and k are read once per head."""
    for D, E in ((64, 64), (128, 128), (100, 200)):
        whole = chunked.default_config(D, E, dtype)["BLOCK_E"]
        assert chunked.default_config(D, E, dtype, heads=1024, multiprocessors=132)["BLOCK_E"] == whole
        for heads in (1, 8, 32, 64):
            block_e = chunked.default_config(D, E, dtype, heads=heads, multiprocessors=132)["BLOCK_E"]
            assert block_e <= whole
            assert block_e == 32 or 2 * heads * triton.cdiv(E, block_e) >= 132
            # and no further: twice the columns left the programs fewer than half the multiprocessors
            assert block_e == whole or 2 * heads * triton.cdiv(E, 2 * block_e) < 132, (D, E, heads)


def test_default_config_bfloat16_takes_4_warps_up_to_64_state_registers_a_thread():
    """bfloat16's rule: 4 warps while the state takes at most 64 float32 registers a thread
    (BLOCK_D * BLOCK_E <= 8192 over 128 threads). Its largest tiles, 128 x 64 and, past D = 128,
    256 x 32, sit exactly at that bound."""
    for D, E in ((64, 64), (128, 64), (128, 256), (256, 256)):
        config = chunked.default_config(D, E, torch.bfloat16)
        assert chunked._block(D) * config["BLOCK_E"] <= 8192
        assert config["num_warps"] == 4, (D, E, config)


@pytest.mark.parametrize("shared_memory", [chunked._NOMINAL_LIMITS[1], 166912, 101376])
def test_fused_backward_config_fits_the_shared_memory_it_is_given(shared_memory):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for D, E in ((1, 1), (16, 64), (64, 64)):
            for normalize in (False, True):
                fused = chunked.fused_backward_config(D, E, dtype, shared_memory=shared_memory, normalize=normalize,
                                                      precision="tf32")
                assert chunked._fused_backward_shared_memory(fused, dtype, normalize) <= shared_memory


@pytest.mark.parametrize("scan_chunks", [64, 2], ids=["one scan step", "steps of two chunks"])
@pytest.mark.parametrize("with_final_grad", [True, False], ids=["G", "no G"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_normalized_backward_dz_per_chunk_matches_float64(dtype, with_final_grad, scan_chunks, device, monkeypatch):
    """The fused normalised backward's reverse walk reads dz after each of its chunks (64 tokens for
    bfloat16, 32 for float16 and float32 under "high"), made by ``chunk_suffix_sums_kernel`` from
    the r kernel's sums over the same chunks: dk, which takes dz, and dS_0's z column, which is
    dz_0, against float64 across a partial last chunk, with G's z column or without. The chunks are
    scanned in one step, or in steps of two with a partial last step, so the carry between steps is
    exercised."""
    monkeypatch.setattr(chunked, "SUFFIX_SCAN_CHUNKS", scan_chunks)
    T, D, E = 4 * 64 + 5, 16, 24
    q, k, v, s0 = random_inputs(1, 2, T, D, E, dtype=dtype, device=device, seed=21, initial_state=True)
    q, k = q.abs(), k.abs()
    s0 = torch.cat([s0, torch.rand(1, 2, D, 1, device=device)], dim=-1)
    grad_o = torch.randn(1, 2, T, E, generator=torch.Generator().manual_seed(22)).to(device, dtype)
    grad_final_state = torch.randn(s0.shape, generator=torch.Generator().manual_seed(23)).to(device)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # float32's fused backward: one TF32 product
    try:
        with poisoned_allocations():
            o, state = chunked._run_normalized_validated(*leaves, 1e-6)
            torch.autograd.backward((o, state) if with_final_grad else (o,),
                                    (grad_o, grad_final_state) if with_final_grad else (grad_o,))
    finally:
        torch.set_float32_matmul_precision(before)
    if dtype == torch.float32 and not ttx_tutorial.INTERPRETED:
        dtype = torch.float16  # TF32 keeps float16's significand: its tolerance
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    o64, state64, _ = normalized64(*leaves64, 1e-6)
    torch.autograd.backward((o64, state64) if with_final_grad else (o64,),
                            (grad_o.double(), grad_final_state.double()) if with_final_grad else (grad_o.double(),))
    assert_close(leaves[1].grad, leaves64[1].grad, dtype, "dk")
    assert_close(leaves[3].grad[..., E], leaves64[3].grad[..., E], dtype, "dz_0")
