"""The Hugging Face checkpoint <-> megatron ``GPTModel`` state dict, per expert-parallel rank.

Names differ only in their prefixes; ``NAME_TABLE`` is the whole mapping (the rest of each name, e.g.
``self_attn.q_proj.weight``, is the same on both sides because the megatron submodules are the single-device
layers). Routed experts are stored stacked ``[E, ...]`` in both (``...experts.w1/w2/w3``); an EP rank holds
``[E_local, ...]``, the contiguous slice ``local_expert_indices`` of its MoE layers.

``load_k3_checkpoint_per_rank`` reads the published K3 layout instead (one tensor per expert, padded ``A_log``,
``[C, 1, K]`` convs, optional ``language_model.`` prefix), with ``models.k3_format``'s name and tensor conversion.

Loading reads sharded safetensors with ``safe_open`` and takes expert tensors through ``get_slice``, so a rank
never materialises the experts of other ranks. Both directions see a model with LoRA adapters by its base
tensors under their pre-LoRA names (peft's ``base_layer.`` segments removed, ``lora_`` tensors left out; the
adapters have ``lora.load_hf_adapter_state`` / ``adapter_state_to_hf``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig, require
from ..fileio import safetensors_weight_map
from ..models.k3_format import (TEXT_PREFIX, VISION_PREFIXES, is_indexer_tensor, k3_tensor_names, strip_text_prefix,
                                tensor_from_k3)

__all__ = ["NAME_TABLE", "hf_to_megatron_name", "megatron_to_hf_name", "base_name", "is_expert_tensor",
           "expert_ranges", "LoadStats", "load_hf_checkpoint", "load_k3_checkpoint_per_rank",
           "megatron_to_hf_state_dict"]

# (Hugging Face prefix, megatron prefix, layers the row applies to: None = every layer, "moe" or "dense").
# "{i}" is the 0-based layer index on both sides.
NAME_TABLE: Tuple[Tuple[str, str, Optional[str]], ...] = (
    ("model.embed_tokens.", "embedding.word_embeddings.", None),
    ("model.layers.{i}.input_layernorm.", "decoder.layers.{i}.input_layernorm.", None),
    ("model.layers.{i}.self_attn.", "decoder.layers.{i}.self_attention.", None),
    ("model.layers.{i}.post_attention_layernorm.", "decoder.layers.{i}.pre_mlp_layernorm.", None),
    ("model.layers.{i}.block_sparse_moe.", "decoder.layers.{i}.mlp.", "moe"),
    ("model.layers.{i}.mlp.", "decoder.layers.{i}.mlp.", "dense"),
    ("model.norm.", "decoder.final_layernorm.", None),
    ("lm_head.", "output_layer.", None),
)
# Checkpoint tensors that are not part of the text model (the multimodal checkpoint's vision side).
NOT_TEXT = ("vision_tower.", "mm_projector.")
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.w[123]$")
_EXTRA_STATE = "_extra_state"
_PEFT_WRAPPER = ".base_layer."  # peft's wrappers insert this segment before the wrapped module's names


def _compile(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(re.escape("{i}"), r"(?P<i>\d+)"))


_ROWS = [(_compile(hf), hf, _compile(mg), mg, when) for hf, mg, when in NAME_TABLE]


def _layer_kind(config: ModelConfig, i: int) -> str:
    return "moe" if config.is_moe_layer(i) else "dense"


def _translate(name: str, config: Optional[ModelConfig], to_megatron: bool) -> str:
    for hf_re, hf, mg_re, mg, when in _ROWS:
        src_re, dst = (hf_re, mg) if to_megatron else (mg_re, hf)
        m = src_re.match(name)
        if m is None:
            continue
        i = m.groupdict().get("i")
        if when is not None and config is not None and _layer_kind(config, int(i)) != when:
            continue
        return dst.replace("{i}", i or "") + name[m.end():]
    side = "Hugging Face" if to_megatron else "megatron"
    raise ValueError(f"name: {name!r} matches no {side} prefix of NAME_TABLE")


def hf_to_megatron_name(name: str, config: Optional[ModelConfig] = None) -> str:
    """``model.layers.1.block_sparse_moe.gate.weight`` -> ``decoder.layers.1.mlp.gate.weight``.

    With ``config`` a dense/MoE name must agree with the layer's kind."""
    return _translate(name, config, to_megatron=True)


def megatron_to_hf_name(name: str, config: ModelConfig) -> str:
    """``decoder.layers.1.mlp.gate.weight`` -> ``model.layers.1.block_sparse_moe.gate.weight``; ``config`` says
    whether ``mlp`` is the MoE (``block_sparse_moe``) or the dense MLP (``mlp``) of that layer."""
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    return _translate(name, config, to_megatron=False)


def is_expert_tensor(megatron_name: str) -> bool:
    """Whether the tensor is a routed-expert stack ``[E(_local), ...]``."""
    return _EXPERT.match(megatron_name) is not None


def expert_ranges(model: nn.Module) -> Dict[int, Tuple[int, int]]:
    """``{layer index: (first, last + 1)}`` of the experts each MoE layer of ``model`` holds on this rank."""
    ranges = {}
    for i, layer in enumerate(model.decoder.layers):
        local = getattr(layer.mlp, "local_expert_indices", None)
        if local is None:
            continue
        first, count = local[0], len(local)
        require(list(local) == list(range(first, first + count)), f"decoder.layers.{i}.mlp.local_expert_indices",
                f"must be contiguous, got {local}")
        ranges[i] = (first, first + count)
    return ranges


@dataclass
class LoadStats:
    """What ``load_hf_checkpoint`` read: tensors, elements, and of those the routed-expert elements."""

    tensors: int = 0
    elements: int = 0
    expert_elements: int = 0
    ignored: List[str] = field(default_factory=list)  # checkpoint tensors outside the text model


def base_name(name: str) -> str:
    """A model entry's name without peft's ``base_layer.`` segments: ``...mlp.experts.base_layer.base_layer.w1``
    -> ``...mlp.experts.w1`` (what the name was before ``add_lora``)."""
    while _PEFT_WRAPPER in name:
        name = name.replace(_PEFT_WRAPPER, ".")
    return name


def _model_entries(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The base model's tensors under their pre-LoRA names (adapter tensors left out)."""
    return {base_name(k): v for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith(_EXTRA_STATE) and ".lora_" not in k}


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str, config: ModelConfig, strict: bool = True) -> LoadStats:
    """Copy a Hugging Face checkpoint (``save_pretrained`` directory, sharded or not) into megatron ``model``.

    Every tensor of ``model`` is read from its shard; expert stacks only as this rank's slice ``[first:last]``
    of dim 0 (``get_slice``). ``strict``: checkpoint tensors of the text model that ``model`` lacks raise
    ValueError (vision-side tensors are ignored). Missing or misshapen tensors always raise ValueError.
    """
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    weight_map = safetensors_weight_map(path)
    ranges = expert_ranges(model)
    targets = _model_entries(model)
    wanted: Dict[str, Dict[str, str]] = {}  # shard file -> {hf name: megatron name}
    missing = []
    for mg_name in targets:
        hf_name = megatron_to_hf_name(mg_name, config)
        if hf_name not in weight_map:
            missing.append(hf_name)
            continue
        wanted.setdefault(weight_map[hf_name], {})[hf_name] = mg_name
    require(not missing, "checkpoint", f"{len(missing)} tensors of the model are missing: {missing[:10]}")
    used = {hf for names in wanted.values() for hf in names}
    stats = LoadStats(ignored=sorted(k for k in weight_map if k.startswith(NOT_TEXT)))
    unexpected = sorted(k for k in weight_map if k not in used and not k.startswith(NOT_TEXT))
    if config.tie_word_embeddings:
        unexpected = [k for k in unexpected if not k.startswith("lm_head.")]
    require(not (strict and unexpected), "checkpoint",
            f"{len(unexpected)} tensors the model does not have: {unexpected[:10]} (strict=False to ignore)")

    for shard, names in sorted(wanted.items()):
        with safe_open(shard, framework="pt") as f:
            for hf_name, mg_name in names.items():
                expert = _EXPERT.match(mg_name)
                if expert:
                    first, last = ranges[int(expert.group(1))]
                    value = f.get_slice(hf_name)[first:last]
                    stats.expert_elements += value.numel()
                else:
                    value = f.get_tensor(hf_name)
                target = targets[mg_name]
                require(tuple(value.shape) == tuple(target.shape), f"checkpoint[{hf_name!r}]",
                        f"has shape {tuple(value.shape)} on this rank, the model's {mg_name} has {tuple(target.shape)}")
                target.copy_(value)
                stats.tensors += 1
                stats.elements += value.numel()
    return stats


def _k3_plan(model: nn.Module, config: ModelConfig, weight_map: Dict[str, str]
             ) -> Tuple[Dict[str, List[str]], List[str], List[str], str]:
    """({megatron name: the K3 names this rank reads for it}, missing, unknown, text prefix) of a K3 checkpoint.

    Missing and unknown are in the checkpoint's names and cover every expert, not only this rank's."""
    prefix = TEXT_PREFIX if any(k.startswith(TEXT_PREFIX) for k in weight_map) else ""
    ranges = expert_ranges(model)
    has_indexer = any(is_indexer_tensor(k) for k in weight_map)
    reads: Dict[str, List[str]] = {}
    known, missing = set(), []
    for mg_name, target in _model_entries(model).items():
        hf_name = megatron_to_hf_name(mg_name, config)
        expert = _EXPERT.match(mg_name)
        every = range(config.moe.num_experts) if expert else None
        names = [prefix + n for n in k3_tensor_names(hf_name, tuple(target.shape), every)]
        if config.tie_word_embeddings and hf_name == "lm_head.weight" and prefix + hf_name not in weight_map:
            names = [prefix + "model.embed_tokens.weight"]  # K3 stores a tied embedding once
        known.update(names)
        absent = [n for n in names if n not in weight_map]
        if absent and is_indexer_tensor(hf_name) and not has_indexer:
            continue  # K3 has no indexer: it stays freshly initialised, as load_k3_checkpoint leaves it
        missing += absent
        if expert:
            first, last = ranges[int(expert.group(1))]
            names = names[first:last]
        reads[mg_name] = names
    unknown = sorted(k for k in weight_map if k not in known and not k.startswith(VISION_PREFIXES))
    return reads, sorted(missing), unknown, prefix


@torch.no_grad()
def load_k3_checkpoint_per_rank(model: nn.Module, path: str, config: ModelConfig, strict: bool = True
                                ) -> LoadStats:
    """Copy a K3-layout checkpoint (``save_k3_checkpoint``'s directory) into megatron ``model`` on this rank.

    Routed experts are read one per-expert tensor ``[F, L]`` / ``[L, F]`` at a time, only for this rank's
    ``[first, last)``, and stacked into ``[E_local, ...]``; ``A_log`` is unpadded and conv weights reshaped as
    ``load_k3_checkpoint`` does. A checkpoint without the DSA indexer leaves the model's indexer as it is.
    Missing tensors, and with ``strict`` unknown text-model tensors (vision ones are ignored), raise one
    ValueError listing both; a tensor whose shape differs from the model's raises ValueError naming it.
    """
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    weight_map = safetensors_weight_map(path)
    reads, missing, unknown, prefix = _k3_plan(model, config, weight_map)
    problems = [f"{len(missing)} tensors of the model are missing: {missing[:10]}"] if missing else []
    if strict and unknown:
        problems.append(f"{len(unknown)} tensors the model does not have: {unknown[:10]} (strict=False to ignore)")
    require(not problems, "checkpoint", "; ".join(problems))
    stats = LoadStats(ignored=sorted(k for k in weight_map if k.startswith(VISION_PREFIXES)))
    targets = _model_entries(model)
    by_shard: Dict[str, List[str]] = {}
    for names in reads.values():
        for name in names:
            by_shard.setdefault(weight_map[name], []).append(name)
    stored: Dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(shard, framework="pt") as f:
            stored.update((name, f.get_tensor(name)) for name in names)
    for mg_name, names in reads.items():
        target = targets[mg_name]
        if _EXPERT.match(mg_name):
            for name in names:
                require(tuple(stored[name].shape) == tuple(target.shape[1:]), f"checkpoint[{name!r}]",
                        f"has shape {tuple(stored[name].shape)}, one expert of the model's {mg_name} has "
                        f"{tuple(target.shape[1:])}")
            value = torch.stack([stored[name] for name in names])
            stats.expert_elements += value.numel()
        else:
            value = tensor_from_k3(strip_text_prefix(names[0]), stored[names[0]], tuple(target.shape))
        require(tuple(value.shape) == tuple(target.shape), f"checkpoint[{names[0]!r}]",
                f"has shape {tuple(value.shape)} on this rank, the model's {mg_name} has {tuple(target.shape)}")
        target.copy_(value)
        stats.tensors += len(names)
        stats.elements += value.numel()
    return stats


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
    for mg_name, value in _model_entries(model).items():
        if value is None:
            continue
        value = value.detach()
        if ep_size > 1 and is_expert_tensor(mg_name):
            parts = [torch.empty_like(value) for _ in range(ep_size)]
            dist.all_gather(parts, value.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            value = torch.cat(parts)
        out[megatron_to_hf_name(mg_name, config)] = value.clone()
    return out
