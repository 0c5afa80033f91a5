"""Gradient reduction for data + expert parallel training of a bare megatron model, without megatron's DDP
wrapper: the harness of the megatron tests and benchmarks/megatron_ep.py (the trainer leaves it to DeepSpeed).

After ``backward`` each rank holds the gradient of its own micro-batch loss. ``reduce_gradients`` turns every
trainable parameter's ``.grad`` into the gradient of the mean of all data-parallel ranks' losses:

* dense parameters (and their adapters) exist on every data-parallel rank: sum over the data-parallel group
  and divide by its size ``D`` (the average);
* expert parameters (megatron's mark ``p.allreduce = False``, also set on expert LoRA adapters by
  ``moe_plugin.megatron.lora``) live on one expert-parallel rank, and the all-to-all backward has already
  summed into them the contributions of every rank of their EP group. Summing over the expert-data-parallel
  group then covers every micro-batch exactly once, and dividing by the same ``D`` gives the average.
  (Averaging over the expert-data-parallel group alone would be EP times too large.) This is the scaling of
  megatron-core's ``DistributedDataParallel`` (``expert_gradient_scaling_factor = 1 / D``).

Gradients are flattened per group into one buffer, so each group costs one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.grad_reduce import is_expert_parameter

__all__ = ["reduce_gradients", "ReduceCounts"]


@dataclass
class ReduceCounts:
    """How many parameters (and elements) went through each group."""

    dense: int = 0
    expert: int = 0
    dense_elements: int = 0
    expert_elements: int = 0


def _trainable(params: Iterable) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        named = list(params.named_parameters())
    else:
        named = [(str(i), p) for i, p in enumerate(params)]
    return [(n, p) for n, p in named if p.requires_grad]


def _all_reduce_sum(grads: List[torch.Tensor], group) -> None:
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def reduce_gradients(
    params, data_parallel_group=None, expert_data_parallel_group=None, data_parallel_size: Optional[int] = None
) -> ReduceCounts:
    """Make each trainable parameter's grad the gradient of the data-parallel mean loss (see module doc).

    params: a module or an iterable of parameters, in the same order on every rank (collective).
    Groups default to megatron's ``parallel_state`` data-parallel and expert-data-parallel groups;
    ``data_parallel_size`` defaults to the data-parallel group's size. A parameter without a gradient (an
    expert that saw no token) counts as a zero gradient and gets one, so every rank takes part in the same
    reductions and nothing hangs.
    """
    if data_parallel_group is None or expert_data_parallel_group is None:
        from megatron.core import parallel_state

        data_parallel_group = data_parallel_group or parallel_state.get_data_parallel_group()
        expert_data_parallel_group = expert_data_parallel_group or parallel_state.get_expert_data_parallel_group()
    size = dist.get_world_size(data_parallel_group) if data_parallel_size is None else data_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size: must be a positive integer, got {size!r}")
    counts = ReduceCounts()
    dense, expert = [], []
    for _, p in _trainable(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (expert if is_expert_parameter(p) else dense).append(p.grad)
    _all_reduce_sum(dense, data_parallel_group)
    _all_reduce_sum(expert, expert_data_parallel_group)
    for g in dense + expert:
        g.div_(size)
    counts.dense, counts.expert = len(dense), len(expert)
    counts.dense_elements = sum(g.numel() for g in dense)
    counts.expert_elements = sum(g.numel() for g in expert)
    return counts
