"""Shared fixtures. Importing ttx_tutorial first puts Triton in interpreter mode without a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

import ttx_tutorial

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_collection_modifyitems(config, items):
    if ttx_tutorial.on_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return ttx_tutorial.DEVICE


@pytest.fixture
def benchmark_script():
    """Loads a script of benchmarks/ by file name (e.g. "host_overhead") as a module: the folder
    is not a package, and the tests call the scripts' functions."""
    def load(name):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
