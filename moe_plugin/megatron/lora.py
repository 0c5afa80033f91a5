"""LoRA adapter state of the megatron model under Hugging Face names, per expert-parallel rank.

Adapters are added by the project's one LoRA entry point, ``moe_plugin.lora.add_lora`` (in place on the
megatron model, so parameter names keep the model's own prefixes and map through ``weights.NAME_TABLE``).

Expert adapters follow megatron's convention for expert parameters: ``allreduce = False``, so their gradients
are reduced over the expert-data-parallel group (``moe_plugin.parallel.grad_reduce``). On an EP rank they hold
only the local experts' adapters; peft stacks them as ``lora_A [r * E, in]`` (expert-major rows) and
``lora_B [out, r * E]`` (expert-minor columns, ``view(out, r, E)``; the layout is ``moe_plugin.expert_adapters``),
and ``expert_gather.all_gather_expert_adapter`` stitches the ranks' parts into the full ``E``.
"""

from __future__ import annotations

import re
from typing import Dict

import torch
from torch import nn

from ..config import ModelConfig
from ..expert_adapters import adapter_factor
from .expert_gather import all_gather_expert_adapter
from .weights import expert_ranges, megatron_to_hf_name

__all__ = ["adapter_state_to_hf"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@torch.no_grad()
def adapter_state_to_hf(
    model: nn.Module, config: ModelConfig, grads: bool = False, gather_experts: bool = True
) -> Dict[str, torch.Tensor]:
    """Adapter tensors (or, with ``grads``, their gradients; zeros where none) of megatron ``model`` under
    Hugging Face names, as clones. gather_experts: all-gather expert adapters over the expert-parallel group
    into the full ``E`` stacking (collective: every EP rank must call it); False keeps this rank's slice."""
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size() if gather_experts else 1
    ranges = expert_ranges(model)
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" not in name:
            continue
        value = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        value = value.detach()
        factor = adapter_factor(name)
        if ep_size > 1 and factor is not None:
            first, last = ranges[int(_LAYER.match(name).group(1))]
            r = value.shape[0 if factor == "A" else 1] // (last - first)
            value = all_gather_expert_adapter(value, factor, r)
        out[megatron_to_hf_name(name, config)] = value.clone()
    return out
