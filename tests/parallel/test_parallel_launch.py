"""moe_plugin.parallel.launch.run_distributed: per-rank results in rank order, failures surfaced, bad input."""

from pathlib import Path

import pytest
import torch

from moe_plugin.parallel.launch import resolve_function, run_distributed

WORKERS = Path(__file__).with_name("launch_workers.py")


def test_results_come_back_in_rank_order():
    results = run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=120, offset=10)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert all(r["sum"] == 0 + 1 + 2 * 10 for r in results), "the ranks must be joined in one process group"
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in results), "one OpenMP thread per rank"
    assert all(torch.equal(r["tensor"], torch.full((2,), float(i))) for i, r in enumerate(results))


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        run_distributed(f"{WORKERS}:fail_on", world_size=2, timeout_s=120, rank=1)
    message = str(info.value)
    assert message.startswith("rank 1 exited"), "the rank that raised first must be reported first"
    assert "ValueError: deliberate failure on rank 1" in message


def test_timeout_stops_the_ranks():
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        run_distributed(f"{WORKERS}:sleep_forever", world_size=2, timeout_s=3, init_process_group=False)


@pytest.mark.parametrize("path, match", [
    ("no_colon_here", "worker_fn_path"),
    (f"{WORKERS}:missing_function", "missing_function"),
    ("/no/such/file.py:f", "no such file"),
])
def test_bad_worker_path(path, match):
    with pytest.raises(ValueError, match=match):
        resolve_function(path)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(f"{WORKERS}:report", world_size=0)
