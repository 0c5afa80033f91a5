"""Which parameters are expert parameters: megatron's mark, read by ZeRO-3's expert placement (``parallel.layout``).

Expert parameters (megatron's ``p.allreduce = False``, also set on expert LoRA adapters by
``moe_plugin.megatron.lora``) live on one expert-parallel rank, so their gradients are reduced over the
expert-data-parallel group rather than the data-parallel one (the harness's ``moe_plugin.testing.grad_reduce``
does it for a bare megatron model).
"""

from __future__ import annotations

import torch

__all__ = ["is_expert_parameter"]


def is_expert_parameter(p: torch.Tensor) -> bool:
    """megatron's convention: expert parameters carry ``allreduce = False``."""
    return getattr(p, "allreduce", True) is False
