"""The ``hf`` backend: the Hugging Face ``MoEPluginForCausalLM``, one process, ZeRO-3 data parallel, or expert
parallel x ZeRO-3.

Every rank holds the whole (partitioned) dense model and reads its own batches. With
``parallel.expert_parallel_size`` above 1 the layout's groups are started and expert parallelism is applied from
outside the single-device model by the one function every face uses
(``parallel.expert_parallel.apply_expert_parallel``: each MoE layer holds this rank's experts and dispatches
tokens with megatron-core's all-to-all), exactly as ``moe_plugin.hf_trainer.MoETrainer`` users get it. The
expert adapters are then tagged for ZeRO-3, or their marks removed without expert parallelism
(``ParallelLayout.tag_expert_parameters``).
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
from ...parallel.expert_parallel import apply_expert_parallel
from ...parallel.layout import ParallelLayout
from .base import Backend
from ...weights.base_loading import load_base
from ..context_rows import row_loss, slice_row
from ..ds_config import partition_while_building, zero_init, zero_stage

__all__ = ["HFBackend"]


class HFBackend(Backend):
    name = "hf"

    def setup_parallel(self) -> ParallelLayout:
        if self.layout.expert > 1 or self.layout.context > 1:  # data parallel alone needs no megatron groups
            from ...compat import check_all

            check_all(("megatron",))
            self.layout.start(seed=None)  # the loop restores the RNG after this; the seed draws nothing here
        return self.layout

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
        apply_expert_parallel(
            model, self.layout, checkpoint=self.resolved.path, overlap_chunks=self.recipe.parallel.moe_overlap_chunks
        )
        section = self.recipe.lora
        if section is not None:
            torch.manual_seed(self.recipe.seed)
            model = add_lora(model, section.peft_config(), wrap=True)
            init_expert_adapters(model, self.recipe.seed)
            # the base is frozen now: its fp32 tensors become fp32 buffers, which deepspeed.initialize leaves
            apply_precision(model)  # alone (docs/precision.md)
        self.layout.tag_expert_parameters(model, zero3)
        # the recipe's activation checkpointing (after LoRA: a frozen vision tower recomputes nothing)
        set_recompute(model, self.recipe.schedule.activation_checkpointing)
        from ...models.modeling import MoEPluginForCausalLM

        for module in model.modules():  # the text model itself, or the image model's language model
            if isinstance(module, MoEPluginForCausalLM):
                module.router_aux_loss_coeff = self.recipe.router_aux_loss_coeff()
        return model

    def loss(self, module: nn.Module, micro_batch, num_items: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The model's own training loss (``MoEPluginForCausalLM.forward`` with labels); under context
        parallelism the rank's slice of the row through the model and the loss composed here, as the megatron
        backend composes it (``training.context_rows``, ``ops.losses.training_loss``)."""
        if self.layout.context > 1:
            return self._context_loss(module, micro_batch, num_items)
        out = module(
            input_ids=micro_batch.input_ids.to(self.device),
            labels=micro_batch.labels.to(self.device),
            cu_seqlens=micro_batch.cu_seqlens.to(self.device),
            num_items_in_batch=num_items,
            **micro_batch.image_inputs(self.device),
        )
        metrics = {} if out.indexer_loss is None else {"indexer_kl": out.indexer_loss.detach()}
        if out.balance_loss is not None:  # the model added coefficient x its sum to out.loss
            metrics["aux_loss"] = self.recipe.router_aux_loss_coeff() * out.balance_loss.detach()
        return out.loss, metrics

    def _context_loss(self, module: nn.Module, micro_batch, num_items: float):
        row = slice_row(micro_batch, self.layout, self.device, self.model_config.image_token_id)
        inner = module.module if hasattr(module, "module") else module
        coeff = self.recipe.router_aux_loss_coeff() if inner.training else 0.0

        def forward():  # the model computes the indexer loss where it learns (its forward's rule)
            out = module(input_ids=row.input_ids, context=row.context, **row.images)
            return out.logits, out.indexer_loss

        indexer_coeff = float(getattr(self.resolved.hf_config, "indexer_loss_coeff", 0.0))
        return row_loss(row, forward, self.moe_layers(module), num_items, coeff, indexer_coeff)

    def moe_layers(self, module: nn.Module) -> List[nn.Module]:
        return moe_layers(module)

    def adapter_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The whole adapter under the names peft writes (``hf_expert_parallel.adapter_state``, the Trainer's:
        ZeRO-3 gathered, expert adapters all-gathered over the expert-parallel group), adapter name removed."""
        from peft import get_peft_model_state_dict

        from ...parallel.hf_expert_parallel import adapter_state

        return get_peft_model_state_dict(module, state_dict=adapter_state(module))

    def teardown(self) -> None:
        self.layout.stop()

    def full_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The base model's state dict under its own names (adapters left out), gathered whole."""
        from ...megatron.weights import base_name

        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        with gathered(list(module.parameters())):
            return {base_name(k): v.detach().clone() for k, v in base.state_dict().items() if ".lora_" not in k}
