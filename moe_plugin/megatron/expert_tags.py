"""The expert tags: megatron's mark ``allreduce = False`` and the ZeRO-3 attributes that partition an expert
parameter within its expert-data-parallel group (``moe_plugin.parallel.layout`` says why, docs/zero3-ep.md).

Here rather than in ``parallel/`` because ``MegatronStackedExperts`` (``latent_moe``) tags its parameters as it
builds them, and megatron/ sits below parallel/ (tests/test_import_layers.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat.deepspeed import tag_partition

__all__ = ["EXPERT_FAMILY", "group_name", "tag_expert_parameter"]

EXPERT_FAMILY = "autoep_expert"


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert groups of expert-parallel size ``ep_size``."""
    return f"ep_size_{ep_size}"


def tag_expert_parameter(p: torch.Tensor, ep_size: int = None, expert_data_parallel_group=None) -> None:
    """Mark ``p`` as an expert parameter for megatron (``allreduce = False``) and for ZeRO-3 (see module doc).

    Groups default to megatron's ``parallel_state`` (which must be initialised). Without torch.distributed
    (a single-device build) only ``allreduce`` is set.
    """
    p.allreduce = False
    if not dist.is_initialized():
        return
    if ep_size is None or expert_data_parallel_group is None:
        from megatron.core import parallel_state

        ep_size = parallel_state.get_expert_model_parallel_world_size()
        expert_data_parallel_group = parallel_state.get_expert_data_parallel_group()
    p.group_name = group_name(ep_size)
    tag_partition(p, expert_data_parallel_group, p.group_name, EXPERT_FAMILY)
