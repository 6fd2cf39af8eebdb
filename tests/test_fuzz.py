"""Differential fuzzing: every method against the float64 reference, on drawn shapes, dtypes,
strides, views, initial states, non-finite padding and gradient requests.

hypothesis draws the problem; each method runs it with poisoned allocations and is compared, for
o, S_T and every requested gradient, to ``cumsum`` in float64 on the same values (``cumsum`` adds
each token only to later states, so its non-finite positions are the causal ones):
  - where the reference is finite, the method is finite and within ``TOLERANCES`` of it;
  - where the reference is not finite, neither is the method (garbage is never hidden).
Methods agree with each other through the reference, non-finite positions included.

Examples: ``_strategies.EXAMPLES`` (a few tens under the interpreter, more on a GPU, any number
through ``TTX_HYPOTHESIS_EXAMPLES``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import ttx_tutorial
from _strategies import SETTINGS
from ttx_tutorial import testing

METHODS = (*ttx_tutorial.METHODS, "auto")
FEW_ELEMENTS = 64
LAYOUTS = ("contiguous", "tokens_outer", "every_other_column", "batch_broadcast", "negative_bit")


def laid_out(x, layout):
    """x (B, H, T, N) as a view with the drawn memory layout; differentiable, same values."""
    if layout == "tokens_outer":  # (B, T, H, N) memory, as a projection's output
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "every_other_column":
        wide = torch.stack((x, torch.full_like(x, math.nan)), dim=-1).flatten(-2)  # NaN between columns
        return wide[..., ::2]
    if layout == "batch_broadcast":  # stride 0 over B: every batch reads batch 0's values
        return x[:1].expand_as(x)
    if layout == "negative_bit" and x.dtype in (torch.float32, torch.float64):
        view = torch.complex(torch.zeros_like(x), -x).conj().imag
        assert view.is_neg()
        return view
    return x


@st.composite
def fuzz_problems(draw):
    dtype = draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T = draw(st.one_of(st.sampled_from((0, 1, 15, 16, 17, 33, 64, 65)), st.integers(0, 70)))
    D = draw(st.one_of(st.integers(1, 20), st.sampled_from((32, 33, 64))))
    E = draw(st.one_of(st.integers(1, 20), st.sampled_from((32, 33, 64))))
    garbage = None
    if T > 1 and draw(st.booleans()):
        garbage = (draw(st.sampled_from("qkv")), draw(st.integers(1, T - 1)),
                   draw(st.sampled_from((math.inf, -math.inf, math.nan))))
    wants = draw(st.sets(st.sampled_from(("q", "k", "v", "initial_state"))))
    return {
        "B": B, "H": H, "T": T, "D": D, "E": E, "dtype": dtype,
        "layouts": {name: draw(st.sampled_from(LAYOUTS)) for name in ("q", "k", "v", "initial_state")},
        "initial_state": draw(st.booleans()),
        "garbage": garbage,  # (argument, first padded token, value) or None
        "wants": wants,  # the leaves whose gradients are requested
        # S_T in the loss only when padding cannot make it non-finite.
        "state_in_loss": draw(st.booleans()) and (garbage is None or garbage[0] == "q"),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def leaves_of(p):
    """The drawn values, rounded to the dtype, with the padding's garbage: {name: tensor}."""
    drawn = testing.random_inputs(p["B"], p["H"], p["T"], p["D"], p["E"], dtype=p["dtype"], seed=p["seed"],
                                  initial_state=True)
    values = dict(zip(("q", "k", "v", "initial_state"), (x.clone() for x in drawn)))
    if not p["initial_state"]:
        del values["initial_state"]
    if p["garbage"] is not None:
        name, first, value = p["garbage"]
        values[name][:, :, first:] = value
    return values


def run(method, values, p, *, float64=False):
    """(o, S_T, {name: gradient}) of ``method`` for the drawn layouts and loss."""
    leaves = {name: (x.detach().double() if float64 else x.detach().clone()).requires_grad_(name in p["wants"])
              for name, x in values.items()}
    inputs = {name: laid_out(x, p["layouts"][name]) for name, x in leaves.items()}
    with testing.poisoned_allocations():
        o, state = ttx_tutorial.causal_product(inputs["q"], inputs["k"], inputs["v"], method,
                                               initial_state=inputs.get("initial_state"), return_state=True)
    grads = {}
    wanted = [leaves[name] for name in p["wants"] if name in leaves]
    if wanted:
        generator = torch.Generator().manual_seed(p["seed"] + 1)
        grad_o = torch.randn(o.shape, generator=generator, dtype=torch.float64)
        if p["garbage"] is not None:  # a padded batch's loss ignores the padded tokens
            grad_o[:, :, p["garbage"][1]:] = 0
        loss = (o.double() * grad_o.to(o.device)).sum()
        if p["state_in_loss"]:
            loss = loss + (state.double() * torch.randn(state.shape, generator=generator,
                                                        dtype=torch.float64).to(o.device)).sum()
        # An empty sequence can leave the loss cut off from the leaves: their gradients are zeros.
        found = torch.autograd.grad(loss, wanted, allow_unused=True) if loss.requires_grad else [None] * len(wanted)
        grads = {name: torch.zeros_like(leaf) if g is None else g
                 for name, leaf, g in zip([n for n in p["wants"] if n in leaves], wanted, found)}
    return o.detach(), state.detach(), grads


def compare(name, out, ref, dtype):
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    finite_out, finite_ref = torch.isfinite(out), torch.isfinite(ref)
    hidden = finite_out & ~finite_ref
    assert not hidden.any(), f"{name}: finite at {hidden.nonzero()[:5].tolist()} where the reference is not"
    spread = finite_ref & ~finite_out
    assert not spread.any(), f"{name}: not finite at {spread.nonzero()[:5].tolist()}, the reference is"
    both = finite_out & finite_ref
    err = testing.relative_error(out[both], ref[both])
    tolerance = testing.TOLERANCES[dtype]
    if dtype != torch.float32 and both.sum() < FEW_ELEMENTS:
        # The norm of a few elements does not average their roundings: one output can carry two
        # roundings to 16 bits (the state before its product, then o), truncated by the
        # interpreter, up to 2 * 2**-7 = 1.6e-2.
        tolerance *= 2
    assert err <= tolerance, f"{name}: relative error {err:.2e} on finite positions"


@SETTINGS
@given(p=fuzz_problems())
def test_every_method_matches_the_float64_reference(p):
    values = leaves_of(p)
    ref_o, ref_state, ref_grads = run("cumsum", {n: x.cpu() for n, x in values.items()}, p, float64=True)
    device_values = {n: x.to(ttx_tutorial.DEVICE) for n, x in values.items()}
    for method in METHODS:
        o, state, grads = run(method, device_values, p)
        compare(f"{method} o", o, ref_o, p["dtype"])
        compare(f"{method} S_T", state, ref_state, p["dtype"])
        for name in grads:
            compare(f"{method} d{name}", grads[name], ref_grads[name], p["dtype"])
