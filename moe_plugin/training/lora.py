"""LoRA adapters through peft: the base is frozen, only adapters train."""

from __future__ import annotations

from peft import LoraConfig, get_peft_model
from torch import nn

from .recipe import LoraSection


def apply_lora(model: nn.Module, section: LoraSection):
    """Wrap ``model`` with peft LoRA on ``section``'s targets; returns the PeftModel."""
    config = LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=0.0,
                        target_modules=list(section.target_modules) or None,
                        target_parameters=list(section.target_parameters) or None)
    return get_peft_model(model, config)


def count_parameters(model: nn.Module):
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
