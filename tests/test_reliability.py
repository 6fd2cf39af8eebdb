"""No silent wrong answers: double backward, negative-bit views, non-finite values and causality,
clear errors for bad configs and layouts, threads, and kernel files that check their own inputs.

Each test here failed before its fix, except the undefined-lanes test, which guards a property
the kernels have (it fails when a load of chunked's keys drops its ``other=0.0``).
"""

from __future__ import annotations

import ast
import itertools
import math
import re
import shutil
import sys
import warnings
import threading
from pathlib import Path

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS
from test_validation import BAD_CALLS
from ttx_tutorial import causal_product, references, testing
from ttx_tutorial.testing import run_python
from ttx_tutorial.kernels import chunked, recurrent, scan

KERNEL_FUNCTIONS = {
    "recurrent": recurrent.recurrent_causal_product,
    "chunked": chunked.chunked_causal_product,
    "scan": scan.scan_causal_product,
}
KERNEL_FILES = {name: Path(module.__file__) for name, module in
                (("recurrent", recurrent), ("chunked", chunked), ("scan", scan))}
TRITON_AND_AUTO = (*TRITON_METHODS, "auto")


# --------------------------------------------------------------------------- double backward

@pytest.mark.parametrize("loss", [lambda o: o.sum(), lambda o: (o**2).sum()], ids=["sum", "squares"])
@pytest.mark.parametrize("entry", ["causal_product", "causal_linear_attention", "kernel_file"])
@pytest.mark.parametrize("method", TRITON_AND_AUTO)
def test_a_gradient_of_a_gradient_is_refused_not_silently_zero(method, entry, loss, device):
    """create_graph=True needs the backward's own dependence on q, k and v, which the kernels'
    backward lacks: refused at once. With o.sum() the incoming gradient needs no graph itself, and
    a backward left untracked would hand back gradients that silently miss every second-order term."""
    if entry == "kernel_file" and method == "auto":
        pytest.skip("no kernel file is called auto")
    q, k, v = testing.random_inputs(1, 2, 20, 8, 8, device=device, seed=1, requires_grad=True)
    run = {"causal_product": lambda: causal_product(q, k, v, method),
           "causal_linear_attention": lambda: ttx_tutorial.causal_linear_attention(q, k, v, method=method),
           "kernel_file": lambda: KERNEL_FUNCTIONS[method](q, k, v)[0]}[entry]
    with pytest.raises(RuntimeError, match=r"create_graph=True\) is not supported"):
        torch.autograd.grad(loss(run()), (q,), create_graph=True)
    (dq,) = torch.autograd.grad(loss(run()), (q,))  # a first-order gradient as before
    assert dq.shape == q.shape


def test_the_references_keep_their_second_order(device):
    q, k, v = testing.random_inputs(1, 2, 9, 4, 3, device=device, seed=21, dtype=torch.float64, requires_grad=True)
    (dq,) = torch.autograd.grad(causal_product(q, k, v, "cumsum").sum(), (q,), create_graph=True)
    assert dq.requires_grad


# --------------------------------------------------------------------------- negative-bit views

def negative_bit_view(x):
    """A float32 view of x whose storage holds -x: the imaginary part of a conjugated complex tensor."""
    view = torch.complex(torch.zeros_like(x), -x).conj().imag
    assert view.is_neg() and torch.equal(view.resolve_neg(), x)
    return view


@pytest.mark.parametrize("argument", ["q", "k", "v", "initial_state"])
@pytest.mark.parametrize("method", TRITON_AND_AUTO)
def test_negative_bit_views_are_read_as_their_values(method, argument, device):
    inputs = dict(zip(("q", "k", "v", "initial_state"),
                      testing.random_inputs(1, 2, 21, 8, 12, device=device, seed=2, initial_state=True)))
    leaf = inputs[argument].clone().requires_grad_()
    passed = {**inputs, argument: negative_bit_view(leaf)}  # in the graph: gradients reach the leaf
    assert passed[argument].is_neg()
    ref_o, ref_state = testing.reference(*inputs.values())
    with testing.poisoned_allocations():
        o, state = causal_product(passed["q"], passed["k"], passed["v"], method,
                                  initial_state=passed["initial_state"], return_state=True)
    testing.assert_close(o, ref_o, torch.float32, "o")
    testing.assert_close(state, ref_state, torch.float32, "S_T")
    (grad,) = torch.autograd.grad(o.sum() + state.sum(), (leaf,))
    up = {name: x.detach().double().requires_grad_(name == argument) for name, x in inputs.items()}
    (ref_grad,) = torch.autograd.grad(sum(r.sum() for r in references.quadratic(*up.values())), (up[argument],))
    testing.assert_close(grad, ref_grad, torch.float32, f"d{argument}")


# --------------------------------------------------------------------------- non-finite values

T, LATE = 40, 21  # garbage from token LATE on, inside a chunk of every method


def padded(device, argument, garbage, dtype=torch.float32):
    q, k, v = (x.clone() for x in testing.random_inputs(1, 2, T, 8, 8, device=device, seed=3, dtype=dtype))
    dict(q=q, k=k, v=v)[argument][:, :, LATE:] = garbage
    return q, k, v


def outputs_and_gradients_before(method, q, k, v):
    """o of the tokens before LATE, and the gradients of q, k, v there for a fixed upstream
    gradient that is zero from LATE on (as a padded batch masks its loss)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = causal_product(*leaves, method)
    grad_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)).to(o.device, o.dtype)
    grad_o[:, :, LATE:] = 0
    o.backward(grad_o)
    return o.detach()[:, :, :LATE], {name: x.grad[:, :, :LATE] for name, x in zip("qkv", leaves)}


def expected_before(q, k, v):
    """The same in float64 with the padding zeroed: what the tokens before LATE get if nothing
    crosses from the padding."""
    clean = (torch.where(torch.isfinite(x), x, 0).double() for x in (q, k, v))
    return outputs_and_gradients_before("cumsum", *clean)


# float32 takes the chunked backward through three forward launches, bfloat16 the fused kernels.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("argument, garbage", [("k", math.inf), ("k", math.nan), ("v", -math.inf), ("v", math.nan)],
                         ids=["k-inf", "k-nan", "v--inf", "v-nan"])
@pytest.mark.parametrize("method", (*ttx_tutorial.METHODS, "auto"))
def test_non_finite_padding_leaves_earlier_tokens_exact(method, argument, garbage, dtype, device):
    q, k, v = padded(device, argument, garbage, dtype)
    o, grads = outputs_and_gradients_before(method, q, k, v)
    ref_o, ref_grads = expected_before(q, k, v)
    testing.assert_close(o, ref_o, dtype, "o before the padding")
    for name, grad in grads.items():
        testing.assert_close(grad, ref_grads[name], dtype, f"d{name} before the padding")


def run_with_gradients(method, q, k, v, grad_o):
    """(o, S_T, dq, dk, dv) of ``method`` for the upstream gradient grad_o, with poisoned outputs."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with testing.poisoned_allocations():
        o, state = causal_product(*leaves, method, return_state=True)
        o.backward(grad_o.to(o.device, o.dtype))
    return o.detach(), state.detach(), *(x.grad for x in leaves)


def assert_same_results(label, names, found, expected, dtype, tolerances=None):
    """Each found result is non-finite exactly where its float64 reference is, and within
    ``dtype``'s tolerance of it elsewhere (``tolerances``: other ones, by name)."""
    for name, out, ref in zip(names, found, expected):
        out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
        assert torch.equal(torch.isfinite(out), torch.isfinite(ref)), (
            f"{label} {name}: non-finite at {(~torch.isfinite(out) & torch.isfinite(ref)).nonzero()[:5].tolist()} "
            f"where the reference is finite, finite at {(torch.isfinite(out) & ~torch.isfinite(ref)).nonzero()[:5].tolist()} "
            "where it is not")
        finite = torch.isfinite(ref)
        assert finite.any(), f"{label} {name}: nothing finite left to compare"
        tolerance = (tolerances or {}).get(name, testing.TOLERANCES[dtype])
        error = testing.relative_error(out[finite], ref[finite])
        assert error <= tolerance, f"{label} {name} where finite: {error:.3e} > {tolerance:.0e}"


def assert_same_non_finite_positions(method, q, k, v, grad_o, dtype):
    """Every result of ``method`` is non-finite exactly where ``cumsum``'s in float64 on the same
    values is (it adds each token only to later states), and within ``dtype``'s tolerance elsewhere."""
    found = run_with_gradients(method, q, k, v, grad_o)
    expected = run_with_gradients("cumsum", *(x.detach().double() for x in (q, k, v, grad_o)))
    assert_same_results(method, ("o", "S_T", "dq", "dk", "dv"), found, expected, dtype)


def with_garbage(B, H, T, D, E, dtype, device, argument, garbage, token, seed):
    """Fresh inputs and upstream gradient with ``garbage`` at one entry of ``argument`` (q, k, v or
    do) at ``token``: a late token inside a chunk, so that earlier tokens of that chunk would see it."""
    q, k, v = (x.clone() for x in testing.random_inputs(B, H, T, D, E, dtype=dtype, device=device, seed=seed))
    grad_o = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    column = min(3, (D if argument in "qk" else E) - 1)
    dict(q=q, k=k, v=v, do=grad_o)[argument][:, -1, token, column] = garbage
    return q, k, v, grad_o


#: (B, H, T, D, E, dtype, token): the fused backwards of chunked and scan at an odd head (32 x 48)
#: and at 64, the three-launch backward at 128 (bfloat16), float16's 32-token chunks, float32's
#: 16-token chunks and scan's short segments at a small head; the garbage sits at ``token``, late
#: in a chunk of every kernel.
NON_FINITE_CASES = [
    (1, 2, 130, 32, 48, torch.bfloat16, 100),
    (1, 1, 130, 64, 64, torch.bfloat16, 120),
    (1, 1, 70, 128, 128, torch.bfloat16, 60),
    (1, 1, 100, 64, 64, torch.float16, 90),
    (2, 1, 130, 8, 8, torch.float32, 107),
]


#: Garbage in each input. One in q or v spoils only the chunk products of dK, one in k or dO
#: those of dV too (see test_chunked.py): each case takes one of each kind, pairs in turn.
NON_FINITE_GARBAGE = {"q": math.inf, "k": math.nan, "v": math.inf, "do": math.nan}
NON_FINITE_PAIRS = [("q", "k"), ("v", "do"), ("q", "do"), ("v", "k")]


def _non_finite_cases():
    for i, case in enumerate(NON_FINITE_CASES):
        for argument in NON_FINITE_PAIRS[i % len(NON_FINITE_PAIRS)]:
            garbage = NON_FINITE_GARBAGE[argument]
            yield pytest.param(case, argument, garbage, id=f"{case[:5]}-{str(case[5])[6:]}-{argument}-{garbage}")


@pytest.mark.parametrize("case, argument, garbage", list(_non_finite_cases()))
@pytest.mark.parametrize("method", ["chunked", "scan"])  # recurrent walks tokens: no masked product
def test_non_finite_values_reach_exactly_the_references_positions(method, case, argument, garbage, device):
    *shape, dtype, token = case
    q, k, v, grad_o = with_garbage(*shape, dtype, device, argument, garbage, token, seed=4)
    assert_same_non_finite_positions(method, q, k, v, grad_o, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head", [(32, 48), (64, 64), (128, 128)], ids=str)
@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_non_finite_values_reach_exactly_the_references_positions_at_gpu_sizes(method, head, dtype, device):
    """Several heads and chunks, the garbage at a drawn token: the fused backwards' full tiles."""
    arguments = itertools.product(("q", "k", "v", "do"), (math.inf, -math.inf, math.nan))
    for seed, (argument, garbage) in enumerate(arguments):
        token = int(torch.randint(1, 1000, (1,), generator=torch.Generator().manual_seed(seed)))
        q, k, v, grad_o = with_garbage(2, 2, 1000, *head, dtype, device, argument, garbage, token, seed=seed)
        assert_same_non_finite_positions(method, q, k, v, grad_o, dtype)


def normalized_with_gradients(q, k, v, grad_o, s0=None, *, reference):
    """(out, S_T, dq, dk, dv[, dS_0]) of chunked's normalised attention (eps 1e-6) from the state
    ``s0`` ((B, H, D, E + 1), z last; None: zeros), or of its float64 reference: ``cumsum`` on v
    with a column of ones appended, whose last output column is the denominator q_t . z_t."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if s0 is not None:
        leaves.append(s0.detach().clone().requires_grad_())
    state0 = leaves[3] if s0 is not None else None
    with testing.poisoned_allocations():
        if reference:
            ones = torch.ones_like(leaves[2][..., :1])
            extended, state = references.cumsum(leaves[0], leaves[1], torch.cat([leaves[2], ones], -1), state0)
            out = extended[..., :-1] / (extended[..., -1:] + 1e-6)
        else:
            out, state = chunked.chunked_normalized_attention(*leaves[:3], state0, eps=1e-6)
        out.backward(grad_o.to(out.device, out.dtype))
    return out.detach(), state.detach(), *(x.grad for x in leaves)


# bfloat16 takes the fused normalised backward, float32 the passes on g. With a start state the
# token-by-token walks that redo a block must start from its z_0 too.
@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_a_state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("argument, garbage", [("q", math.inf), ("k", math.nan), ("v", math.inf), ("do", math.nan)],
                         ids=["q-inf", "k-nan", "v-inf", "do-nan"])
def test_normalized_attention_keeps_non_finite_values_causal(argument, garbage, dtype, with_state, device):
    q, k, v, grad_o = with_garbage(1, 2, 70, 16, 16, dtype, device, argument, garbage, 60, seed=6)
    q, k = q.abs(), k.abs()  # positive features: denominators far from 0
    s0 = None
    if with_state:  # S_0 of a few earlier tokens, z_0 their positive key sums
        s0 = torch.randn(1, 2, 16, 17, generator=torch.Generator().manual_seed(7)).to(device)
        s0[..., -1] = s0[..., -1].abs() + 2
    found = normalized_with_gradients(q, k, v, grad_o, s0, reference=False)
    expected = normalized_with_gradients(*(x.detach().cpu().double() for x in (q, k, v, grad_o)),
                                         None if s0 is None else s0.cpu().double(), reference=True)
    names = ("out", "S_T", "dq", "dk", "dv") + (("dS_0",) if with_state else ())
    assert_same_results("normalised", names, found, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_normalized_outputs_redone_token_by_token_add_eps(dtype, device):
    """A forward program that met an inf redoes all its outputs one token at a time, dividing by
    q_t . z_t + eps there too. Queries whose features are all zero make the denominator eps alone
    (0 / eps = 0, NaN without eps), and small features elsewhere put eps (0.5) on the order of
    q_t . z_t: every output against float64 with the same eps, non-finite only where it is."""
    T, D, E, eps = 20, 4, 8, 0.5
    q, k, v = (x.clone() for x in testing.random_inputs(1, 2, T, D, E, dtype=dtype, device=device, seed=12))
    q, k = q.abs() * 0.1, k.abs() * 0.1
    q[:, :, ::3] = 0
    v[:, -1, T - 1, 2] = math.inf
    with torch.no_grad(), testing.poisoned_allocations():
        out, _ = chunked.chunked_normalized_attention(q, k, v, eps=eps)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    extended, _ = references.cumsum(q64, k64, torch.cat([v64, torch.ones_like(v64[..., :1])], -1))
    expected = extended[..., :-1] / (extended[..., -1:] + eps)
    assert_same_results("normalised", ("out",), (out,), (expected,), dtype)


#: Packed sequences (a batch of one), among them an empty one: the walks after the chunk loops
#: take their sequence's tokens from the offsets, and start from its initial state (forward, dq)
#: or from the final state's gradient (dk, dv).
PACKED_LENGTHS = (37, 0, 100, 23)


def packed_with_gradients(method, q, k, v, s0, cu_seqlens, grad_o, grad_state):
    """(o, S_T, dq, dk, dv, dS_0) of ``method`` on packed sequences, with poisoned outputs."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
    with testing.poisoned_allocations():
        o, state = causal_product(*leaves[:3], method, cu_seqlens=cu_seqlens, initial_state=leaves[3],
                                  return_state=True)
        torch.autograd.backward((o, state), (grad_o.to(o.device, o.dtype), grad_state.to(state.device, state.dtype)))
    return o.detach(), state.detach(), *(x.grad for x in leaves)


# float32 takes the three-launch backwards, bfloat16 the fused ones.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("argument, garbage", [("q", math.nan), ("k", math.inf), ("v", -math.inf), ("do", math.inf)],
                         ids=["q-nan", "k-inf", "v--inf", "do-inf"])
@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_packed_sequences_with_states_keep_non_finite_values_causal(method, argument, garbage, dtype, device):
    H, D, E = 2, 32, 48
    total = sum(PACKED_LENGTHS)
    q, k, v = testing.random_inputs(1, H, total, D, E, dtype=dtype, device=device, seed=8)
    s0 = torch.randn(len(PACKED_LENGTHS), H, D, E, generator=torch.Generator().manual_seed(9)).to(device)
    grad_o = torch.randn(1, H, total, E, generator=torch.Generator().manual_seed(10)).to(device, dtype)
    grad_state = torch.randn(s0.shape, generator=torch.Generator().manual_seed(11)).to(device)
    cu_seqlens = torch.tensor([0, *PACKED_LENGTHS], dtype=torch.int64).cumsum(0).to(device, torch.int32)
    token = 37 + 90  # late in a chunk (and a segment) of the third sequence, counted from its start
    dict(q=q, k=k, v=v, do=grad_o)[argument][:, -1, token, 3] = garbage
    found = packed_with_gradients(method, q, k, v, s0, cu_seqlens, grad_o, grad_state)
    expected = packed_with_gradients("cumsum", *(x.detach().cpu().double() for x in (q, k, v, s0)),
                                     cu_seqlens.cpu(), grad_o.cpu().double(), grad_state.cpu().double())
    assert_same_results(method, ("o", "S_T", "dq", "dk", "dv", "dS_0"), found, expected, dtype)


@pytest.mark.parametrize("method", (*ttx_tutorial.METHODS, "auto"))
def test_non_finite_q_stays_in_its_own_output(method, device):
    q, k, v = padded(device, "q", math.nan)
    o = causal_product(q, k, v, method)
    ref_o, _ = expected_before(q, k, v)
    testing.assert_close(o[:, :, :LATE], ref_o, torch.float32, "o before the padding")
    assert torch.isnan(o[:, :, LATE:]).all()


# --------------------------------------------------------------------------- undefined lanes

def _results(method, normalized, q, k, v, s0, grad_o, grad_state):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
    if normalized:
        outputs = (ttx_tutorial.causal_linear_attention(*leaves[:3], method=method),)
        cotangents = (grad_o,)
    else:
        outputs = causal_product(*leaves[:3], method, initial_state=leaves[3], return_state=True)
        cotangents = (grad_o, grad_state)
    grads = torch.autograd.grad(outputs, leaves if not normalized else leaves[:3], cotangents)
    return [x.detach() for x in (*outputs, *grads)]


@pytest.mark.parametrize("normalized", [False, True], ids=["plain with S_0", "normalised elu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_lanes_a_mask_switches_off_never_reach_a_result(method, dtype, normalized):
    """A GPU leaves the lanes of a masked load without ``other=`` undefined; the interpreter gives
    zeros, which would hide a kernel that uses them. With those lanes filled with NaN (the exercise
    checkers' watched loads), every output and gradient is bit for bit what it was without."""
    if not ttx_tutorial.INTERPRETED:
        pytest.skip("the interpreter's loads are watched; a GPU's undefined lanes cannot be set")
    from ttx_tutorial.exercises._harness import LOADS, watched_loads

    q, k, v, s0 = testing.random_inputs(1, 2, 21, 12, 20, dtype=dtype, initial_state=True)
    grad_o, grad_state = torch.randn_like(v), torch.randn_like(s0)
    plain = _results(method, normalized, q, k, v, s0, grad_o, grad_state)
    LOADS.take()
    with watched_loads():
        watched = _results(method, normalized, q, k, v, s0, grad_o, grad_state)
    read_outside, _ = LOADS.take()
    assert read_outside == 0, "a load read NaN: the inputs are finite, so it read past them"
    for name, a, b in zip(("out", "S_T", "dq", "dk", "dv", "dS_0"), plain, watched):
        assert torch.equal(a, b), f"{method} {name}: a switched-off lane reached the result"


# --------------------------------------------------------------------------- clear errors

def raises(error_type, *fragments):
    pattern = "".join(f"(?=.*{re.escape(fragment)})" for fragment in fragments)
    return pytest.raises(error_type, match=re.compile(pattern, re.DOTALL))


BAD_CONFIGS = [
    ("chunked", {"CHUNK": 24}, ValueError, ["CHUNK", "power of two >= 16", "24"]),
    ("chunked", {"CHUNK": 8}, ValueError, ["CHUNK", "power of two >= 16", "8"]),
    ("chunked", {"BLOCK_E": 0}, ValueError, ["BLOCK_E", "power of two >= 16", "0"]),
    ("chunked", {"BLOCK_E": 32.0}, TypeError, ["BLOCK_E", "int", "32.0"]),
    ("chunked", {"num_warps": 3}, ValueError, ["num_warps", "power of two", "3"]),
    ("chunked", {"num_stages": 0}, ValueError, ["num_stages", "at least 1", "0"]),
    ("chunked", {"BLOCK": 16}, ValueError, ["unknown config keys", "BLOCK"]),
    ("chunked", [("CHUNK", 16)], TypeError, ["config", "dict", "list"]),
    ("chunked", {"num_warps": 64}, ValueError, ["num_warps", "power of two", "64"]),
    ("scan", {"SEGMENT_LEN": [16]}, TypeError, ["SEGMENT_LEN", "int", "[16]"]),
    ("scan", {"SEGMENT_LEN": 0}, ValueError, ["SEGMENT_LEN", "at least 1"]),
    ("scan", {"SEGMENT_LEN": 40}, ValueError, ["SEGMENT_LEN", "multiple of CHUNK"]),
    ("scan", {"CHUNK": 24}, ValueError, ["CHUNK", "power of two >= 16", "24"]),
    ("scan", {"num_warps": 0}, ValueError, ["num_warps", "power of two", "0"]),
    ("scan", {"num_warps": 64}, ValueError, ["num_warps", "power of two from 1 to 32", "64"]),
    ("scan", {"num_stages": True}, TypeError, ["num_stages", "int", "True"]),
    ("recurrent", {"num_warps": 3}, ValueError, ["num_warps", "power of two", "3"]),
    ("recurrent", {"num_stages": 0}, ValueError, ["num_stages", "at least 1", "0"]),
    ("recurrent", {"WALK": ["tokens"]}, ValueError, ["WALK", "tokens", "blocks"]),
    ("recurrent", {"BLOCK_E": True}, ValueError, ["BLOCK_E", "power of two", "True"]),
    ("recurrent", "tokens", TypeError, ["config", "dict", "str"]),
]


@pytest.mark.parametrize("method, config, error, fragments", BAD_CONFIGS,
                         ids=[f"{m}-{c}" for m, c, *_ in BAD_CONFIGS])
def test_bad_config_gets_an_error_naming_the_key_and_limit(method, config, error, fragments, device):
    q, k, v = testing.random_inputs(1, 1, 48, 8, 8, device=device, seed=4)
    with raises(error, *fragments):
        KERNEL_FUNCTIONS[method](q, k, v, config=config)


def sparse(x):
    return x.to_sparse()


def sparse_csr(x):
    return x.to_sparse_csr(dense_dim=2)  # the last two dimensions stay dense, B and H compressed


def nested(x):
    return torch.nested.nested_tensor([x[0], x[1]])


@pytest.mark.parametrize("make, layout", [(sparse, "sparse_coo"), (sparse_csr, "sparse_csr"), (nested, "nested")],
                         ids=["sparse_coo", "sparse_csr", "nested"])
@pytest.mark.parametrize("method", (*ttx_tutorial.METHODS, "auto"))
def test_non_strided_layouts_are_refused_by_name(method, make, layout, device):
    q, k, v = testing.random_inputs(2, 1, 6, 4, 4, device=device, seed=5)
    with raises(TypeError, "q must be a dense (strided) tensor", layout):
        causal_product(make(q), k, v, method)


@pytest.mark.parametrize("method", ttx_tutorial.METHODS)
def test_meta_tensors_are_refused(method):
    q, k, v = (torch.empty(1, 1, 4, 4, device="meta") for _ in range(3))
    with raises(ValueError, "meta"):
        causal_product(q, k, v, method)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_return_state_must_be_a_bool(bad, device):
    q, k, v = testing.random_inputs(1, 1, 4, 4, 4, device=device, seed=7)
    with raises(TypeError, "return_state", repr(bad)):
        causal_product(q, k, v, "loop", return_state=bad)


# --------------------------------------------------------------------------- threads

def test_threads_calling_at_once_under_the_interpreter_take_turns(device):
    if not ttx_tutorial.INTERPRETED:
        pytest.skip("the interpreter's lock; GPU threads are tested on streams below")
    problems = [testing.random_inputs(1, 1, 17, 4, 4, device=device, seed=10 + i, requires_grad=True)
                for i in range(len(TRITON_METHODS))]
    expected = []
    for method, inputs in zip(TRITON_METHODS, problems):
        o = causal_product(*inputs, method)
        expected.append((o.detach(), torch.autograd.grad(o.sum(), inputs)))
    failures, results = [], {}

    def work(index, method, inputs):
        try:
            for _ in range(2):
                o = causal_product(*inputs, method)
                results[index] = (o.detach(), torch.autograd.grad(o.sum(), inputs))
        except Exception as error:  # noqa: BLE001 - reported below with its thread
            failures.append(f"{method}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(i, m, p))
               for i, (m, p) in enumerate(zip(TRITON_METHODS * 2, problems * 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for index, (o, grads) in results.items():
        want_o, want_grads = expected[index % len(TRITON_METHODS)]
        assert torch.equal(o, want_o)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_threads_on_separate_streams_compute_what_one_thread_does(method):
    problems = [testing.random_inputs(2, 4, 1000 + 17 * i, 64, 64, dtype=torch.bfloat16, seed=20 + i,
                                      requires_grad=True) for i in range(8)]
    expected = []
    for inputs in problems:
        o = causal_product(*inputs, method)
        expected.append((o.detach(), torch.autograd.grad(o.float().sum(), inputs)))
    torch.cuda.synchronize()
    results, failures = {}, []

    def work(index):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(20):
                    o = causal_product(*problems[index], method)
                    grads = torch.autograd.grad(o.float().sum(), problems[index])
                stream.synchronize()
            results[index] = (o.detach(), grads)
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for index, (o, grads) in results.items():
        want_o, want_grads = expected[index]
        assert torch.equal(o, want_o), f"o of problem {index}"
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads)), f"gradients of problem {index}"


@pytest.mark.parametrize("method", ["recurrent", "chunked", "scan"])
def test_interpreted_kernels_raise_no_numpy_warnings(method):
    """Under the interpreter NumPy computes the kernels and warns of inf and NaN arithmetic that a
    GPU does silently: a caller whose warnings are errors (pytest's filterwarnings = error) must
    still get the results, here of float16 features that overflow and of a NaN in v."""
    q = torch.randn(1, 1, 16, 8, dtype=torch.float16, device=ttx_tutorial.DEVICE)
    q[:, :, 0] = -1  # a query whose relu features are all zero
    k, v = torch.randn_like(q), torch.randn_like(q)
    v[0, 0, 9, 3] = float("nan")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ttx_tutorial.causal_linear_attention(*leaves, feature_map="relu", method=method).float().sum().backward()
        out = ttx_tutorial.causal_product(q, k, v, method=method)
    assert out[..., :9, :].isfinite().all()


# --------------------------------------------------------------------------- kernel files alone

@pytest.mark.parametrize("path", sorted(Path(chunked.__file__).parent.glob("[!_]*.py")), ids=lambda p: p.stem)
def test_kernel_files_import_only_torch_triton_and_the_standard_library(path):
    tree = ast.parse(path.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    relative = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    foreign = {m for m in imported - {"torch", "triton"} if m not in sys.stdlib_module_names}
    assert not relative and not foreign, (relative, foreign)


def extra_bad_inputs():
    q, k, v = testing.random_inputs(1, 2, 5, 4, 3, seed=8)
    return {
        "three_dimensional_q": ((q[0], k, v), {}),
        "D_300": (testing.random_inputs(1, 1, 2, 300, 3, seed=8), {}),
        "mixed_bfloat16": ((q, k.bfloat16(), v), {}),
        "sparse_v": ((q, k, v.to_sparse()), {}),
        "sparse_initial_state": ((q, k, v), {"initial_state": torch.zeros(1, 2, 4, 3).to_sparse()}),
        "v_list": ((q, k, v.tolist()), {}),
    }


def bad_input_cases():
    cases = dict(BAD_CALLS)
    cases.update(extra_bad_inputs())
    return cases


def caught(call):
    with pytest.raises((TypeError, ValueError)) as error:
        call()
    return type(error.value), str(error.value)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_kernel_functions_refuse_bad_input_with_the_api_s_messages(method):
    kernel_function = KERNEL_FUNCTIONS[method]
    for case, (args, kwargs) in bad_input_cases().items():
        from_api = caught(lambda: causal_product(*args, method, **kwargs))
        from_kernel_file = caught(lambda: kernel_function(*args, **kwargs))
        assert from_kernel_file == from_api, f"{case}: {from_kernel_file} != {from_api}"


@pytest.mark.parametrize("kernel_file", [chunked, scan, recurrent], ids=lambda module: module.__name__.split(".")[-1])
def test_each_kernel_file_refuses_a_head_past_32_bit_offsets(kernel_file):
    """Each kernel file checks its own inputs as the API does: a head whose last element sits at
    offset ``INDEX_LIMIT`` (2**31 - 1, the last one int32 reaches) is taken, one at 2**31 refused.
    Two tokens that far apart: 4 GiB of storage reserved, never touched, and no launch."""
    assert kernel_file.INDEX_LIMIT == 2**31 - 1
    for stride, refused in ((kernel_file.INDEX_LIMIT, False), (kernel_file.INDEX_LIMIT + 1, True)):
        try:
            q = torch.empty_strided((1, 1, 2, 1), (1, 1, stride, 1), dtype=torch.float16, device=ttx_tutorial.DEVICE)
        except (RuntimeError, MemoryError):
            pytest.skip("4 GiB of address space for one float16 head could not be reserved")
        if refused:
            with pytest.raises(ValueError, match=r"32-bit offsets: q spans 2147483649 elements per head"):
                kernel_file.check_inputs(q, q, q, None)
        else:
            kernel_file.check_inputs(q, q, q, None)
        del q


#: Each kernel file's entry point, called on small CPU tensors: (file, call).
KERNEL_FILE_CALLS = {
    "chunked": "chunked.chunked_causal_product(q, k, v)",
    "scan": "scan.scan_causal_product(q, k, v)",
    "recurrent": "recurrent.recurrent_causal_product(q, k, v)",
    "feature_map": "feature_map.feature_maps(q, k)",
    "step": "step.step_update(q[:, :, 0], k[:, :, 0], v[:, :, 0], torch.zeros(1, 2, 4, 4))",
}


#: Each kernel file's kernel that its input check looks at to tell the mode it was imported in.
MODE_KERNELS = {"chunked": "chunked_kernel", "scan": "scan_outputs_kernel", "recurrent": "recurrent_tokens_kernel",
                "feature_map": "feature_map_kernel", "step": "step_kernel"}


@pytest.mark.parametrize("name", KERNEL_FILE_CALLS)
def test_a_stand_in_for_the_kernel_passes_the_mode_check_on_a_gpu(name):
    """Outside the interpreter, as on a GPU, a test's launch recorder standing in for a kernel is
    neither a GPU kernel nor an interpreter function: the mode check lets it pass, and the call
    goes on to the next check (here the device of these CPU tensors)."""
    script = f"""
        import torch
        from ttx_tutorial.kernels import {name}
        {name}.{MODE_KERNELS[name]} = object()
        q = k = v = torch.randn(1, 2, 5, 4)
        try:
            {KERNEL_FILE_CALLS[name]}
        except (RuntimeError, ValueError) as error:
            print(type(error).__name__ + ":", error)
        """
    child = run_python(script, timeout=300)  # TTX_TUTORIAL_DEVICE=cuda: GPU mode, on any machine
    assert "switched" not in child.stdout and "the GPU" in child.stdout, child.stdout + child.stderr
    # On a machine without a GPU, moving the tensors to one is no advice: the interpreter is.
    advice = "Move them with .to('cuda')" if torch.cuda.is_available() else "TRITON_INTERPRET=1 before importing"
    assert advice in child.stdout, child.stdout + child.stderr


@pytest.mark.parametrize("name", KERNEL_FILE_CALLS)
def test_a_kernel_file_refuses_an_interpreter_switched_on_after_its_import(name, tmp_path):
    """@triton.jit chooses between a GPU kernel and the interpreter when the file is imported; a copy
    imported first and put in CPU mode afterwards says so, instead of failing inside Triton's driver."""
    shutil.copy(Path(chunked.__file__).parent / f"{name}.py", tmp_path)
    script = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch, triton
        import {name}
        triton.knobs.runtime.interpret = True
        q = k = v = torch.randn(1, 2, 5, 4)
        try:
            {KERNEL_FILE_CALLS[name]}
        except RuntimeError as error:
            print("refused:", error)
        """
    child = run_python(script, timeout=300, TTX_TUTORIAL_DEVICE="cpu")
    assert "refused: Triton's interpreter was switched on after this file was imported" in child.stdout, \
        child.stdout + child.stderr
