"""Attention Residuals (docs/architecture.md 2.3) on megatron-core's ``TransformerBlock`` / ``TransformerLayer``.

megatron's layer adds every sublayer output to one residual stream, so with Attention Residuals the layer and
the block are thin subclasses that carry the stream of ``moe_plugin.layers.attn_res`` instead (the same
``AttnResStream``, ``attn_res_read`` and mixing-point modules as the Hugging Face model: one copy of the math):

* ``AttnResTransformerLayer``: megatron's ``TransformerLayer`` (its ``input_layernorm``, ``self_attention``,
  ``pre_mlp_layernorm`` and ``mlp`` built from the same specs) plus the two mixing points
  ``self_attention_res_{proj,norm}`` and ``mlp_res_{proj,norm}``. ``forward(residual)`` takes and returns the
  stream's state, a tuple of ``[S, B, H]`` tensors (the completed block values, then the current block's
  partial sum when it has one), so ZeRO-3's hooks see tensors only.
* ``AttnResTransformerBlock``: megatron's ``TransformerBlock`` whose forward threads that tuple through the
  layers and, on the last stage, mixes it at ``output_attn_res_{proj,norm}`` before the final norm.
  ``GPTModel`` hard-codes ``TransformerBlock`` as its decoder class, so ``enable_attn_res_block`` re-classes
  the block it built (the layers already come from our specs) and adds the output mixing point.

The mixing is layout-agnostic (it reduces the last dim), so sequence-first tensors need no transpose.
Pipeline stages (not built here: the adapters require ``pipeline_model_parallel_size == 1``) would send the
state tuple as the stage payload; docs/attn-res-distributed.md says how.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from megatron.core.transformer.transformer_block import TransformerBlock

from ..compat.megatron import adopt_subclass
from ..config import require
from ..layers.attn_res import AttnResStream, attn_res_point, ends_block, layer_stream, stream_from_state
from ..layers.composition import run_layer
from .recompute_layer import CheckpointedTransformerLayer, merged_bias

__all__ = ["AttnResTransformerLayer", "AttnResTransformerBlock", "enable_attn_res_block"]

State = Tuple[torch.Tensor, ...]


class AttnResTransformerLayer(CheckpointedTransformerLayer):
    """``TransformerLayer`` with Attention Residuals; ``attn_res_block_size`` comes from the spec's params."""

    def __init__(self, config, submodules, layer_number: int = 1, attn_res_block_size: int = 12, **kwargs: Any):
        require(
            isinstance(attn_res_block_size, int) and attn_res_block_size > 0,
            "attn_res_block_size",
            f"must be a positive integer, got {attn_res_block_size!r}",
        )
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        self.attn_res_block_size = attn_res_block_size
        d, eps = config.hidden_size, config.layernorm_epsilon
        self.self_attention_res_proj, self.self_attention_res_norm = attn_res_point(d, eps)
        self.mlp_res_proj, self.mlp_res_norm = attn_res_point(d, eps)

    @property
    def layers_before(self) -> int:
        return self.layer_number - 1  # megatron's layer_number is 1-based and global (pipeline offset included)

    def forward(
        self,
        residual: State,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        padding_mask: Optional[torch.Tensor] = None,
        inference_context: Any = None,
        **unused: Any,
    ) -> State:
        """residual: the stream's state before this layer, tensors ``[S, B, H]`` -> the state after it.

        Rotary and cross-attention arguments are ignored (the model has neither); ``inference_context`` is
        refused by the attention adapters. The layer is ``layers.composition.run_layer``, the Hugging Face
        ``DecoderLayer``'s composition, with ``recompute_mode``'s regions (the MoE routes outside them).
        """
        mode = self.recompute_mode if inference_context is None else "off"
        attn_kwargs = dict(
            attention_mask=attention_mask, inference_context=inference_context, packed_seq_params=packed_seq_params
        )
        state, _, _ = run_layer(
            residual, self._layer_parts(attn_kwargs, padding_mask), mode, self.recompute_checkpoint_fn
        )
        return state

    def _stream(self, state: State, after_attention: bool) -> AttnResStream:
        return layer_stream(
            state, after_attention, attn_res=True, layer_idx=self.layers_before, block_size=self.attn_res_block_size
        )

    def _mixing_points(self) -> dict:
        return dict(
            attention_point=(self.self_attention_res_proj, self.self_attention_res_norm),
            mlp_point=(self.mlp_res_proj, self.mlp_res_norm),
            ends_block=ends_block(self.layers_before, self.attn_res_block_size),
        )

    def _mlp_output(self, out_with_bias) -> torch.Tensor:
        """The stream adds one tensor: the MLP's ``out + bias`` (there is no bias-dropout-add here)."""
        return merged_bias(out_with_bias)


class AttnResTransformerBlock(TransformerBlock):
    """``TransformerBlock`` over ``AttnResTransformerLayer``s; build with ``enable_attn_res_block``."""

    attn_res_block_size: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        padding_mask: Optional[torch.Tensor] = None,
        inference_context: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        """hidden_states: the embeddings ``[S, B, H]`` -> the final-normed hidden states ``[S, B, H]``.

        Recomputation, CPU offloading and FP8/FP4 contexts of megatron's block are not carried over (the
        builder refuses configs that ask for them).
        """
        require(
            self.pre_process,
            "pre_process",
            "a stage after the first needs the state tuple as its input (pipeline stages are not built)",
        )
        residual: State = (hidden_states,)
        for layer in self.layers:
            residual = layer(
                residual,
                attention_mask=attention_mask,
                packed_seq_params=packed_seq_params,
                padding_mask=padding_mask,
                inference_context=inference_context,
            )
        done = self.layers[-1].layer_number if len(self.layers) else 0
        stream = stream_from_state(residual, True, done, self.attn_res_block_size)
        hidden = stream.read(self.output_attn_res_proj, self.output_attn_res_norm)
        return self.final_layernorm(hidden) if self.final_layernorm is not None else hidden


def enable_attn_res_block(block: TransformerBlock, attn_res_block_size: int) -> AttnResTransformerBlock:
    """Turn ``GPTModel``'s decoder ``block`` (built from ``AttnResTransformerLayer`` specs) into an
    ``AttnResTransformerBlock`` in place, adding ``output_attn_res_{proj,norm}``; returns it.

    Call it where the model was built (under ``deepspeed.zero.Init`` too, so the new point is partitioned).
    """
    require(
        all(isinstance(layer, AttnResTransformerLayer) for layer in block.layers),
        "block.layers",
        "must all be AttnResTransformerLayer (build the decoder from decoder_block_spec with attn_res)",
    )
    config = block.config
    for name in ("recompute_granularity", "fp8", "fp4"):
        require(
            not getattr(config, name, None),
            f"TransformerConfig.{name}",
            "is not supported with Attention Residuals (the AttnRes block has no such path); unset it",
        )
    require(
        not config.cpu_offloading,
        "TransformerConfig.cpu_offloading",
        "is not supported with Attention Residuals; set it False",
    )
    adopt_subclass(block, AttnResTransformerBlock)
    block.attn_res_block_size = attn_res_block_size
    block.output_attn_res_proj, block.output_attn_res_norm = attn_res_point(
        config.hidden_size, config.layernorm_epsilon
    )
    return block
