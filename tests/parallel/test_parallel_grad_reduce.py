"""moe_plugin.testing.grad_reduce: dense gradients averaged over data parallel, expert gradients summed over
the expert-data-parallel group and divided by the data-parallel size (megatron DDP's scaling)."""

from pathlib import Path

import pytest
import torch

from moe_plugin.parallel.grad_reduce import is_expert_parameter
from moe_plugin.testing.grad_reduce import reduce_gradients
from moe_plugin.testing.launch import run_distributed

WORKERS = Path(__file__).with_name("grad_reduce_workers.py")


@pytest.mark.distributed
def test_dense_averaged_and_expert_scaled_by_data_parallel_size():
    results = run_distributed(f"{WORKERS}:reduce_marked_gradients", world_size=2, timeout_s=120)
    for rank, got in enumerate(results):
        assert torch.equal(got["dense"], torch.full((3,), (1.0 + 2.0) / 2)), got["dense"]
        # the expert lives on this rank alone: its gradient (already summed over its EP group by the
        # all-to-all backward) is divided by the data-parallel size, not averaged over a group of one
        assert torch.equal(got["expert"], torch.full((2, 2), 10.0 * (rank + 1) / 2)), got["expert"]
        assert torch.equal(got["idle"], torch.zeros(4)) and got["frozen"] is None
        assert got["counts"] == {"dense": 1, "expert": 2, "dense_elements": 3, "expert_elements": 8}


def test_expert_mark_and_bad_size():
    p = torch.nn.Parameter(torch.zeros(1))
    assert not is_expert_parameter(p)
    p.allreduce = False
    assert is_expert_parameter(p)
    with pytest.raises(ValueError, match="^data_parallel_size"):
        reduce_gradients([p], object(), object(), data_parallel_size=0)
