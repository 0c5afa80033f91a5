"""Rank-side code of test_parallel_grad_reduce.py (run by run_distributed at world size 2; nothing asserts here).

The two ranks play EP=2 without megatron: the data-parallel group is both ranks, each rank's
expert-data-parallel group is itself (each holds different experts).
"""

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.testing.grad_reduce import reduce_gradients


def reduce_marked_gradients() -> dict:
    rank = dist.get_rank()
    data_parallel = dist.new_group([0, 1])
    own = [dist.new_group([r]) for r in range(2)][rank]  # new_group is collective: all ranks create all
    dense = nn.Parameter(torch.full((3,), float(rank + 1)))
    expert = nn.Parameter(torch.full((2, 2), 10.0 * (rank + 1)))
    idle_expert = nn.Parameter(torch.ones(4))  # an expert that saw no token: no grad at all
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    expert.allreduce = idle_expert.allreduce = False
    dense.grad = dense.detach().clone()
    expert.grad = expert.detach().clone()
    counts = reduce_gradients([dense, expert, idle_expert, frozen], data_parallel, own)
    return {
        "dense": dense.grad,
        "expert": expert.grad,
        "idle": idle_expert.grad,
        "frozen": frozen.grad,
        "counts": vars(counts),
    }
