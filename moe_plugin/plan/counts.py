"""Parameter counts of the recipe's model, taken from the model itself built on the ``meta`` device
(docs/planner.md, "Counts").

Nothing here is a parameter formula: the Hugging Face face of the model is instantiated on ``meta`` (no memory,
about a second for the full-size ``k3`` preset), the recipe's LoRA adapters are added through the project's one
entry point, and every tensor is sorted into a kind by its name. One rank's share then follows the ZeRO-3 x EP
rule of docs/zero3-ep.md: a routed-expert tensor is split over the EP ranks (each holds ``E / EP`` experts) and
its remaining copy over the expert-data-parallel group (``world / EP`` ranks); every other tensor over all ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

__all__ = ["TensorCount", "ModelCounts", "count_model", "KINDS"]

# the kinds of the memory table, in display order
KINDS = ("experts", "dense", "embeddings", "vision", "adapters")
_EXPERT = re.compile(r"\.experts\.(w[123])(_scale)?$")
_EMBED = re.compile(r"(^|\.)(embed_tokens|lm_head)\.")
_VISION = re.compile(r"(^|\.)(vision_tower|mm_projector|patch_merger)\.")


@dataclass
class TensorCount:
    """All tensors of one kind: ``numel`` elements, ``nbytes`` as they would be stored in ``dtype_bytes``."""

    numel: int = 0
    nbytes: int = 0
    trainable_numel: int = 0
    largest_module_numel: int = 0  # the most elements one module gathers at once (ZeRO-3's unit)


@dataclass
class ModelCounts:
    """Per kind (``KINDS``) the whole model's count, plus what the activation planner needs."""

    kinds: Dict[str, TensorCount] = field(default_factory=dict)
    total_numel: int = 0
    adapter_numel: int = 0
    expert_adapter_numel: int = 0
    layer_numel: List[int] = field(default_factory=list)  # per decoder layer, every kind (gathered size)
    layer_expert_numel: List[int] = field(default_factory=list)  # per decoder layer, its routed experts
    expert_format: str = "dense"
    lora_targets: List[str] = field(default_factory=list)


def _kind(name: str) -> str:
    if "lora_" in name:
        return "adapters"
    if _EXPERT.search(name.replace(".base_layer", "")):
        return "experts"
    if _VISION.search(name):
        return "vision"
    if _EMBED.search(name):
        return "embeddings"
    return "dense"


def _stored_bytes(param: torch.Tensor, fp32_names: set, name: str, precision_bytes: int) -> int:
    """Bytes of one tensor as the trainer stores it: integer (packed) tensors as built, the precision policy's
    fp32 tensors in fp32, every other floating tensor in the recipe's precision."""
    if not param.dtype.is_floating_point:
        return param.numel() * param.element_size()
    return param.numel() * (4 if name in fp32_names else precision_bytes)


def build_meta_model(model_config_hf, images: bool = False) -> nn.Module:
    """The Hugging Face face on the meta device (``MoEPluginForConditionalGeneration`` with ``images``)."""
    from ..models import MoEPluginForCausalLM
    from ..models.modeling_vl import MoEPluginForConditionalGeneration

    cls = MoEPluginForConditionalGeneration if images else MoEPluginForCausalLM
    with torch.device("meta"):
        return cls(model_config_hf)


def count_model(
    model_config_hf,
    lora_section=None,
    precision_bytes: int = 2,
    images: bool = False,
    model: Optional[nn.Module] = None,
) -> ModelCounts:
    """Counts of the model of ``model_config_hf`` (a ``MoEPluginConfig``) with the recipe's ``lora`` section
    (``None``: full training, every parameter trainable) applied on the meta device."""
    from ..lora import add_lora, lora_config
    from ..precision import fp32_tensors

    model = build_meta_model(model_config_hf, images) if model is None else model
    if lora_section is not None:
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.device(next(model.parameters()).device):  # on meta: no allocation, no random draws
            add_lora(
                model,
                lora_config(
                    lora_section.r,
                    lora_section.alpha,
                    lora_section.target_modules,
                    lora_section.target_parameters,
                    lora_section.dropout,
                ),
            )
    fp32_names = {re.sub(r"\.base_layer", "", n) for n, _, _ in fp32_tensors(model)}
    counts = ModelCounts(
        kinds={k: TensorCount() for k in KINDS},
        expert_format=model_config_hf.to_model_config().moe.expert_format,
        lora_targets=list(lora_section.target_modules + lora_section.target_parameters)
        if lora_section is not None
        else [],
    )
    layer_of = re.compile(r"\.layers\.(\d+)\.")
    layers: Dict[int, List[int]] = {}
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module_numel = sum(p.numel() for _, p in own)
        for short, p in own:
            name = f"{module_name}.{short}" if module_name else short
            clean = name.replace(".base_layer", "")
            kind = _kind(clean)
            c = counts.kinds[kind]
            c.numel += p.numel()
            c.nbytes += _stored_bytes(p, fp32_names, re.sub(r"^base_model\.model\.", "", clean), precision_bytes)
            c.largest_module_numel = max(c.largest_module_numel, module_numel)
            if p.requires_grad or kind == "adapters":
                c.trainable_numel += p.numel()
            counts.total_numel += p.numel()
            if kind == "adapters":
                counts.adapter_numel += p.numel()
                if ".experts" in clean:
                    counts.expert_adapter_numel += p.numel()
            m = layer_of.search(name)
            if m and "vision" not in name:
                per = layers.setdefault(int(m.group(1)), [0, 0])
                per[0] += p.numel()
                if kind == "experts" or (kind == "adapters" and ".experts" in clean):
                    per[1] += p.numel()
    counts.layer_numel = [layers[i][0] for i in sorted(layers)]
    counts.layer_expert_numel = [layers[i][1] for i in sorted(layers)]
    return counts


def rank_share(counts: ModelCounts, world: int, ep: int, zero3: bool) -> Dict[str, float]:
    """Bytes of each kind that one rank stores at rest: experts over EP and then their EDP group, the rest
    over the world (ZeRO-3); without ZeRO-3 each rank holds its EP share of the experts and all else whole."""
    edp = world // ep
    out = {}
    for kind, c in counts.kinds.items():
        if kind == "experts":
            out[kind] = c.nbytes / ep / (edp if zero3 else 1)
        else:
            out[kind] = c.nbytes / (world if zero3 else 1)
    return out
