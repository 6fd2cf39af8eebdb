"""Property-based tests: every method, on shapes drawn by hypothesis, against a float64 reference.

Drawn: B (1-2), H (1-3), T from 0 up (biased to either side of power-of-two block sizes), D and
E from 1 to 256 (mostly small and not powers of two), the dtype, with or without an initial
state. The output and the final state must match ``ttx_tutorial.testing.reference`` (float64)
within ``TOLERANCES[dtype]``, with every allocation poisoned with NaN so that an element a kernel
never writes fails the comparison. Gradients of q, k, v and the initial state are compared with
float64 autograd of the reference on smaller shapes.

Budget: ``TTX_HYPOTHESIS_EXAMPLES`` examples per test and method (default 20 under the CPU
interpreter, 100 on a GPU, where sequences are also longer). For a longer search run e.g.
``TTX_HYPOTHESIS_EXAMPLES=500 .venv/bin/python -m pytest tests/test_properties.py``. Examples are
derandomized and no database is kept, so every run, in CI or not, tries the same cases; a
failure prints the drawn problem and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ttx_tutorial
from _strategies import (SETTINGS, cotangents, describe_problem, inputs_for, method_gradients, problems,
                         run_method)
from ttx_tutorial import testing

#: Under the interpreter every Triton program runs in NumPy: bound T and B*H*T*D*E per example.
FORWARD_LIMITS = ttx_tutorial.size(cpu=dict(max_length=140, max_work=300_000),
                                   gpu=dict(max_length=2000, max_work=50_000_000))
GRADIENT_LIMITS = ttx_tutorial.size(cpu=dict(max_length=70, max_work=100_000),
                                    gpu=dict(max_length=600, max_work=5_000_000))


def dtypes_of(method):
    return ttx_tutorial.method_info(method).dtypes


def least_precise(*dtypes):
    """The dtype with the loosest tolerance: a float32 initial state's gradient is float32 even
    when q, k, v are float64."""
    return max(dtypes, key=testing.tolerance)


def expected_state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("method", ttx_tutorial.METHODS)
@SETTINGS
@given(data=st.data())
def test_output_and_final_state_match_float64_reference(method, data):
    problem = data.draw(problems(dtypes_of(method), **FORWARD_LIMITS), label="problem")
    q, k, v, initial_state = inputs_for(problem)
    originals = [x.clone() for x in (q, k, v, initial_state) if x is not None]
    with testing.poisoned_allocations():
        o, state = run_method(method, q, k, v, initial_state)
    ref_o, ref_state = testing.reference(q, k, v, initial_state, device=ttx_tutorial.DEVICE)

    where = f"{method}, {describe_problem(problem)}"
    assert (o.shape, o.dtype, o.device) == (ref_o.shape, q.dtype, q.device), f"o: {where}"
    assert (state.shape, state.dtype, state.device) == (
        ref_state.shape, expected_state_dtype(q.dtype), q.device), f"final state: {where}"
    testing.assert_close(o, ref_o, q.dtype, name=f"o ({where})")
    testing.assert_close(state, ref_state, q.dtype, name=f"final state ({where})")
    for before, after in zip(originals, (q, k, v, initial_state)):
        assert torch.equal(before, after), f"an input was modified ({where})"


@pytest.mark.parametrize("method", ttx_tutorial.METHODS)
@SETTINGS
@given(data=st.data())
def test_gradients_match_float64_autograd(method, data):
    problem = data.draw(problems(dtypes_of(method), **GRADIENT_LIMITS), label="problem")
    q, k, v, initial_state = inputs_for(problem)
    grad_o, grad_state = cotangents(q, v, seed=problem["seed"])
    with testing.poisoned_allocations():
        _, _, grads = method_gradients(method, q, k, v, initial_state, grad_o, grad_state)
    _, _, ref_grads = testing.reference_gradients(q, k, v, initial_state, grad_o, grad_state)

    where = f"{method}, {describe_problem(problem)}"
    assert set(grads) == set(ref_grads)
    for name, ref_grad in ref_grads.items():
        grad = grads[name]
        leaf = {"q": q, "k": k, "v": v, "initial_state": initial_state}[name]
        assert (grad.shape, grad.dtype) == (leaf.shape, leaf.dtype), f"gradient of {name} ({where})"
        testing.assert_close(grad, ref_grad, least_precise(q.dtype, leaf.dtype),
                             name=f"gradient of {name} ({where})")
