"""moe_plugin.parallel.distributed: a process is prepared for its device explicitly (CPU stand-ins, or a
usable CUDA and the LOCAL_RANK GPU); bad input is refused with the argument's name; a launched rank that
starts megatron itself finds its device, the rendezvous and the timeout and gets seeded weights."""

from pathlib import Path

import pytest
import torch

from moe_plugin.parallel import distributed
from moe_plugin.parallel.cpu_compat import CPU_PATCH_NAMES
from moe_plugin.parallel.distributed import INIT_METHOD_ENV, init_distributed, initialize_megatron, prepare_device
from moe_plugin.testing.launch import run_distributed

WORKERS = Path(__file__).with_name("distributed_workers.py")


@pytest.fixture
def unprepared(monkeypatch):
    """This process as if prepare_device had never been called; what a test prepares is forgotten after it."""
    monkeypatch.setattr(distributed, "_PREPARED", [])


@pytest.fixture
def fake_gpus(monkeypatch, unprepared):
    """Two usable GPUs as torch reports them; returns the list of devices set_device was called with."""
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    return selected


def test_cpu_applies_the_stand_ins_once_and_pins_the_process(monkeypatch, unprepared):
    calls = []
    monkeypatch.setattr(distributed, "apply_cpu_patches", lambda: calls.append("applied"))
    assert prepare_device("cpu") == torch.device("cpu")
    assert prepare_device("cpu") == torch.device("cpu") and distributed.prepared_device() == "cpu"
    assert calls == ["applied", "applied"], "every call goes through apply_cpu_patches (itself idempotent)"
    with pytest.raises(ValueError, match="device: this process was already prepared for 'cpu'"):
        prepare_device("cuda")


def test_cuda_without_a_usable_gpu_fails_instead_of_falling_back(monkeypatch, unprepared):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed, "apply_cpu_patches", lambda: pytest.fail("must not fall back to CPU"))
    with pytest.raises(RuntimeError, match=r"prepare_device\('cuda'\): CUDA is not usable here"):
        prepare_device("cuda")
    assert distributed.prepared_device() is None


def test_cuda_selects_the_local_rank_gpu(monkeypatch, fake_gpus):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prepare_device("cuda") == torch.device("cuda", 1)
    assert fake_gpus == [1] and distributed.prepared_device() == "cuda"


@pytest.mark.parametrize("local_rank, match", [("2", "LOCAL_RANK=2 but only 2 GPU"), ("x", "LOCAL_RANK must be")])
def test_cuda_refuses_a_bad_local_rank(monkeypatch, fake_gpus, local_rank, match):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(ValueError, match=match):
        prepare_device("cuda")
    assert fake_gpus == []


def test_unknown_device(unprepared):
    with pytest.raises(ValueError, match=r"device: expected one of \('cpu', 'cuda'\), got 'gpu'"):
        prepare_device("gpu")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"expert_model_parallel_size": 0}, "expert_model_parallel_size"),
        ({"tensor_model_parallel_size": 1.5}, "tensor_model_parallel_size"),
    ],
)
def test_bad_parallel_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        initialize_megatron(**kwargs)


def test_megatron_needs_a_prepared_device(unprepared):
    with pytest.raises(RuntimeError, match=r"initialize_megatron: the device of this process is not prepared"):
        initialize_megatron()


def test_missing_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", INIT_METHOD_ENV):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_distributed("cpu")
    monkeypatch.setenv(INIT_METHOD_ENV, "file:///nowhere")  # a file rendezvous needs no address or port
    with pytest.raises(ValueError, match="environment: RANK, WORLD_SIZE must be set"):
        init_distributed("cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device": "cpu", "backend": "mpi"}, "backend: expected 'gloo' or 'nccl'"),
        ({"device": "cpu", "backend": "nccl"}, "backend: 'nccl' runs on GPUs only"),
        ({"device": "cpu", "timeout_s": 0}, "timeout_s"),
        ({"device": "tpu"}, "device: expected one of"),
        ({}, "device: not given and prepare_device"),
    ],
)
def test_bad_device_backend_and_timeout(monkeypatch, unprepared, kwargs, match):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(distributed, "apply_cpu_patches", lambda: pytest.fail("checked before preparing"))
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)


@pytest.mark.distributed
def test_ranks_started_by_initialize_megatron_share_the_seeded_generator():
    results = run_distributed(
        f"{WORKERS}:start_megatron_and_draw", world_size=2, timeout_s=200, init_process_group=False, seed=7
    )
    torch.manual_seed(7)
    expected = torch.rand(4)
    for rank, r in enumerate(results):
        assert r["ep_rank"] == rank
        assert r["cuda"] is False and r["patches"] == list(CPU_PATCH_NAMES) and r["device"] == "cpu"
        assert r["backend"] == "gloo", "the prepared CPU device must pick gloo"
        assert r["group_timeout_s"] == pytest.approx(150.0), "the launcher's timeout must reach init_distributed"
        assert torch.equal(r["draw"], expected), f"rank {rank}: the default generator must be seeded with seed"
