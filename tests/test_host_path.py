"""The host-side shortcuts of the kernel wrappers change nothing but speed.

A forward call whose inputs need no gradient skips ``torch.autograd.Function`` (its bookkeeping
was a large part of a small call's time on the H200), and the launch-configuration rules are
cached per shape. Checked here: the shortcut gives bit-identical o and S_T, a ``config`` override
never leaks into the cached rule or launch plan that later calls share, and the operator's
backward (what ``torch.compile`` runs) gives the eager gradients without a second forward pass;
and benchmarks/host_overhead.py counts the launches of one call.
"""

from __future__ import annotations

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS
from ttx_tutorial import ops, testing
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


class _Recorder:
    """Stands in for a kernel: records each launch's keyword arguments, runs nothing."""

    def __init__(self):
        self.keywords = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.keywords.append((grid, kwargs))


def test_launch_plans_are_per_shape_and_config(device, monkeypatch):
    """The cached launch plan of a shape is the rule's; a config's keys apply to its own calls
    only, and another T (which decides the compensated sum) gets its own plan."""
    recorder = _Recorder()
    monkeypatch.setattr(chunked, "chunked_kernel", recorder)
    q, k, v = testing.random_inputs(*SHAPE, dtype=torch.bfloat16, device=device, seed=24)
    chunked.chunked_causal_product(q, k, v)
    chunked.chunked_causal_product(q, k, v, config={"CHUNK": 16, "BLOCK_E": 16})
    chunked.chunked_causal_product(q, k, v)
    (grid_rule, rule), (grid_config, configured), (grid_again, again) = recorder.keywords
    assert (configured["CHUNK"], configured["BLOCK_E"]) == (16, 16)
    assert again == rule and grid_again == grid_rule
    B, H, T, D = q.shape
    E = v.shape[-1]
    assert grid_config == (B * H * -(-E // 16),)
    long = chunked._launch_plan(B, H, 64 * (chunked.COMPENSATED_FROM_CHUNKS + 1), D, E, q.dtype,
                                chunked._device_limits(q.device), ttx_tutorial.INTERPRETED, "tf32", ())
    assert long[1]["COMPENSATED"] and not rule["COMPENSATED"]


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_backward_runs_no_second_forward(method, dtype, device, monkeypatch):
    """The operator's backward (what torch.compile calls) gives the eager backward's gradients,
    bit for bit, without running the forward kernel again for chunked and recurrent."""
    q, k, v, s0 = testing.random_inputs(*SHAPE, dtype=dtype, device=device, seed=25, initial_state=True)
    grad_o = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(26)).to(device, dtype)
    grad_state = torch.randn_like(s0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o, state = ttx_tutorial.causal_product(*leaves[:3], method, initial_state=leaves[3], return_state=True)
    expected = torch.autograd.grad((o, state), leaves, (grad_o, grad_state))

    autograd_function = ops._BACKWARD_FROM_INPUTS[method]
    forwards = []
    real_forward = autograd_function.forward
    monkeypatch.setattr(autograd_function, "forward",
                        staticmethod(lambda *args: forwards.append(1) or real_forward(*args)))
    with testing.poisoned_allocations():
        found = ops._causal_product_backward_op(q, k, v, s0, grad_o, grad_state, method)
    assert forwards == []
    for name, a, b in zip(("dq", "dk", "dv", "ds0"), found, expected):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype, setting, expected", [(torch.bfloat16, "high", (1, 2)), (torch.float32, "high", (1, 2)),
                                                     (torch.float32, "highest", (1, 4))],
                         ids=["bfloat16", "float32-high", "float32-highest"])
def test_host_overhead_counts_the_launches_of_one_call(dtype, setting, expected, benchmark_script):
    """benchmarks/host_overhead.py counts the kernel launches of one call, each a Triton launch
    the host pays for: chunked's forward is one; its backward of heads up to 64 wide is one fused
    launch, but for float32 under "highest", whose split products take three passes."""
    host_overhead = benchmark_script("host_overhead")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(setting)
        _, _, launches = host_overhead.stub_stages(8, host_overhead.CLOCK["wall"], dtype)
    finally:
        torch.set_float32_matmul_precision(before)
    assert launches["chunked"] == expected
