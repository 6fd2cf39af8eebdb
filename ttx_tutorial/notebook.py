"""Small helpers for the notebooks: what mode we are in, and problem sizes that fit it."""

from __future__ import annotations

import platform

import torch
import triton

from . import _device


def on_gpu() -> bool:
    """True when kernels are compiled for and run on a CUDA GPU."""
    return not _device.INTERPRETED


def size(cpu, gpu):
    """Pick a problem size: ``gpu`` on a GPU, the smaller ``cpu`` under the interpreter.

    The interpreter executes each Triton program in NumPy, thousands of times slower
    than a GPU, so notebooks shrink their problems through this one helper.
    """
    return gpu if on_gpu() else cpu


def describe() -> str:
    """One line on how this session runs kernels, printed at the top of every notebook."""
    from . import __version__

    if on_gpu():
        where = f"GPU mode: kernels compiled for CUDA ({_device.REASON})"
    else:
        where = f"CPU mode: Triton interpreter, TRITON_INTERPRET=1 ({_device.REASON})"
    return (f"ttx_tutorial {__version__} | {where} | python {platform.python_version()} | "
            f"torch {torch.__version__} | triton {triton.__version__}")
