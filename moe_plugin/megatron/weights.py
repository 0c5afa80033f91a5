"""The megatron ``GPTModel`` state dict -> Hugging Face names, per expert-parallel rank.

The names and layout rules live in ``moe_plugin.weights`` (``NAME_TABLE`` and the rest are re-exported here),
and loading goes through its streaming loader (``weights.load_state``; the tests' per-layout loaders of a bare
model are ``moe_plugin.testing.megatron_loading``). Routed experts are stored stacked ``[E, ...]``
(``...experts.w1/w2/w3``) in a Hugging Face checkpoint and one tensor per expert in a K3 one; an EP rank holds
``[E_local, ...]``, the contiguous slice ``local_expert_indices`` of its MoE layers. The export sees a model with
LoRA adapters by its base tensors under their pre-LoRA names (adapters: ``lora.adapter_state_to_hf``).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..config import ModelConfig
from ..weights.loader import LoadStats, expert_ranges, model_tensors
from ..weights.names import NAME_TABLE, base_name, hf_to_megatron_name, is_expert_tensor, megatron_to_hf_name
from .expert_gather import all_gather_expert_stack

__all__ = [
    "NAME_TABLE",
    "hf_to_megatron_name",
    "megatron_to_hf_name",
    "base_name",
    "is_expert_tensor",
    "expert_ranges",
    "LoadStats",
    "megatron_to_hf_state_dict",
]


@torch.no_grad()
def megatron_to_hf_state_dict(
    model: nn.Module, config: ModelConfig, gather_experts: bool = True
) -> Dict[str, torch.Tensor]:
    """The Hugging Face state dict of megatron ``model`` (clones).

    gather_experts: all-gather the expert stacks over the expert-parallel group (every rank returns all
    ``E`` experts; collective, so every EP rank must call it); False returns this rank's ``[E_local, ...]``.
    """
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size() if gather_experts else 1
    out = {}
    for mg_name, value in model_tensors(model).items():
        value = value.detach()
        if ep_size > 1 and is_expert_tensor(mg_name):
            value = all_gather_expert_stack(value)
        out[megatron_to_hf_name(mg_name, config)] = value.clone()
    return out
