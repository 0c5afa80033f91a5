"""What both backends do the same way: the LoRA config from the recipe, base-weight loading, ZeRO-3 detection.
The layout-invariant expert-adapter draw is ``moe_plugin.lora.init_expert_adapters`` and the ZeRO-3 gather
``moe_plugin.parallel.zero3_gather.gathered``: the Hugging Face face's expert parallelism uses them too."""

from __future__ import annotations

from torch import nn

from ...lora import lora_config
from ..ds_config import zero_stage

__all__ = ["zero_init", "partition_while_building", "adapter_lora_config", "load_base", "hf_config",
           "hide_expert_marks"]


def zero_init(ds_config: dict):
    """``deepspeed.zero.Init`` for a model built partitioned. The dtype comes from the config's bf16 section
    (the recipe's precision): in DeepSpeed 0.19.8 an explicit ``dtype`` argument is dropped on accelerators
    without fp16 (an operator-precedence slip in ``Init._set_dtype``), which made the CPU partitions bf16."""
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=None, pin_memory=False)


def partition_while_building(ds_config: dict, recipe) -> bool:
    """Whether to build the model under ``zero.Init`` (partitioned module by module, so no rank ever holds a
    whole tensor it does not own) rather than whole, for ``deepspeed.initialize`` to partition.

    Under ZeRO-3 with a checkpoint: yes, the loader then writes each rank's slices into its partitions. A
    preset has no checkpoint: its weights are drawn from the seed, and a layer's init code that touches its
    children's weights after they were built (the Hugging Face post-init, our layers' ``reset_parameters``)
    would only see empty placeholders under ``zero.Init``. So a preset is built whole on each rank (the
    dense base and this rank's experts, never another EP rank's), exactly as one process draws it, and the
    engine partitions it; presets are for tests and small models.
    """
    return zero_stage(ds_config) == 3 and recipe.model.from_pretrained is not None


def hide_expert_marks(model: nn.Module) -> None:
    """Remove megatron's expert mark ``allreduce = False`` where no expert group partitions the experts
    (one process, or the Hugging Face face without expert parallelism): DeepSpeed's engine reads the mark as a
    DeepSpeed-MoE parameter and looks for a DeepSpeed-MoE expert group that such a model does not have. With
    every parameter replicated over the data-parallel group there is nothing the mark would change."""
    for p in model.parameters():
        if hasattr(p, "allreduce"):
            del p.allreduce


def adapter_lora_config(section):
    """peft's LoraConfig for the recipe's ``lora`` section."""
    return lora_config(section.r, section.alpha, section.target_modules, section.target_parameters,
                       section.dropout)


def load_base(model: nn.Module, resolved, names: str) -> None:
    """Load the resolved base (a Hugging Face or K3-layout checkpoint, ``resolved.path``) into ``model``
    strictly, each rank writing only its own slices and ZeRO-3 partitions (a text model over an image base
    reads the text tensors only); a preset keeps the weights it was initialised with from the seed."""
    if resolved.path is None:
        return
    from ...precision import apply_precision
    from ...weights.loader import load_state
    from ...weights.names import VISION_PREFIXES

    apply_precision(model)  # built under zero.Init, the fp32 tensors are bf16 partitions: whole fp32 before loading
    # a text-only run of an image base builds the text model (images.wants_images): the base's vision tower is
    # no part of it, so it is left in the checkpoint (the exports copy it through); an image model reads it
    text_only = not any(n.startswith(VISION_PREFIXES) for n, _ in model.named_parameters())
    load_state(model, resolved.path, names=names, config=resolved.model_config, strict=True, ignore_vision=text_only)


def hf_config(model_section):
    """The Hugging Face ``MoEPluginConfig`` of the recipe's base model (a preset, or a checkpoint's config);
    ``resolved_model.base_hf_config``, kept for callers that hold only a model section (the planner)."""
    from ..resolved_model import base_hf_config

    return base_hf_config(model_section)
