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
