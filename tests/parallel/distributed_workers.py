"""Rank-side code of test_parallel_distributed.py (run by run_distributed without a process group)."""

import torch
import torch.distributed as dist


def start_megatron_and_draw(seed: int) -> dict:
    """Start everything through initialize_megatron (the device the launcher prepared, rendezvous and timeout
    from the launcher's env), then draw from the default generator."""
    from megatron.core import parallel_state

    from moe_plugin.parallel.cpu_compat import cpu_patches_applied
    from moe_plugin.parallel.distributed import initialize_megatron, prepared_device

    initialize_megatron(expert_model_parallel_size=2, seed=seed)
    group = dist.distributed_c10d._get_default_group()
    return {
        "draw": torch.rand(4),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "patches": cpu_patches_applied(),
        "cuda": torch.cuda.is_available(),
        "device": prepared_device(),
        "backend": dist.get_backend(),
        "group_timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }


def start_layout() -> dict:
    """Start a ParallelLayout of 2 ranks at EP 2; report its ranks and groups, what a layout for another
    expert size says of megatron's started state, and what its tag rule does to a marked parameter."""
    from torch import nn

    from moe_plugin.parallel.layout import ParallelLayout, started_layout

    layout = ParallelLayout(world=2, expert=2).start(seed=1)
    out = {
        "dp_rank": layout.dp_rank,
        "ep_rank": layout.ep_rank,
        "data": layout.data,
        "expert_data": layout.expert_data,
        "started_is_it": started_layout() is layout,
    }
    try:
        ParallelLayout(world=2, expert=1)._check_megatron()
        out["mismatch"] = None
    except RuntimeError as err:
        out["mismatch"] = str(err)
    marked, plain = nn.Linear(2, 2), nn.Linear(2, 2)
    marked.weight.allreduce = False
    out["tagged"] = layout.tag_expert_parameters(nn.ModuleList([marked, plain]), zero3=True)
    group = getattr(marked.weight, "ds_zero_partition_process_group", None)
    out["tag_group"] = None if group is None else sorted(dist.get_process_group_ranks(group))
    out["plain_tagged"] = hasattr(plain.weight, "ds_zero_partition_process_group")
    layout.stop()
    out["stopped"] = started_layout() is None
    return out
