"""Helpers shared by the tests and the notebooks: inputs, float64 references, error checks."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from . import _device
from .references import quadratic

#: Largest accepted ||out - ref|| / ||ref|| against a float64 reference, per input dtype.
TOLERANCES = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}


def random_inputs(B, H, T, D, E=None, *, dtype=torch.float32, device=None, seed=None,
                  initial_state=False, requires_grad=False):
    """Fresh random q, k, v (and optionally S_0), shaped for ``causal_product``.

    q, k ~ N(0, 1) / sqrt(D) and v ~ N(0, 1), so that q.k is O(1) as in attention; the
    initial state ~ N(0, 1) in float32. Returns ``(q, k, v)`` or ``(q, k, v, s0)``.
    """
    E = D if E is None else E
    device = _device.DEVICE if device is None else torch.device(device)
    generator = torch.Generator(device="cpu")  # private: never reseeds torch's global generator
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    def draw(*shape, scale=1.0, dt=dtype):
        x = (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dt)
        return x.to(device).requires_grad_(requires_grad)

    q = draw(B, H, T, D, scale=1 / math.sqrt(D))
    k = draw(B, H, T, D, scale=1 / math.sqrt(D))
    v = draw(B, H, T, E)
    if not initial_state:
        return q, k, v
    return q, k, v, draw(B, H, D, E, dt=torch.float32)


def reference(q, k, v, initial_state=None, *, device="cpu", chunk=1024):
    """``(o, S_T)`` computed in float64 from the given (possibly low-precision) inputs.

    Runs on ``device`` (the CPU by default). Sequences longer than ``chunk`` are processed
    chunk by chunk (the quadratic form inside a chunk, the state carried between chunks),
    so memory stays O(chunk^2) instead of O(T^2).
    """
    def up(x):
        return None if x is None else x.detach().to(device, torch.float64)

    q, k, v, state = up(q), up(k), up(v), up(initial_state)
    if q.shape[2] <= chunk:
        return quadratic(q, k, v, state)
    outputs = []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        o, state = quadratic(q[:, :, part], k[:, :, part], v[:, :, part], state)
        outputs.append(o)
    return torch.cat(outputs, dim=2), state


def reference_gradients(q, k, v, initial_state, grad_o, grad_state):
    """The float64 reference and its gradients on the same input values, on the CPU:
    ``(o, S_T, {name: gradient})``, the gradients of <o, grad_o> + <S_T, grad_state> with
    respect to "q", "k", "v" and, when it is given, "initial_state"."""
    leaves = {name: x.detach().to("cpu", torch.float64).requires_grad_()
              for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", initial_state)) if x is not None}
    o, state = quadratic(leaves["q"], leaves["k"], leaves["v"], leaves.get("initial_state"))
    # Through the outputs that depend on a leaf (with T = 0 and no initial state, none does).
    pairs = [(out, grad.to("cpu", torch.float64)) for out, grad in ((o, grad_o), (state, grad_state))
             if out.requires_grad]
    if pairs:
        torch.autograd.backward(*zip(*pairs))
    # zeros where autograd left None: a leaf that did not influence the outputs
    gradients = {name: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for name, leaf in leaves.items()}
    return o.detach(), state.detach(), gradients


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (the plain norm of out when ref is all zeros).

    NaN or inf anywhere gives ``inf``, so a poisoned, unwritten element never passes.
    """
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return math.inf
    if out.numel() == 0:
        return 0.0
    scale = torch.linalg.vector_norm(ref).item()
    diff = torch.linalg.vector_norm(out - ref).item()
    return diff / scale if scale > 0 else diff


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCES[dtype]


def assert_close(out, ref, dtype, name="output"):
    """Fail unless ``relative_error(out, ref)`` is within the tolerance for ``dtype``."""
    err = relative_error(out, ref)
    tol = tolerance(dtype)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds {tol:.0e} for {dtype}")
    return err


@contextlib.contextmanager
def poisoned_allocations():
    """Within the block, ``torch.empty`` and ``torch.empty_like`` return NaN-filled floating tensors.

    Kernel wrappers allocate their outputs with these, so any element a kernel forgets to
    write stays NaN and ``relative_error`` reports ``inf``.
    """
    original_empty, original_empty_like = torch.empty, torch.empty_like

    def poison(x):
        if x.dtype.is_floating_point:
            x.fill_(math.nan)
        return x

    def empty(*args, **kwargs):
        return poison(original_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison(original_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = original_empty, original_empty_like


# A model of NVIDIA tensor cores' float32 arithmetic, as measured by Fasi et al., "Numerical
# behavior of NVIDIA tensor cores" (2021): TF32 operands keep the sign, the exponent and the top
# 10 of the 23 mantissa bits, the other 13 dropped, not rounded; products are exact; the
# accumulator is truncated to float32 after every k-step of 8. Dropped rather than rounded is
# what matches the errors measured on H100 and H200 GPUs (tests/test_precision.py).

def tf32_cut(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` as a tensor core reads a TF32 operand: the low 13 mantissa bits dropped."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest TF32 value, ties away from zero, as Triton's 3xTF32
    takes each operand's big part (``cvt.rna.tf32.f32``)."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def _bf16_rounded(x):
    return x.to(torch.bfloat16).float()


def _truncated_to_float32(x):
    y = x.float()
    return torch.where(y.double().abs() > x.abs(), torch.nextafter(y, torch.zeros_like(y)), y)


def _mma(a, b, accumulator):
    for k0 in range(0, a.shape[-1], 8):
        accumulator = _truncated_to_float32(accumulator.double()
                                            + a[..., k0:k0 + 8].double() @ b[..., k0:k0 + 8, :].double())
    return accumulator


def tensor_core_dot(a: torch.Tensor, b: torch.Tensor, accumulator: torch.Tensor, precision: str) -> torch.Tensor:
    """``accumulator + a @ b`` of float32 tensors as a tensor core computes ``tl.dot`` with
    ``input_precision=precision``: "tf32" (one product of operands cut to TF32), "tf32x3" (each
    operand split into a rounded TF32 part and the remainder cut to TF32; the remainders'
    products first, in the order of Triton's decomposition) or "bf16x3" (the same with bfloat16
    parts)."""
    if precision == "tf32":
        return _mma(tf32_cut(a), tf32_cut(b), accumulator)
    if precision == "bf16x3":
        a_big, b_big = _bf16_rounded(a), _bf16_rounded(b)
        accumulator = _mma(_bf16_rounded(a - a_big), b_big, accumulator)
        accumulator = _mma(a_big, _bf16_rounded(b - b_big), accumulator)
        return _mma(a_big, b_big, accumulator)
    if precision != "tf32x3":
        raise ValueError(f"precision must be 'tf32', 'tf32x3' or 'bf16x3', got {precision!r}")
    a_big, b_big = tf32_rounded(a), tf32_rounded(b)
    accumulator = _mma(tf32_cut(a - a_big), b_big, accumulator)
    accumulator = _mma(a_big, tf32_cut(b - b_big), accumulator)
    return _mma(a_big, b_big, accumulator)


@contextlib.contextmanager
def emulated_tensor_cores():
    """Within the block, Triton's interpreter computes ``tl.dot`` of float32 operands with
    ``input_precision`` "tf32" or "tf32x3" as ``tensor_core_dot`` does, so that CPU mode shows the
    error of the precision a kernel asks for (by default the interpreter multiplies in plain
    float32 and reads the option nowhere). "ieee" and operands of other dtypes stay as the
    interpreter computes them. Compiled kernels are unaffected: on a GPU the tensor cores compute
    them, so a test under this block checks TF32's error in either mode.
    """
    import numpy as np
    import triton
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    interpreter_dot = getattr(builder, "create_dot", None)
    if interpreter_dot is None:
        raise RuntimeError(f"emulated_tensor_cores needs Triton's InterpreterBuilder.create_dot, which Triton "
                           f"{triton.__version__} does not have (tested with Triton 3.6 and 3.9)")
    precisions = {ir.INPUT_PRECISION.TF32: "tf32", ir.INPUT_PRECISION.TF32x3: "tf32x3"}

    def create_dot(self, a, b, accumulator, input_precision, max_num_imprecise_acc):
        float32 = a.data.dtype == b.data.dtype == accumulator.data.dtype == np.float32
        if not float32 or input_precision not in precisions:
            return interpreter_dot(self, a, b, accumulator, input_precision, max_num_imprecise_acc)
        result = tensor_core_dot(*(torch.from_numpy(np.ascontiguousarray(x.data)) for x in (a, b, accumulator)),
                                 precisions[input_precision])
        return interpreter.TensorHandle(result.numpy(), accumulator.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = interpreter_dot


def run_python(script: str | Path, *args: str, timeout: float = 900, **environment: str,
               ) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source, or the path of a file) with ``args`` in a fresh Python and
    return the finished process, its output captured as text.

    The child chooses its mode from ``environment`` alone (this process's ``TRITON_INTERPRET``
    and ``TTX_TUTORIAL_DEVICE`` are dropped), by default ``TTX_TUTORIAL_DEVICE=cuda``: outside
    the interpreter, where ``@triton.jit`` builds the ``JITFunction`` a GPU run compiles, on any
    machine, and nothing an interpreted kernel left patched in this process can reach it. Source
    is run from a file, since ``@triton.jit`` reads its kernels' source; this package comes
    first on the child's path.
    """
    env = {name: value for name, value in os.environ.items()
           if name not in ("TRITON_INTERPRET", "TTX_TUTORIAL_DEVICE")}
    env.update(environment or {"TTX_TUTORIAL_DEVICE": "cuda"})
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        if not isinstance(script, Path):
            path = Path(folder) / "child.py"
            path.write_text(textwrap.dedent(script))
            script = path
        return subprocess.run([sys.executable, str(script), *args], env=env, cwd=package_root,
                              capture_output=True, text=True, timeout=timeout)
