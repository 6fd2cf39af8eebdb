"""ttx_tutorial: causal linear attention in Triton, from the naive recurrence to parallel scans.

Importing the package decides how kernels run (see :mod:`ttx_tutorial._device`): on a CUDA
GPU when one is present, otherwise through Triton's CPU interpreter. The decision is made
before any Triton kernel is defined and without touching the GPU driver.
"""

from ._device import DEVICE, INTERPRETED  # first: sets TRITON_INTERPRET before any @triton.jit
from .api import MAX_HEAD_DIM, METHODS, causal_product, choose_method, method_info
from .attention import FEATURE_MAPS, CausalLinearAttention, causal_linear_attention, linear_attention_step
from .course.notebook import banner, describe, on_gpu, size  # what every notebook starts with

__version__ = "0.1.0"


def __getattr__(name):
    # ttx_tutorial.distributed loads on first use: most programs never need it.
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Lowest and highest versions the whole suite has passed on: the GPU machine (H200) runs the
#: lowest, CI (constraints.txt, CPU interpreter) the highest. Widen only after a full run.
COMPATIBILITY = {"torch": ("2.11", "2.13"), "triton": ("3.6", "3.9")}

__all__ = [
    "COMPATIBILITY",
    "CausalLinearAttention",
    "DEVICE",
    "FEATURE_MAPS",
    "INTERPRETED",
    "MAX_HEAD_DIM",
    "METHODS",
    "banner",
    "causal_linear_attention",
    "causal_product",
    "choose_method",
    "describe",
    "linear_attention_step",
    "method_info",
    "on_gpu",
    "size",
]
