"""Where the host time of a forward+backward call goes: the autograd engine against the kernels.

    python benchmarks/backward_host.py          # GPU only; about a minute (fla's first calls autotune)

At (8, 16, T, 64) bfloat16, T = 64 (microseconds of GPU work: what remains is the host's) and
T = 4096, each row is the host time of one call in a loop that never waits for the GPU (the least
of five loops of 200 calls, synchronised once at the end of each):

  fwd no grad / fwd building graph   causal_product(method="chunked") on inputs without and with
                                     requires_grad
  fb accumulate                      forward and .backward(g), gradients accumulating into .grad
  fb grads None                      the same with .grad cleared before each call
  fb autograd.grad                   torch.autograd.grad(o, leaves, g)
  _launch_backward alone             the kernel file's backward launch on this thread, no autograd
  floor Function ...                 a torch.autograd.Function that only allocates its outputs
  floor + ...                        the same, its backward launching one empty Triton kernel or
                                     one PyTorch kernel
  ..., autograd single thread        inside torch.autograd.set_multithreading_enabled(False): the
                                     engine runs the backward on the calling thread instead of
                                     handing it to the device's worker thread
  fla ...                            fla's fused_chunk_linear_attn (T = 4096 only), when installed
"""

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ttx_tutorial  # noqa: E402  (sets the device mode before any kernel is defined)
from ttx_tutorial import bench  # noqa: E402
from ttx_tutorial.kernels import chunked  # noqa: E402
from ttx_tutorial.testing import random_inputs  # noqa: E402


def host_us(fn, calls=200, loops=5):
    """Least over ``loops`` loops of the host's microseconds per call (``bench.host_us``)."""
    for _ in range(10):
        fn()
    return min(bench.host_us(fn, calls) for _ in range(loops))


class Floor(torch.autograd.Function):
    """The least a differentiable operator costs: outputs allocated, nothing computed."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


@triton.jit
def empty_kernel(x_ptr):
    pass


class FloorLaunching(torch.autograd.Function):
    """Floor, whose backward also launches one empty Triton kernel, or one PyTorch kernel: what
    a launch costs on the thread that runs the backward."""

    @staticmethod
    def forward(ctx, q, k, v, triton_launch):
        ctx.triton_launch = triton_launch
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, grad):
        if ctx.triton_launch:
            empty_kernel[(1,)](grad)
        else:
            grad.new_zeros(1)
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad), None


def single_thread(fn):
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            fn()
    return call


def rows(T):
    q, k, v = random_inputs(8, 16, T, 64, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(v)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def product(*inputs):
        return ttx_tutorial.causal_product(*inputs, method="chunked")

    def clear_grads():
        for leaf in leaves:
            leaf.grad = None

    plan = chunked._backward_plan(8 * 16, T, 64, 64, torch.bfloat16, chunked._device_limits(q.device), False, ())
    table = {
        "fwd no grad": lambda: product(q, k, v),
        "fwd building graph": lambda: product(*leaves),
        "fb accumulate": lambda: product(*leaves).backward(grad),
        "fb grads None": lambda: (clear_grads(), product(*leaves).backward(grad)),
        "fb autograd.grad": lambda: torch.autograd.grad(product(*leaves), leaves, grad),
        "_launch_backward alone": lambda: chunked._launch_backward(q, k, v, None, grad, None, plan, compute_dq=True),
        "floor Function fb accumulate": lambda: Floor.apply(*leaves).backward(grad),
        "floor Function fb grads None": lambda: (clear_grads(), Floor.apply(*leaves).backward(grad)),
    }
    table["floor + empty Triton launch fb"] = lambda: FloorLaunching.apply(*leaves, True).backward(grad)
    table["floor + one PyTorch kernel fb"] = lambda: FloorLaunching.apply(*leaves, False).backward(grad)
    table["fb accumulate, autograd single thread"] = single_thread(table["fb accumulate"])
    table["floor fb, autograd single thread"] = single_thread(table["floor Function fb accumulate"])
    table["floor + empty Triton launch, single thread"] = single_thread(table["floor + empty Triton launch fb"])
    if T == 4096:  # fla autotunes at each new shape: one shape keeps the run short
        try:
            from fla.ops.linear_attn import fused_chunk_linear_attn
        except ImportError:
            print("fla is not installed: its rows are left out")
        else:
            q_t, k_t, v_t, grad_t = (x.transpose(1, 2).contiguous() for x in (q, k, v, grad))
            fla_leaves = [x.detach().requires_grad_(True) for x in (q_t, k_t, v_t)]
            table["fla fwd"] = lambda: fused_chunk_linear_attn(q_t, k_t, v_t, scale=1.0, normalize=False)[0]
            table["fla fb accumulate"] = (
                lambda: fused_chunk_linear_attn(*fla_leaves, scale=1.0, normalize=False)[0].backward(grad_t))
            table["fla fb, autograd single thread"] = single_thread(table["fla fb accumulate"])
    return table


def main():
    if not ttx_tutorial.on_gpu():
        print("backward_host.py times host work around GPU launches: it needs a CUDA GPU")
        return 0
    for T in (64, 4096):
        for name, fn in rows(T).items():
            print(f"T={T:5d} {name:40s} {host_us(fn):8.1f} us a call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
