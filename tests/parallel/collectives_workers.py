"""Rank-side code of test_collectives.py: DeepSpeed's and megatron-core's reduce-scatter and all-gather after
the project's rebinding to torch's current collectives, with every warning recorded. Nothing here asserts."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def run() -> dict:
    import deepspeed
    import deepspeed.comm as ds_comm

    from moe_plugin.compat import megatron as megatron_collectives
    from moe_plugin.compat.deepspeed import use_current_collectives

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    use_current_collectives()
    megatron_collectives.use_current_collectives()
    from megatron.core.tensor_parallel import mappings

    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, each time, from any caller
        scattered = torch.zeros(2)
        ds_comm.reduce_scatter_tensor(scattered, torch.arange(2.0 * world) + rank)
        gathered = torch.zeros(2 * world)
        ds_comm.allgather_fn(gathered, torch.full((2,), float(rank)))
        megatron_gathered = torch.zeros(2 * world)
        mappings.dist_all_gather_func(megatron_gathered, torch.full((2,), float(rank)))
    return {
        "scattered": scattered,
        "gathered": gathered,
        "megatron_gathered": megatron_gathered,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
        "megatron_aliases": [
            getattr(mappings, name).__name__ for name in ("dist_all_gather_func", "dist_reduce_scatter_func")
        ],
    }
