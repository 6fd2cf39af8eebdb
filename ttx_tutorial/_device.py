"""Choose between the GPU and Triton's CPU interpreter, before any kernel exists.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``@triton.jit``,
so the choice must be made before any kernel module is imported. The choice is made
without touching the GPU driver: we only ask whether torch was built with CUDA and
whether the operating system exposes an NVIDIA device node.

Override with ``TTX_TUTORIAL_DEVICE=cpu`` (interpreter) or ``TTX_TUTORIAL_DEVICE=cuda``.
An explicit ``TRITON_INTERPRET`` set by the user wins over both.
"""

from __future__ import annotations

import glob
import os

import torch

_CHOICES = ("cpu", "cuda")


def _nvidia_device_node_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _choose_mode() -> tuple[bool, str]:
    """Return (interpreted, reason)."""
    if "TRITON_INTERPRET" in os.environ:
        interpreted = os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "on", "yes")
        return interpreted, "TRITON_INTERPRET was set by the user"
    forced = os.environ.get("TTX_TUTORIAL_DEVICE", "").strip().lower()
    if forced:
        if forced not in _CHOICES:
            raise ValueError(f"TTX_TUTORIAL_DEVICE must be one of {_CHOICES}, got {forced!r}")
        return forced == "cpu", f"TTX_TUTORIAL_DEVICE={forced}"
    if torch.backends.cuda.is_built() and _nvidia_device_node_present():
        return False, "a CUDA build of torch and an NVIDIA device were found"
    return True, "no CUDA GPU found (CPU-only torch or no NVIDIA device)"


# Triton 3.9 warns on every compile unless this is set; "1" keeps its long-standing default.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

INTERPRETED, REASON = _choose_mode()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cpu") if INTERPRETED else torch.device("cuda")
