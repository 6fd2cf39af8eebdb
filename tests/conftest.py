"""Shared fixtures. Importing ttx_tutorial first puts Triton in interpreter mode without a GPU."""

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
