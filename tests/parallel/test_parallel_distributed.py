"""moe_plugin.parallel.distributed: bad input is refused with the argument's name (no process group needed).

Starting gloo and megatron's parallel state is exercised by every multi-process test (tests/megatron)."""

import pytest

from moe_plugin.parallel.distributed import init_distributed, initialize_megatron


@pytest.mark.parametrize("kwargs, name", [
    ({"expert_model_parallel_size": 0}, "expert_model_parallel_size"),
    ({"tensor_model_parallel_size": 1.5}, "tensor_model_parallel_size"),
])
def test_bad_parallel_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        initialize_megatron(**kwargs)


def test_missing_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_distributed()


def test_bad_backend(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="backend"):
        init_distributed(backend="mpi")
