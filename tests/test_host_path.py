"""The host-side shortcuts of the kernel wrappers change nothing but speed.

A forward call whose inputs need no gradient skips ``torch.autograd.Function`` (its bookkeeping
was a large part of a small call's time on the H200), and the launch-configuration rules are
cached. Checked here: the shortcut gives bit-identical o and S_T, and a ``config`` override never
leaks into the cached rule that later calls share.
"""

from __future__ import annotations

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS
from ttx_tutorial import testing
from ttx_tutorial.kernels import chunked, recurrent

SHAPE = (1, 2, 37, 12, 20)  # B, H, T, D, E: two chunks and a partial one of 16 tokens


@pytest.mark.parametrize("method", TRITON_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_without_gradients_matches_the_autograd_path(method, dtype, device):
    q, k, v, s0 = testing.random_inputs(*SHAPE, dtype=dtype, device=device, seed=21, initial_state=True)
    with testing.poisoned_allocations():
        o_plain, state_plain = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0,
                                                           return_state=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o_graph, state_graph = ttx_tutorial.causal_product(*leaves[:3], method, initial_state=leaves[3],
                                                       return_state=True)
    assert o_plain.grad_fn is None and state_plain.grad_fn is None
    assert o_graph.grad_fn is not None
    assert torch.equal(o_plain, o_graph.detach())
    assert torch.equal(state_plain, state_graph.detach())


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_no_grad_mode_skips_autograd_even_for_leaves_that_require_grad(method, device):
    q, k, v = testing.random_inputs(*SHAPE, device=device, seed=22, requires_grad=True)
    with torch.no_grad():
        o = ttx_tutorial.causal_product(q, k, v, method)
    assert o.grad_fn is None and not o.requires_grad


def test_config_overrides_leave_the_cached_rules_untouched(device):
    q, k, v = testing.random_inputs(*SHAPE, dtype=torch.bfloat16, device=device, seed=23)
    B, H, _, D = q.shape
    E = v.shape[-1]

    multiprocessors, shared_memory = chunked._device_limits(q.device)
    multiprocessors = None if ttx_tutorial.INTERPRETED else multiprocessors  # as the wrapper asks the rule
    rule = dict(chunked._cached_default_config(D, E, q.dtype, heads=B * H, multiprocessors=multiprocessors,
                                               shared_memory=shared_memory))
    chunked.chunked_causal_product(q, k, v, config={"CHUNK": 16, "BLOCK_E": 16})
    assert chunked._cached_default_config(D, E, q.dtype, heads=B * H, multiprocessors=multiprocessors,
                                          shared_memory=shared_memory) == rule

    before = dict(recurrent._resolve_config(q, v, None))
    recurrent.recurrent_causal_product(q, k, v, config={"UNROLL": 2, "BLOCK_E": 4})  # the tokens walk
    recurrent.recurrent_causal_product(q, k, v, config={"BLOCK_T": 4, "BLOCK_E": 2})  # the blocks walk
    assert recurrent._resolve_config(q, v, None) == before
