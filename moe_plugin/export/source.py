"""What an export reads from a run directory: the recipe, the base checkpoint, the LoRA config and the adapter.

A run directory (``moe_plugin.training``) holds ``moe_plugin_run.json`` (the recipe), ``adapter/`` (the final
adapter in PEFT format, already gathered across expert-parallel and ZeRO ranks), ``checkpoints/step-*/``
(DeepSpeed engine checkpoints of the adapters) and, for a preset base, ``base/`` (the base weights drawn from
the seed). ``--step N`` reads the adapter of checkpoint N instead of the final one (``zero_checkpoint``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ..config import require
from ..training.run_dir import MARKER
from .targets import Target, adapter_targets, check_state_covers

__all__ = ["RunSource", "open_run"]


@dataclass
class RunSource:
    """One run's export inputs. state: the adapter tensors under PEFT keys (``base_model.model.<name>.lora_A
    .weight``, stacked expert adapters over all E); targets: every tensor the run's LoRA config adapts;
    base_path: the base checkpoint directory (Hugging Face or K3 layout); hf_config: the base model's
    ``MoEPluginConfig`` (recipe overrides applied); lora_config: peft's ``LoraConfig`` of the run."""

    run_dir: str
    step: Optional[int]
    recipe: dict
    base_path: str
    hf_config: object
    lora_config: object
    state: Dict[str, torch.Tensor]
    targets: Dict[str, Target]

    @property
    def model_config(self):
        return self.hf_config.to_model_config()


def _read_recipe(run_dir: str) -> dict:
    marker = os.path.join(run_dir, MARKER)
    require(os.path.isfile(marker), "run", f"{run_dir} has no {MARKER}: it is not a run directory of this project "
            "(give the output_dir a training run wrote)")
    with open(marker) as f:
        return json.load(f)


def open_run(run_dir: str, step: Optional[int] = None) -> RunSource:
    """Read the run at ``run_dir`` (its final adapter, or checkpoint ``step``); ValueError naming what is wrong."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from ..training.backends.common import adapter_lora_config, hf_config
    from ..training.recipe import LoraSection, ModelSection, ParallelSection

    run_dir = os.path.abspath(run_dir)
    recipe = _read_recipe(run_dir)
    require(recipe.get("lora") is not None, "run", f"{run_dir} trained every parameter (\"lora\": null): its "
            "output_dir/model is already the full model, there is no adapter to export")
    model = ModelSection.model_validate(recipe["model"])
    lora = LoraSection.model_validate(recipe["lora"])
    backend = ParallelSection.model_validate(recipe.get("parallel", {})).backend
    base_path = model.from_pretrained or os.path.join(run_dir, "base")
    require(os.path.isdir(base_path), "run", f"the base checkpoint {base_path} is missing (a preset run writes it "
            "at the end of training: did the run finish?)")
    config = hf_config(model)
    trained = adapter_lora_config(lora)
    targets = adapter_targets(config, trained)
    if step is None:
        adapter = os.path.join(run_dir, "adapter")
        require(os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")), "run",
                f"{adapter} has no adapter_model.safetensors (did the run finish? pass --step N to export a "
                "checkpoint)")
        written = LoraConfig.from_pretrained(adapter)
        listed = adapter_targets(config, written)
        uncovered = sorted(n for n, t in targets.items() if listed.get(n) != t)
        require(not uncovered, f"{adapter}/adapter_config.json", f"its target list does not cover what was "
                f"trained: {len(uncovered)} trained target(s) are not adapted (or not scaled) as in the run's recipe, "
                f"e.g. {uncovered[:10]}; a loader following this config would drop their deltas (rewrite it from "
                "the recipe's lora section)")
        state = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        where = f"{adapter}/adapter_model.safetensors"
    else:
        from .zero_checkpoint import adapter_from_checkpoint

        state = adapter_from_checkpoint(run_dir, step, config.to_model_config(), backend, lora.r)
        where = f"checkpoint step {step}"
    check_state_covers(targets, state, where)
    return RunSource(run_dir, step, recipe, base_path, config, trained, state, targets)
