"""Shared fixtures: tiny random HF checkpoints (no download) and the transformers oracle."""

from __future__ import annotations

import os

os.environ.setdefault("SPLITSERVE_DEBUG", "1")  # state-slot guard + NaN poisoning of freed slots

import pytest
import torch

from tests import oracle


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(name) -> (path, hf_model) for a named tiny config in tests.oracle.CONFIGS."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, oracle.save_tiny_model(name, path))
        return cache[name]

    return make


@pytest.fixture(scope="session", params=["jamba", "mamba", "llama"])
def family_model(request, model_factory):
    """One representative tiny model per family: (family, path, hf_model)."""
    path, hf = model_factory(request.param)
    return request.param, path, hf
