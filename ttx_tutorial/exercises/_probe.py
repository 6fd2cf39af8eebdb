"""A known-good bfloat16 ``tl.dot``, to ask the interpreter whether it computes them right."""

import torch
import triton
import triton.language as tl

from .. import _device
from ..testing import relative_error


@triton.jit
def _bf16_dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * N + offs[None, :])
    tl.store(c_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, b))


def bf16_dot_error() -> float:
    """Relative error of a 16 x 16 bfloat16 tl.dot against float64 on the same inputs."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=generator).to(torch.bfloat16).to(_device.DEVICE) for _ in range(2))
    c = torch.empty(16, 16, device=_device.DEVICE)
    _bf16_dot_kernel[(1,)](a, b, c, N=16)
    return relative_error(c, a.double() @ b.double())
