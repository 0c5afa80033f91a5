"""The Hugging Face / K3 checkpoint <-> megatron ``GPTModel`` state dict, per expert-parallel rank.

The names and layout rules live in ``moe_plugin.weights`` (``NAME_TABLE`` and the rest are re-exported here);
this module loads through its streaming loader (``weights.load_state``) and exports the megatron model under
Hugging Face names. Routed experts are stored stacked ``[E, ...]`` (``...experts.w1/w2/w3``) in a Hugging Face
checkpoint and one tensor per expert in a K3 one; an EP rank holds ``[E_local, ...]``, the contiguous slice
``local_expert_indices`` of its MoE layers, and reads only those experts (``get_slice`` rows of a stacked
tensor, or its own per-expert tensors), one at a time. Both directions see a model with LoRA adapters by its
base tensors under their pre-LoRA names (adapters: ``lora.load_hf_adapter_state`` / ``adapter_state_to_hf``).
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig
from ..weights.loader import LoadStats, expert_ranges, load_state, model_tensors
from ..weights.names import NAME_TABLE, base_name, hf_to_megatron_name, is_expert_tensor, megatron_to_hf_name

__all__ = ["NAME_TABLE", "hf_to_megatron_name", "megatron_to_hf_name", "base_name", "is_expert_tensor",
           "expert_ranges", "LoadStats", "load_hf_checkpoint", "load_k3_checkpoint_per_rank",
           "megatron_to_hf_state_dict"]


def _open_shard(file: str):
    # safe_open is looked up here at call time, so a wrapper put on this module's safe_open (the tests'
    # read counters) sees every read
    return safe_open(file, framework="pt")


def load_hf_checkpoint(model: nn.Module, path: str, config: ModelConfig, strict: bool = True) -> LoadStats:
    """Copy a Hugging Face checkpoint (``save_pretrained`` directory, sharded or not) into megatron ``model``.

    Expert stacks are read as this rank's rows of dim 0 only (``get_slice``, one expert at a time).
    ``strict``: checkpoint tensors of the text model that ``model`` lacks raise ValueError (vision-side tensors
    are ignored, ``LoadStats.ignored``). Missing or misshapen tensors always raise, all in one ValueError.
    """
    return load_state(model, path, names="megatron", config=config, strict=strict, layout="hf",
                      ignore_vision=True, open_file=_open_shard)


def load_k3_checkpoint_per_rank(model: nn.Module, path: str, config: ModelConfig, strict: bool = True
                                ) -> LoadStats:
    """Copy a K3-layout checkpoint (``save_k3_checkpoint``'s directory) into megatron ``model`` on this rank.

    Routed experts are read one per-expert tensor ``[F, L]`` / ``[L, F]`` at a time, only for this rank's
    ``[first, last)``, each written into its row of ``[E_local, ...]`` at once; ``A_log`` is unpadded and conv
    weights taken as ``load_k3_checkpoint`` does. A checkpoint without the DSA indexer leaves the model's indexer
    as it is. Missing tensors (over every expert, not only this rank's), misshapen ones and with ``strict``
    unknown text-model tensors (vision ones are ignored) raise one ValueError listing them all.
    """
    return load_state(model, path, names="megatron", config=config, strict=strict, layout="k3",
                      ignore_vision=True, open_file=_open_shard)


@torch.no_grad()
def megatron_to_hf_state_dict(model: nn.Module, config: ModelConfig, gather_experts: bool = True
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
            parts = [torch.empty_like(value) for _ in range(ep_size)]
            dist.all_gather(parts, value.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            value = torch.cat(parts)
        out[megatron_to_hf_name(mg_name, config)] = value.clone()
    return out
