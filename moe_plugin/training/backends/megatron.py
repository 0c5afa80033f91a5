"""The ``megatron`` backend: megatron-core's ``GPTModel`` from this project's specs, megatron's expert
parallelism on its all-to-all dispatcher, sharded by DeepSpeed ZeRO-3 within the right groups.

Process groups: megatron's ``parallel_state`` with ``parallel.expert_parallel_size`` and
``parallel.context_parallel_size``; tensor and pipeline parallel sizes are 1. Every data-parallel rank reads its
own batches; the ranks of a context-parallel group read the same ones and each runs its contiguous slice of the
packed row (``loss``, docs/context-parallel.md); the expert-parallel all-to-all exchanges tokens between them.
DeepSpeed's expert groups are built from the same ranks and checked equal
(``moe_plugin.parallel.layout.ParallelLayout.start``), and expert parallelism is applied, and the expert
parameters tagged, by the one place that does it for every face (``parallel.expert_parallel.apply_expert_parallel``,
``ParallelLayout.tag_expert_parameters``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...layers.recompute import set_recompute
from ...lora import add_lora, init_expert_adapters
from ...parallel.expert_parallel import apply_expert_parallel
from ...parallel.layout import ParallelLayout
from ...parallel.zero3_gather import gathered
from ...precision import apply_precision
from .base import Backend
from ..context_rows import row_loss, slice_row
from ...weights.base_loading import load_base
from ..ds_config import partition_while_building, zero_init, zero_stage

__all__ = ["MegatronBackend"]


class MegatronBackend(Backend):
    name = "megatron"

    def setup_parallel(self) -> ParallelLayout:
        from ...compat import check_all

        check_all(("megatron",))  # megatron-core's internals this backend reaches, once, before any is used
        return self.layout.start(seed=self.recipe.seed)  # megatron builds its MoE layers from these groups

    def build_model(self, ds_config: Optional[dict]) -> nn.Module:

        from ...megatron.multimodal import build_multimodal_gpt_model
        from ...megatron.specs import build_gpt_model, transformer_config
        from .images import wants_images

        mc = self.model_config
        tc = transformer_config(mc, use_cpu_initialization=self.device.type == "cpu")
        zero3 = zero_stage(ds_config) == 3
        with zero_init(ds_config) if partition_while_building(ds_config, self.recipe) else contextlib.nullcontext():
            build = build_multimodal_gpt_model if wants_images(self.recipe, mc) else build_gpt_model
            model = build(mc, tc, indexer_loss=self._indexer_loss_coeff() > 0)
        apply_expert_parallel(model, self.layout, overlap_chunks=self.recipe.parallel.moe_overlap_chunks)
        if not zero3:
            model.to(self.device)
        load_base(model, self.resolved, names="megatron")
        section = self.recipe.lora
        if section is not None:
            torch.manual_seed(self.recipe.seed)  # the same dense adapters on every rank and in every layout
            add_lora(model, section.peft_config())
            init_expert_adapters(model, self.recipe.seed)
            # the base is frozen now: its fp32 tensors become fp32 buffers, which deepspeed.initialize leaves
            apply_precision(model)  # alone (docs/precision.md)
        self.layout.tag_expert_parameters(model, zero3)
        # the recipe's activation checkpointing (after LoRA: a frozen vision tower recomputes nothing)
        set_recompute(model, self.recipe.schedule.activation_checkpointing)
        return model

    def loss(self, module: nn.Module, micro_batch, num_items: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The token loss of the micro-batch, plus ``indexer_loss_coeff`` times the mean indexer KL loss of the
        Gated DSA layers when they computed one (training, indexer trainable), plus, in training, the recipe's
        ``router_aux_loss_coeff`` times the MoE layers' per-document balance terms, composed by the one
        ``ops.losses.training_loss`` the Hugging Face model (``MoEPluginForCausalLM``) calls too, from the same
        documents and weights (``ops.moe.document_weights``)."""
        from ...megatron.adapters import ContextPackedSeqParams, indexer_loss_of

        inner = module.module if hasattr(module, "module") else module
        row = slice_row(micro_batch, self.layout, self.device, self.model_config.image_token_id)
        params = ContextPackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=row.local_cu_seqlens,
            cu_seqlens_kv=row.local_cu_seqlens,
            max_seqlen_q=row.longest,
            max_seqlen_kv=row.longest,
            context=row.context,
        )
        # the packed row is [1, T]: megatron routes its [T, 1] tokens in the same order
        coeff = self.recipe.router_aux_loss_coeff() if inner.training else 0.0

        def forward():
            logits = module(row.input_ids, None, None, packed_seq_params=params, **row.images)
            return logits, indexer_loss_of(inner)

        return row_loss(row, forward, self.moe_layers(inner), num_items, coeff, self._indexer_loss_coeff())

    def _indexer_loss_coeff(self) -> float:
        """The base config's ``indexer_loss_coeff`` (0 = the indexer is not trained)."""
        return float(getattr(self.resolved.hf_config, "indexer_loss_coeff", 0.0))

    def moe_layers(self, module: nn.Module) -> List[nn.Module]:
        return [layer.mlp for layer in module.decoder.layers if layer.is_moe_layer]

    def shard_units(self, module: nn.Module) -> List[nn.Module]:
        return list(module.decoder.layers)

    def adapter_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        from ...megatron.lora import adapter_state_to_hf

        with gathered([p for n, p in module.named_parameters() if ".lora_" in n]):
            state = _image_model_names(module, adapter_state_to_hf(module, self.model_config))
        # the keys peft writes: its wrapper prefix, without the adapter name
        return {"base_model.model." + k.replace(".default.", "."): v for k, v in state.items()}

    def full_state(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        from ...megatron.weights import megatron_to_hf_state_dict

        with gathered(list(module.parameters())):
            return _image_model_names(module, megatron_to_hf_state_dict(module, self.model_config))

    def teardown(self) -> None:
        self.layout.stop()


def _image_model_names(module: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Hugging Face names of the face the state is for: the image model (``MoEPluginForConditionalGeneration``)
    nests the text model under ``language_model.``, its vision tower and projector keep their names."""
    from ...megatron.multimodal import MultimodalGPTModel
    from ...weights.names import VISION_PREFIXES

    if not isinstance(module, MultimodalGPTModel):
        return state
    return {k if k.startswith(VISION_PREFIXES) else "language_model." + k: v for k, v in state.items()}
