"""Suite-wide tiers (docs/testing.md): ``gpu`` tests are skipped, with the reason, where CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); benchmarks/gpu_check.py runs these on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
