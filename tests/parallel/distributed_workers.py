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
    return {"draw": torch.rand(4), "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "patches": cpu_patches_applied(), "cuda": torch.cuda.is_available(), "device": prepared_device(),
            "backend": dist.get_backend(),
            "group_timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
