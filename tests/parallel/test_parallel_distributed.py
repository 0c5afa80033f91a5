"""moe_plugin.parallel.distributed: bad input is refused with the argument's name; a launched rank that
starts megatron itself finds the rendezvous and timeout in its environment and gets seeded weights."""

from pathlib import Path

import pytest
import torch

from moe_plugin.parallel.cpu_compat import CPU_PATCH_NAMES
from moe_plugin.parallel.distributed import INIT_METHOD_ENV, init_distributed, initialize_megatron
from moe_plugin.parallel.launch import run_distributed

WORKERS = Path(__file__).with_name("distributed_workers.py")


@pytest.mark.parametrize("kwargs, name", [
    ({"expert_model_parallel_size": 0}, "expert_model_parallel_size"),
    ({"tensor_model_parallel_size": 1.5}, "tensor_model_parallel_size"),
])
def test_bad_parallel_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        initialize_megatron(**kwargs)


def test_missing_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", INIT_METHOD_ENV):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_distributed()
    monkeypatch.setenv(INIT_METHOD_ENV, "file:///nowhere")  # a file rendezvous needs no address or port
    with pytest.raises(ValueError, match="environment: RANK, WORLD_SIZE must be set"):
        init_distributed()


@pytest.mark.parametrize("kwargs, name", [({"backend": "mpi"}, "backend"), ({"timeout_s": 0}, "timeout_s")])
def test_bad_backend_and_timeout(monkeypatch, kwargs, name):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=name):
        init_distributed(**kwargs)


def test_ranks_started_by_initialize_megatron_share_the_seeded_generator():
    results = run_distributed(f"{WORKERS}:start_megatron_and_draw", world_size=2, timeout_s=200,
                              init_process_group=False, seed=7)
    torch.manual_seed(7)
    expected = torch.rand(4)
    for rank, r in enumerate(results):
        assert r["ep_rank"] == rank
        assert r["cuda"] is False and r["patches"] == list(CPU_PATCH_NAMES)
        assert r["group_timeout_s"] == pytest.approx(150.0), "the launcher's timeout must reach init_distributed"
        assert torch.equal(r["draw"], expected), f"rank {rank}: the default generator must be seeded with seed"
