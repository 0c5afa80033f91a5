"""One 2-process launch shared by every expert-parallel test (rank code in ep_workers.py); tests only assert.

Helpers are fixtures because the suite runs with ``--import-mode=importlib`` (test dirs are not importable).
"""

from pathlib import Path

import pytest
import torch

from moe_plugin.testing.launch import run_distributed

WORKERS = Path(__file__).with_name("ep_workers.py")


@pytest.fixture(scope="session")
def ep_results():
    """Per-rank result dicts of ep_workers.run_all_checks at world size 2, EP=2."""
    return run_distributed(f"{WORKERS}:run_all_checks", world_size=2, timeout_s=300, ep_size=2)


@pytest.fixture(scope="session")
def ep_check(ep_results):
    """``ep_check(name)``: the per-rank results of one check; fails the test with the traceback of a rank
    where that check raised."""

    def results_of(name):
        for rank, result in enumerate(ep_results):
            if "error" in result[name]:
                pytest.fail(f"check {name!r} raised on rank {rank}:\n{result[name]['error']}", pytrace=False)
        return [result[name] for result in ep_results]

    return results_of


@pytest.fixture(scope="session")
def rel_err():
    """``rel_err(a, b)``: ||a - b|| / ||b|| in float64 (the plain difference norm when b is zero)."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        diff = (a.double() - b.double()).norm().item()
        scale = b.double().norm().item()
        return diff / scale if scale > 0 else diff

    return rel
