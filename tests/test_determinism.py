"""Determinism: the same inputs give bit-identical outputs and gradients, run after run.

Floating-point addition is not associative, so a kernel that sums with atomics (whose order
depends on which program finishes first) or that reads memory it never wrote can give different
bits on each run. Two checks:

* every Triton method, forward and backward, run repeatedly on the same inputs: ``torch.equal``
  on o, S_T and every gradient. One of the runs has every allocation poisoned with NaN, so a
  result that depends on uninitialised memory differs even under the interpreter, whose
  programs always run in the same order; on a GPU the sizes are large enough for many programs
  to race.
* no kernel file calls a ``tl.atomic_*`` operation (read from the source's syntax tree, so
  comments and docstrings do not count), since the GPU is where atomics reorder and CI has none.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS, cotangents, method_gradients
from ttx_tutorial import testing

SHAPE = ttx_tutorial.size(cpu=(1, 2, 70, 20, 12), gpu=(4, 8, 4099, 64, 96))  # B, H, T, D, E
REPEATS = ttx_tutorial.size(cpu=2, gpu=4)


def runs(method, dtype):
    """REPEATS forward-backward runs on the same inputs, the first with poisoned allocations."""
    q, k, v, s0 = testing.random_inputs(*SHAPE, dtype=dtype, seed=11, initial_state=True)
    grad_o, grad_state = cotangents(q, v, seed=12)
    with testing.poisoned_allocations():
        results = [method_gradients(method, q, k, v, s0, grad_o, grad_state)]
    for _ in range(REPEATS - 1):
        results.append(method_gradients(method, q, k, v, s0, grad_o, grad_state))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_forward_and_backward_are_bit_identical_across_runs(method, dtype):
    (o, state, grads), *others = runs(method, dtype)
    assert torch.isfinite(o).all() and torch.isfinite(state).all(), "the poisoned run left NaN in its outputs"
    for call, (o_again, state_again, grads_again) in enumerate(others, start=2):
        assert torch.equal(o, o_again), f"{method} {dtype}: o differs between call 1 and call {call}"
        assert torch.equal(state, state_again), f"{method} {dtype}: S_T differs between call 1 and call {call}"
        for name, grad in grads.items():
            assert torch.equal(grad, grads_again[name]), (
                f"{method} {dtype}: the gradient of {name} differs between call 1 and call {call}")


#: Atomics a kernel file may use, with the reason their order cannot change a result:
#: {(kernel file, "atomic_xyz"): "why"}.
ALLOWED_ATOMICS: dict[tuple[str, str], str] = {
    ("scan", "atomic_add"): "an integer count of finished pass-1 programs: it only decides which "
                            "program runs pass 2, and pass 2 sums in the same order whichever does",
    ("step", "atomic_add"): "an integer count of a head's programs that have read the old z: it only "
                            "decides which program writes the new z, which every program computes alike",
    ("step", "atomic_xchg"): "the last program resets that count to 0 for the next step",
}
KERNEL_FILES = ("recurrent", "chunked", "scan", "step", "feature_map")


def test_every_kernel_file_is_checked_for_atomics():
    kernels = Path(ttx_tutorial.__file__).parent / "kernels"
    assert sorted(KERNEL_FILES) == sorted(path.stem for path in kernels.glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_file_uses_no_order_dependent_atomics(name):
    module = importlib.import_module(f"ttx_tutorial.kernels.{name}")
    tree = ast.parse(inspect.getsource(module))
    atomics = sorted({node.attr for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr.startswith("atomic_")})
    unexplained = [atomic for atomic in atomics if (name, atomic) not in ALLOWED_ATOMICS]
    assert not unexplained, (
        f"{module.__name__} uses {unexplained}: their order varies between runs on a GPU, so results "
        "would not be bit-identical. Sum in a fixed order instead, or add the atomic to "
        "ALLOWED_ATOMICS with the reason its order cannot change a result")
