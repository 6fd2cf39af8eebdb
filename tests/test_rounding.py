"""bfloat16 outputs are rounded to nearest (ties to even), as a GPU rounds them, in both device
modes. Triton's interpreter truncates float32 to bfloat16 by itself, which errs by up to a whole
unit in the last place where rounding errs by half, and so makes CPU-mode results coarser than
the GPU's; each kernel file rounds the bit pattern itself under it.

Checked where a kernel computes in float32 and rounds once, at the store: the recurrent walks,
the generation step and the feature maps. (The chunked and scan kernels round bfloat16 tiles for
their tensor-core products as well, so their outputs are not float64's rounding: scan's are
checked on exact ties, and against its products' arithmetic written in PyTorch.) Each check
compares with the float64 result rounded to nearest by PyTorch. float32 arithmetic moves a few
results that lie near the middle between two bfloat16 values to the other one, so almost all
elements, not all, must match, and every element must lie within one unit (plus float32's own
error on the sum of the terms' magnitudes, where the terms cancel to a tiny result); truncation
misses about half of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial.kernels import feature_map, recurrent, scan
from ttx_tutorial.testing import random_inputs

#: The share of elements that must equal float64's value rounded to nearest.
MATCHING_SHARE = 0.95


#: float32 sums of a few dozen terms err by at most this many units of float32's last place
#: times the sum of the terms' magnitudes.
FLOAT32_SUM_ULPS = 64


def check_rounded_to_nearest(result, exact, label, magnitude=None):
    """``magnitude``: the sum of the magnitudes of the terms that make each exact element, for
    elements that cancel (float32 errs on it, not on the tiny result); None: no sum."""
    assert result.dtype == torch.bfloat16
    nearest = exact.to(torch.bfloat16)
    result, nearest = result.cpu(), nearest.cpu()
    share = (result == nearest).double().mean().item()
    assert share >= MATCHING_SHARE, f"{label}: {share:.1%} of elements equal float64's rounding to nearest"
    # Within one unit in the last place: bfloat16 keeps 8 significant bits.
    unit = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs()).exponent - 8)
    if magnitude is not None:
        unit = unit + FLOAT32_SUM_ULPS * 2.0**-24 * magnitude.cpu()
    assert ((result.double() - exact).abs() <= unit).all(), f"{label}: an element is more than a unit off"


@pytest.mark.parametrize("walk", ["tokens", "blocks"])
def test_recurrent_product_rounds_to_nearest(walk):
    q, k, v = random_inputs(2, 3, 40, 16, 24, dtype=torch.bfloat16)
    o, _ = recurrent.recurrent_causal_product(q, k, v, config={"WALK": walk})
    scores = torch.einsum("bhtd,bhsd->bhts", q.double().cpu(), k.double().cpu()).tril()
    exact = scores @ v.double().cpu()
    check_rounded_to_nearest(o, exact, f"{walk} walk", magnitude=scores.abs() @ v.double().cpu().abs())


@pytest.mark.parametrize("walk", ["tokens", "blocks"])
def test_recurrent_normalised_attention_rounds_to_nearest(walk):
    q, k, v = random_inputs(2, 3, 40, 16, 24, dtype=torch.bfloat16)
    q, k = q.abs(), k.abs()
    out, _ = recurrent.recurrent_normalized_attention(q, k, v, config={"WALK": walk})
    scores = torch.einsum("bhtd,bhsd->bhts", q.double().cpu(), k.double().cpu()).tril()
    denominator = scores.sum(-1, keepdim=True) + 1e-6
    exact = (scores @ v.double().cpu()) / denominator
    check_rounded_to_nearest(out, exact, f"{walk} walk", magnitude=(scores @ v.double().cpu().abs()) / denominator)


def test_step_rounds_to_nearest():
    q, k, v = (x[:, :, 0] for x in random_inputs(8, 4, 1, 16, 24, dtype=torch.bfloat16))
    state = torch.zeros(8, 4, 16, 24, device=q.device)
    with torch.no_grad():
        o = ttx_tutorial.linear_attention_step(q, k, v, state, feature_map="identity", normalize=False)
    exact = (q.double() * k.double()).sum(-1, keepdim=True).cpu() * v.double().cpu()
    magnitude = (q.double() * k.double()).abs().sum(-1, keepdim=True).cpu() * v.double().cpu().abs()
    check_rounded_to_nearest(o, exact, "step", magnitude=magnitude)


@pytest.mark.parametrize("name", feature_map.FEATURE_MAPS)
def test_feature_maps_and_their_gradients_round_to_nearest(name):
    q, k, _ = random_inputs(2, 3, 40, 16, dtype=torch.bfloat16)
    q, k = q * 4, k * 4  # phi(x) = x + 1 then needs all of bfloat16's bits and more
    leaves = [x.clone().requires_grad_() for x in (q, k)]
    phi_q, phi_k = feature_map._run_validated(*leaves, name)
    exact_map = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu}[name]
    for x, phi, label in ((q, phi_q, "phi(q)"), (k, phi_k, "phi(k)")):
        check_rounded_to_nearest(phi, exact_map(x.double().cpu()), f"{name} {label}")
    grad_q, grad_k = (torch.randn(q.shape).to(q.device, torch.bfloat16) * 3 for _ in range(2))
    torch.autograd.backward((phi_q, phi_k), (grad_q, grad_k))
    for x, phi, grad, leaf, label in ((q, phi_q, grad_q, leaves[0], "dq"), (k, phi_k, grad_k, leaves[1], "dk")):
        x64 = x.double().cpu().requires_grad_()
        (exact,) = torch.autograd.grad(exact_map(x64), x64, grad.double().cpu())
        # The kernel takes phi' from the stored bfloat16 features (min(phi, 1) for elu).
        if name == "elu":
            exact = torch.where(phi.double().cpu() < 1, grad.double().cpu() * phi.double().cpu(), exact)
        check_rounded_to_nearest(leaf.grad, exact, f"{name} {label}")


def test_scan_rounds_bfloat16_ties_to_even():
    """Outputs that lie exactly halfway between two bfloat16 values go to the even one, as a
    GPU's conversion does; rounding ties up instead would pass the share above (ties are rare
    in random data) and bias every tie the same way. With q = k = 1 and D = 1, o_1 = v_0 + v_1
    is exact in float32: v_0 = +-1 and v_1 = +-(2j + 1) 2^-8 put o_1 halfway between
    1 + j 2^-7 and 1 + (j + 1) 2^-7 (in magnitude) for j = 0..63."""
    odd = (2 * torch.arange(64, dtype=torch.float64) + 1) * 2.0**-8
    v = torch.stack([torch.ones(64, dtype=torch.float64), odd])  # (T, E) = (2, 64)
    v = torch.stack([v, -v])[None].to(ttx_tutorial.DEVICE, torch.bfloat16)  # heads of either sign
    q = torch.ones(1, 2, 2, 1, dtype=torch.bfloat16, device=ttx_tutorial.DEVICE)
    o, _ = scan.scan_causal_product(q, q, v)
    exact = v.double().cpu().cumsum(2)
    assert (exact[:, :, 1] * 2**8 % 2 == 1).all()  # every o_1 is a tie
    assert torch.equal(o.cpu(), exact.to(torch.bfloat16))


def scan_bfloat16_forward_as_a_gpu_computes_it(q, k, v, initial_state, chunk):
    """scan's pass 3 on one segment in PyTorch, in the GPU's arithmetic: per chunk of ``chunk``
    tokens, float32 products of bfloat16 operands, O_c = Q_c bf16(S) + bf16(tril(Q_c K_c^T)) V_c,
    S <- S + K_c^T V_c in float32, O_c rounded to bfloat16 at the store."""
    q, k, v = (x.float().cpu() for x in (q, k, v))
    state = initial_state.float().cpu().clone()
    outputs = []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        qc, kc, vc = q[:, :, part], k[:, :, part], v[:, :, part]
        scores = (qc @ kc.transpose(-1, -2)).tril()
        o = qc @ state.to(torch.bfloat16).float() + scores.to(torch.bfloat16).float() @ vc
        state = state + kc.transpose(-1, -2) @ vc
        outputs.append(o.to(torch.bfloat16))
    return torch.cat(outputs, dim=2)


def test_scan_bfloat16_products_take_the_state_and_scores_rounded_as_on_a_gpu():
    """On a GPU a bfloat16 product takes bfloat16 operands, so pass 3 rounds the float32 state
    and scores to bfloat16 first; under the interpreter, whose products take float32, the kernel
    rounds them by hand. Left unrounded, CPU mode would compute more accurately than a GPU and
    its tests would pass results the GPU does not reach. The outputs must be those of the GPU's
    arithmetic written in PyTorch (float32 sums in another order move a few near ties) and
    not those of float32 operands, which differ in many last bits."""
    q, k, v, s0 = random_inputs(2, 2, 48, 16, 24, dtype=torch.bfloat16, initial_state=True)
    o, _ = scan.scan_causal_product(q, k, v, s0, config={"CHUNK": 16, "SEGMENT_LEN": 64})  # one segment
    expected = scan_bfloat16_forward_as_a_gpu_computes_it(q, k, v, s0, 16)
    share = (o.cpu() == expected).double().mean().item()
    assert share >= 0.99, f"{share:.1%} of the outputs equal the GPU arithmetic's"
