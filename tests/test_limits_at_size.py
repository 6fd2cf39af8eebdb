"""The 32-bit limits at size, on the GPU, and memory over many calls.

- One head whose slice ends exactly at the last 32-bit offset (T = 2**25 at D = E = 64, bfloat16:
  2**31 elements, 4 GiB a tensor) is computed correctly, forward and backward, compared window by
  window with a float64 reference whose state before each window is summed piece by piece.
- A batch whose tensors hold more than 2**31 elements (offsets of later heads need 64 bits) is
  computed correctly, checked on the first, a middle and the last head.
- One head just over the limit gets the documented error (test_inputs.py has the child-process
  version that launches nothing that could corrupt the CUDA context).
- 10,000 forward+backward calls at a small shape leave GPU and host memory flat.

The two tests at size take about a minute of an H200 each and run only with ``TTX_SIZE_TESTS=1``
(``pytest -m gpu tests/test_limits_at_size.py`` with it set); the windowed reference itself is
checked on the CPU at a small size, so the test logic runs in CI.
"""

from __future__ import annotations

import gc
import os
import resource

import pytest
import torch

import ttx_tutorial
from _strategies import TRITON_METHODS
from ttx_tutorial import references, testing

at_size = pytest.mark.skipif(os.environ.get("TTX_SIZE_TESTS") != "1",
                             reason="4 GiB tensors: set TTX_SIZE_TESTS=1 on a GPU with 80 GiB free")


def prefix_state(k, v, end, piece):
    """sum_{t < end} k_t v_t^T in float64, piece tokens at a time (never a float64 copy of it all)."""
    state = torch.zeros(*k.shape[:2], k.shape[-1], v.shape[-1], dtype=torch.float64, device=k.device)
    for start in range(0, end, piece):
        stop = min(start + piece, end)
        state += k[:, :, start:stop].double().mT @ v[:, :, start:stop].double()
    return state


def windowed_product(q, k, v, window, *, reverse=False, piece):
    """The causal product's outputs on tokens ``window`` (a slice) in float64: forward, o_t sees
    s <= t; reverse, o_t sees s >= t (the form of dk and dv)."""
    a, b = window.start, window.stop
    T = q.shape[2]
    if not reverse:
        start_state = prefix_state(k, v, a, piece)
        o, _ = references.quadratic(q[:, :, a:b].double(), k[:, :, a:b].double(), v[:, :, a:b].double(),
                                    start_state)
        return o
    flipped = [x[:, :, a:b].flip(2).double() for x in (q, k, v)]
    suffix = prefix_state(k[:, :, b:], v[:, :, b:], T - b, piece)
    o, _ = references.quadratic(*flipped, suffix)
    return o.flip(2)


def draw(shape, seed, dtype, device, *, scale=1.0, requires_grad=False):
    """Normal values drawn on ``device`` itself: testing.random_inputs draws float64 on the host,
    minutes for 2**31 of them."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=generator, device=device) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def check_one_long_head(method, T, D, *, dtype, window, piece, device):
    """Forward and backward of one (1, 1, T, D) head, compared on its first, middle and last
    ``window`` tokens with the float64 reference; S_T in full."""
    q, k = (draw((1, 1, T, D), seed, dtype, device, scale=D**-0.5, requires_grad=True) for seed in (31, 32))
    v = draw((1, 1, T, D), 33, dtype, device, requires_grad=True)
    grad_o = draw((1, 1, T, D), 34, dtype, device)
    o, state = ttx_tutorial.causal_product(q, k, v, method, return_state=True)
    grads = torch.autograd.grad(o, (q, k, v), grad_o)
    check_windows(method, [x.detach() for x in (q, k, v)], grad_o, o, state, grads, dtype=dtype,
                  window=window, piece=piece)


def check_windows(method, inputs, grad_o, o, state, grads, *, dtype, window, piece, where=""):
    """o, S_T and the gradients of one (1, 1, T, D) head against float64, on its first, middle and
    last ``window`` tokens."""
    q, k, v = inputs
    dq, dk, dv = grads
    T = q.shape[2]
    errors = []

    def check(name, out, ref):
        errors.append(testing.assert_close(out, ref, dtype, f"{method} {name}"))

    check(f"S_T{where}", state, prefix_state(k, v, T, piece))
    for start in (0, T // 2 - window // 2, T - window):
        part = slice(start, start + window)
        tokens = f"{where} tokens {start}..{start + window - 1}"
        check(f"o at{tokens}", o[:, :, part], windowed_product(q, k, v, part, piece=piece))
        # dq = forward product (dO, v, k); dk = reverse (v, dO, q); dv = reverse (k, q, dO).
        check(f"dq at{tokens}", dq[:, :, part], windowed_product(grad_o, v, k, part, piece=piece))
        check(f"dk at{tokens}", dk[:, :, part], windowed_product(v, grad_o, q, part, reverse=True, piece=piece))
        check(f"dv at{tokens}", dv[:, :, part], windowed_product(k, q, grad_o, part, reverse=True, piece=piece))
    # The run's record of the accuracy measured at size (pytest -rP shows it).
    print(f"{method}{where}: largest relative error {max(errors):.2e} (tolerance {testing.tolerance(dtype):.0e})")


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_the_windowed_reference_at_a_small_size(method, device):
    check_one_long_head(method, 300, 8, dtype=torch.float32, window=40, piece=64, device=device)


@pytest.mark.gpu
@at_size
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_one_head_ending_at_the_last_32_bit_offset(method):
    T, D = 2**25, 64  # (T - 1) * D + (D - 1) = 2**31 - 1, the last offset int32 reaches
    check_one_long_head(method, T, D, dtype=torch.bfloat16, window=2048, piece=2**22, device="cuda")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@at_size
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_a_batch_of_more_than_2_31_elements(method):
    B, H, T, D = 4, 32, 2**18 + 64, 64  # 2**31 + 2**14 * 64 elements in each of q, k, v
    q, k = (draw((B, H, T, D), seed, torch.bfloat16, "cuda", scale=D**-0.5, requires_grad=True) for seed in (35, 36))
    v = draw((B, H, T, D), 37, torch.bfloat16, "cuda", requires_grad=True)
    assert q.numel() > 2**31
    grad_o = draw((B, H, T, D), 38, torch.bfloat16, "cuda")
    o, state = ttx_tutorial.causal_product(q, k, v, method, return_state=True)
    grads = torch.autograd.grad(o, (q, k, v), grad_o)
    for b, h in ((0, 0), (B // 2, H // 2), (B - 1, H - 1)):  # the last head lies past offset 2**31
        head = slice(b, b + 1), slice(h, h + 1)
        check_windows(method, [x.detach()[head] for x in (q, k, v)], grad_o[head], o[head], state[head],
                      [grad[head] for grad in grads], dtype=torch.bfloat16, window=2048, piece=2**16,
                      where=f" of head ({b}, {h})")
    del q, k, v, o, state, grads
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_a_head_just_over_the_limit_is_refused_with_the_documented_error(method):
    T, D = 2**25 + 1, 64  # its last element sits at offset 2**31 + 63
    q = torch.empty(1, 1, T, D, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"32-bit offsets.*2147483712 elements per head.*2147483648"):
        ttx_tutorial.causal_product(q, q, q, method)


def host_memory_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set, Linux KiB


@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS)
def test_memory_stays_flat_over_10000_forward_backward_calls(method):
    q, k, v, s0 = testing.random_inputs(2, 4, 257, 64, 64, dtype=torch.bfloat16, device="cuda", seed=35,
                                        initial_state=True, requires_grad=True)

    def call():
        o, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
        torch.autograd.grad(o.float().sum() + state.sum(), (q, k, v, s0))

    for _ in range(100):  # compile, caches, the allocator's pools
        call()

    def footprint():
        gc.collect()  # garbage in reference cycles (of this or earlier tests) is freed at random times
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), host_memory_bytes()

    # A leak grows with the calls; something allocated once, late (a cache filled on some later
    # call), does not. So the second half of the calls must leave every figure where the first left it.
    for _ in range(5_000):
        call()
    allocated, reserved, host = footprint()
    for _ in range(5_000):
        call()
    allocated_after, reserved_after, host_after = footprint()
    assert allocated_after == allocated, f"GPU memory still allocated grew by {allocated_after - allocated} bytes"
    assert reserved_after <= reserved, "the allocator reserved more GPU memory"
    assert host_after - host < 64 * 2**20, "the host's peak memory grew by more than 64 MiB"
