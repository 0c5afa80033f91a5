"""moe_plugin.testing.launch.run_distributed: per-rank results in rank order, CPU runs with GPUs hidden, a
file rendezvous, failures and stalls surfaced with every rank's output, the run's clock started once every
rank is ready (start-up bounded on its own), bad input."""

import socket
from pathlib import Path

import pytest
import torch

from moe_plugin.testing import launch
from moe_plugin.testing.launch import default_process_group_timeout, resolve_function, run_distributed

WORKERS = Path(__file__).with_name("launch_workers.py")


@pytest.mark.distributed
def test_results_come_back_in_rank_order():
    results = run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=120, offset=10)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert all(r["sum"] == 0 + 1 + 2 * 10 for r in results), "the ranks must be joined in one process group"
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in results), "one OpenMP thread per rank"
    assert all(torch.equal(r["tensor"], torch.full((2,), float(i))) for i, r in enumerate(results))


@pytest.mark.distributed
def test_gloo_run_hides_gpus_and_times_out_collectives_before_the_launcher(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a GPU runner: the children must not see it
    results = run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=120)
    for r in results:
        assert r["backend"] == "gloo" and r["cuda"] is False and r["visible_gpus"] == ""
        assert r["group_timeout_s"] == pytest.approx(default_process_group_timeout(120))
    assert default_process_group_timeout(300) < 300


def test_nccl_run_keeps_gpus_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert launch._child_env(2, tmp_path, "nccl", 10.0)["CUDA_VISIBLE_DEVICES"] == "0"
    assert launch._child_env(2, tmp_path, "gloo", 10.0)["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.distributed
def test_a_port_taken_by_another_job_does_not_matter(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the parent's own torchrun rendezvous, and the port a free-port probe would have handed out
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setattr(launch, "free_port", lambda: port, raising=False)
        results = run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=120, offset=1)
    assert [r["sum"] for r in results] == [3.0, 3.0]


@pytest.mark.distributed
def test_a_failing_rank_raises_with_its_traceback_and_every_output():
    with pytest.raises(RuntimeError) as info:
        run_distributed(f"{WORKERS}:fail_on", world_size=2, timeout_s=120, rank=1)
    message = str(info.value)
    assert message.startswith("rank 1 exited"), "the rank that raised first must be reported first"
    assert "ValueError: deliberate failure on rank 1" in message
    assert "rank 0 was still running" in message and "rank 0 started" in message, (
        "the other ranks' state and output must be in the report"
    )


@pytest.mark.distributed
def test_a_rank_stuck_in_a_collective_fails_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        run_distributed(f"{WORKERS}:stall_on", world_size=2, timeout_s=100, process_group_timeout_s=2, rank=0)
    message = str(info.value)
    assert message.startswith("rank 1 exited"), message
    assert "dist.barrier()" in message, "the waiting rank's traceback must show where it waited"
    assert "rank 0 stalls" in message


@pytest.mark.distributed
def test_timeout_stops_the_ranks_and_reports_their_output():
    # the clock starts once both ranks are ready, so however slow their imports, 10 s is enough to print
    with pytest.raises(TimeoutError, match="did not finish within 10 s after every rank was ready") as info:
        run_distributed(f"{WORKERS}:sleep_forever", world_size=2, timeout_s=10, init_process_group=False)
    message = str(info.value)
    assert "rank 0 sleeps" in message and "rank 1 sleeps" in message
    assert "rank 0 was still running" in message and "rank 1 was still running" in message


@pytest.mark.distributed
def test_start_up_does_not_count_against_the_timeout(monkeypatch):
    monkeypatch.setenv("LAUNCH_WORKERS_IMPORT_DELAY_S", "12")  # each rank's start-up: 12 s more
    results = run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=10, offset=1)
    assert [r["sum"] for r in results] == [3.0, 3.0], "a run shorter than timeout_s must not time out"


@pytest.mark.distributed
def test_a_start_up_that_never_ends_is_bounded(monkeypatch):
    monkeypatch.setenv("LAUNCH_WORKERS_IMPORT_DELAY_S", "600")  # the ranks never get to report ready
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] did not start up within 5 s") as info:
        run_distributed(f"{WORKERS}:report", world_size=2, timeout_s=60, startup_timeout_s=5)
    assert "rank 0 was still starting up" in str(info.value)


@pytest.mark.parametrize(
    "path, match",
    [
        ("no_colon_here", "worker_fn_path"),
        (f"{WORKERS}:missing_function", "missing_function"),
        ("/no/such/file.py:f", "no such file"),
    ],
)
def test_bad_worker_path(path, match):
    with pytest.raises(ValueError, match=match):
        resolve_function(path)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "backend": "mpi"}, "backend"),
        ({"world_size": 2, "timeout_s": 10, "process_group_timeout_s": 10}, "process_group_timeout_s"),
        ({"world_size": 2, "process_group_timeout_s": 0}, "process_group_timeout_s"),
        ({"world_size": 2, "startup_timeout_s": 0}, "startup_timeout_s"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_distributed(f"{WORKERS}:report", **kwargs)
