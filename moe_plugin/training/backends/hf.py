"""The ``hf`` backend: the Hugging Face ``MoEPluginForCausalLM``, one process or ZeRO-3 data parallel.

Every rank holds the whole (partitioned) model and reads its own batches. This backend runs without expert
parallelism (recipes give the ``megatron`` backend for it; the Hugging Face Trainer gets it from
``moe_plugin.parallel.hf_expert_parallel``), so the expert mark ``allreduce = False`` that ``add_lora`` sets on
expert adapters is removed here (``parallel.zero3_ep.hide_expert_marks``).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
from torch import nn

from ...layers.recompute import set_recompute
from ...lora import add_lora, init_expert_adapters
from ...parallel.zero3_gather import gathered
from ...precision import apply_precision
from ..metrics.routing import moe_layers
from .base import Backend, ParallelInfo
from ...parallel.zero3_ep import hide_expert_marks
from ...weights.loader import load_base
from ..ds_config import partition_while_building, zero_init, zero_stage

__all__ = ["HFBackend"]


class HFBackend(Backend):
    name = "hf"

    def setup_parallel(self) -> ParallelInfo:
        import torch.distributed as dist

        return ParallelInfo(dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), ep_size=1)

    def build_model(self, ds_config: dict) -> nn.Module:
        from transformers.integrations import HfDeepSpeedConfig

        from ...models import MoEPluginForCausalLM
        from .images import ImageTextTrainingModel, wants_images

        model_class = ImageTextTrainingModel if wants_images(self.recipe, self.model_config) else MoEPluginForCausalLM
        zero3 = zero_stage(ds_config) == 3
        # while this object lives, transformers knows the model is ZeRO-3 partitioned (gathers to save, ...)
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
        if partition_while_building(ds_config, self.recipe):
            from ...compat.transformers import no_init_weights

            # the checkpoint overwrites every weight: skip transformers' post-init draws, which would run
            # on the empty ZeRO-3 placeholders (as transformers' own from_pretrained does under ZeRO-3)
            with no_init_weights(), zero_init(ds_config):
                model = model_class(copy.deepcopy(self.resolved.hf_config))
        else:
            model = model_class(copy.deepcopy(self.resolved.hf_config))
        if not zero3:
            model.to(self.device)
        load_base(model, self.resolved, names="hf")
        section = self.recipe.lora
        if section is not None:
            torch.manual_seed(self.recipe.seed)
            model = add_lora(model, section.peft_config(), wrap=True)
            init_expert_adapters(model, self.recipe.seed)
            # the base is frozen now: its fp32 tensors become fp32 buffers, which deepspeed.initialize leaves
            apply_precision(model)  # alone (docs/precision.md)
        hide_expert_marks(model)
        # the recipe's activation checkpointing (after LoRA: a frozen vision tower recomputes nothing)
        set_recompute(model, self.recipe.schedule.activation_checkpointing)
        from ...models.modeling import MoEPluginForCausalLM

        for module in model.modules():  # the text model itself, or the image model's language model
            if isinstance(module, MoEPluginForCausalLM):
                module.router_aux_loss_coeff = self.recipe.router_aux_loss_coeff()
        return model

    def loss(self, module: nn.Module, micro_batch, num_items: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        out = module(input_ids=micro_batch.input_ids.to(self.device), labels=micro_batch.labels.to(self.device),
                     cu_seqlens=micro_batch.cu_seqlens.to(self.device), num_items_in_batch=num_items,
                     **micro_batch.image_inputs(self.device))
        metrics = {} if out.indexer_loss is None else {"indexer_kl": out.indexer_loss.detach()}
        if out.balance_loss is not None:  # the model added coefficient x its sum to out.loss
            metrics["aux_loss"] = self.recipe.router_aux_loss_coeff() * out.balance_loss.detach()
        return out.loss, metrics

    def moe_layers(self, module: nn.Module) -> List[nn.Module]:
        return moe_layers(module)

    def adapter_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        with gathered([p for n, p in module.named_parameters() if ".lora_" in n]):
            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(module).items()}

    def full_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The base model's state dict under its own names (adapters left out), gathered whole."""
        from ...megatron.weights import base_name

        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        with gathered(list(module.parameters())):
            return {base_name(k): v.detach().clone() for k, v in base.state_dict().items() if ".lora_" not in k}
