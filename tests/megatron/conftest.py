"""One 2-process launch shared by every expert-parallel test (see ep_workers.py); the tests only assert."""

from pathlib import Path

import pytest

from moe_plugin.parallel.launch import run_distributed

WORKERS = Path(__file__).with_name("ep_workers.py")


@pytest.fixture(scope="session")
def ep_results():
    """Per-rank result dicts of ep_workers.run_all_checks at world size 2, EP=2."""
    return run_distributed(f"{WORKERS}:run_all_checks", world_size=2, timeout_s=300, ep_size=2)
