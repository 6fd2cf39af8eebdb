"""Shared by the property, input and determinism tests: problem-shape strategies for hypothesis,
the list of methods, and runs of a method with its gradients (the float64 reference's are
``ttx_tutorial.testing.reference_gradients``)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import ttx_tutorial
from ttx_tutorial import testing

TRITON_METHODS = tuple(m for m in ttx_tutorial.METHODS if ttx_tutorial.method_info(m).is_triton)

#: Examples per property and method: ``TTX_HYPOTHESIS_EXAMPLES`` when set, otherwise few under
#: the CPU interpreter (CI) and more on a GPU.
EXAMPLES = int(os.environ.get("TTX_HYPOTHESIS_EXAMPLES") or ttx_tutorial.size(cpu=20, gpu=100))

#: Reproducible runs: the same examples every time, nothing remembered between runs.
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: Sequence lengths on either side of every power-of-two block a kernel may use, and 0.
BLOCK_EDGE_LENGTHS = (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257)
#: Head dimensions: mostly small and not powers of two, and a few up to the supported maximum.
SMALL_HEAD_DIMS = (1, 2, 3, 5, 7, 12, 16, 17, 24, 33, 48)
LARGE_HEAD_DIMS = (64, 65, 100, 127, 128, 129, 200, 255, 256)


def head_dims(max_dim: int):
    small = st.one_of(st.sampled_from(SMALL_HEAD_DIMS), st.integers(1, 40))
    large = st.sampled_from([d for d in LARGE_HEAD_DIMS if d <= max_dim])
    return st.one_of(small, small, small, large)  # three small draws for one large


@st.composite
def problems(draw, dtypes, *, max_length, max_dim=ttx_tutorial.MAX_HEAD_DIM, max_work):
    """A dict B, H, T, D, E, dtype, initial_state (bool), seed.

    ``max_work`` bounds B * H * T * D * E so that each example stays cheap under the
    interpreter: large D or E come with short sequences and a single head.
    """
    dtype = draw(st.sampled_from(dtypes))
    D, E = draw(head_dims(max_dim)), draw(head_dims(max_dim))
    lengths = [t for t in BLOCK_EDGE_LENGTHS if t <= max_length]
    T = draw(st.one_of(st.sampled_from(lengths), st.integers(0, max_length)))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    while B * H * max(T, 1) * D * E > max_work and (B > 1 or H > 1):
        B, H = 1, max(1, H // 2)
    if max(T, 1) * D * E > max_work:
        T = draw(st.sampled_from([t for t in lengths if t * D * E <= max_work]))
    return {
        "B": B, "H": H, "T": T, "D": D, "E": E, "dtype": dtype,
        "initial_state": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def inputs_for(problem, *, requires_grad=False):
    """(q, k, v, initial_state or None) on ``ttx_tutorial.DEVICE`` for a drawn problem."""
    p = problem
    drawn = testing.random_inputs(p["B"], p["H"], p["T"], p["D"], p["E"], dtype=p["dtype"], seed=p["seed"],
                                  initial_state=p["initial_state"], requires_grad=requires_grad)
    return (*drawn, None) if len(drawn) == 3 else drawn


def run_method(method, q, k, v, initial_state=None):
    """``(o, S_T)`` from ``causal_product``, validation included."""
    return ttx_tutorial.causal_product(q, k, v, method, initial_state=initial_state, return_state=True)


def cotangents(q, v, seed):
    """Random upstream gradients for o (in the inputs' dtype) and for S_T (float32, float64 for
    float64 inputs), with values the dtype represents exactly."""
    B, H, T, D = q.shape
    E = v.shape[-1]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    generator = torch.Generator().manual_seed(seed)
    grad_o = torch.randn(B, H, T, E, generator=generator, dtype=torch.float64).to(q.device, q.dtype)
    grad_state = torch.randn(B, H, D, E, generator=generator, dtype=torch.float64).to(q.device, state_dtype)
    return grad_o, grad_state


def method_gradients(method, q, k, v, initial_state, grad_o, grad_state):
    """Run ``method`` on fresh leaves and back-propagate: ``(o, S_T, {name: gradient})``."""
    leaves = {name: x.detach().clone().requires_grad_()
              for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", initial_state)) if x is not None}
    o, state = run_method(method, leaves["q"], leaves["k"], leaves["v"], leaves.get("initial_state"))
    _backward((o, state), (grad_o, grad_state))
    return o.detach(), state.detach(), _gradients(leaves)


def _backward(outputs, grad_outputs):
    """Back-propagate through the outputs that require a gradient. (An output cut off from the
    graph, e.g. by an empty sequence, is tested on its own in test_inputs.py.)"""
    pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs) if out.requires_grad]
    if pairs:
        torch.autograd.backward(*zip(*pairs))


def _gradients(leaves):
    """{name: gradient}, zeros where autograd left None (the leaf did not influence the outputs)."""
    return {name: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for name, leaf in leaves.items()}


def describe_problem(problem) -> str:
    p = problem
    return (f"B={p['B']} H={p['H']} T={p['T']} D={p['D']} E={p['E']} {p['dtype']} "
            f"initial_state={p['initial_state']} seed={p['seed']}")
