"""Loaders of a bare megatron ``GPTModel`` per expert-parallel rank, for the megatron tests' rank code.

The trainer loads through ``weights.load_state`` on its own (``training.backends``); these name the two
layouts for the tests that load a ``build_gpt_model`` model directly: a Hugging Face checkpoint (expert stacks
read as this rank's rows, one expert at a time), a K3-layout one (only this rank's per-expert tensors), and LoRA
adapters under Hugging Face names, sliced to this rank's experts. The way back (``megatron.weights
.megatron_to_hf_state_dict``, ``megatron.lora.adapter_state_to_hf``) is the trainer's and stays in megatron/.
"""

from __future__ import annotations

from typing import Dict

import torch
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig, require

# megatron.lora's own patterns of adapter names, so that both sides read the names alike
from ..expert_adapters import adapter_factor, slice_experts
from ..megatron.lora import _LAYER
from ..weights.loader import LoadStats, expert_ranges, load_state
from ..weights.names import hf_to_megatron_name, megatron_to_hf_name

__all__ = ["load_hf_checkpoint", "load_k3_checkpoint_per_rank", "load_hf_adapter_state"]


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
    return load_state(
        model,
        path,
        names="megatron",
        config=config,
        strict=strict,
        layout="hf",
        ignore_vision=True,
        open_file=_open_shard,
    )


def load_k3_checkpoint_per_rank(model: nn.Module, path: str, config: ModelConfig, strict: bool = True) -> LoadStats:
    """Copy a K3-layout checkpoint (``save_k3_checkpoint``'s directory) into megatron ``model`` on this rank.

    Routed experts are read one per-expert tensor ``[F, L]`` / ``[L, F]`` at a time, only for this rank's
    ``[first, last)``, each written into its row of ``[E_local, ...]`` at once; ``A_log`` is unpadded and conv
    weights taken as ``load_k3_checkpoint`` does. A checkpoint without the DSA indexer leaves the model's indexer
    as it is. Missing tensors (over every expert, not only this rank's), misshapen ones and with ``strict``
    unknown text-model tensors (vision ones are ignored) raise one ValueError listing them all.
    """
    return load_state(
        model,
        path,
        names="megatron",
        config=config,
        strict=strict,
        layout="k3",
        ignore_vision=True,
        open_file=_open_shard,
    )


@torch.no_grad()
def load_hf_adapter_state(model: nn.Module, state: Dict[str, torch.Tensor], config: ModelConfig) -> int:
    """Copy adapter tensors named as in the Hugging Face model (``model.layers.{i}...lora_A.default.weight``,
    experts stacked over all ``E``) into megatron ``model``, slicing expert adapters to this rank's experts.
    Every adapter of ``model`` must be given (ValueError naming the first missing); returns the count."""
    ranges = expert_ranges(model)
    params = dict(model.named_parameters())
    given = {hf_to_megatron_name(k, config): (k, v) for k, v in state.items()}
    adapters = [n for n in params if ".lora_" in n]
    missing = [megatron_to_hf_name(n, config) for n in adapters if n not in given]
    require(not missing, "state", f"{len(missing)} adapters of the model are missing, e.g. {missing[:5]}")
    for name in adapters:
        hf_name, value = given[name]
        layer = _LAYER.match(name)
        factor = adapter_factor(name)
        if factor is not None:
            first, last = ranges[int(layer.group(1))]
            value = slice_experts(value, factor, first, last, config.moe.num_experts)
        require(
            tuple(value.shape) == tuple(params[name].shape),
            f"state[{hf_name!r}]",
            f"has shape {tuple(value.shape)} on this rank, the model's {name} has {tuple(params[name].shape)}",
        )
        params[name].copy_(value)
    return len(adapters)
