"""Helpers of the megatron/expert-parallel tests (a unique module name: the test dirs are not packages)."""

import pytest
import torch


def check_result(results, name):
    """The per-rank results of one check; fails the test with the rank's traceback if it raised."""
    for rank, result in enumerate(results):
        if "error" in result[name]:
            pytest.fail(f"check {name!r} raised on rank {rank}:\n{result[name]['error']}", pytrace=False)
    return [result[name] for result in results]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the plain difference norm when b is zero)."""
    diff = (a.double() - b.double()).norm().item()
    scale = b.double().norm().item()
    return diff / scale if scale > 0 else diff
