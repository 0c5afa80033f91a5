"""A decoder layer: one attention kind (KDA or gated MLA/DSA) and one MLP kind (Stable Latent MoE or dense).

Parameter names are K3's (docs/architecture.md 7): ``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, then ``block_sparse_moe`` or ``mlp``; with Attention Residuals also
``self_attention_res_{proj,norm}`` and ``mlp_res_{proj,norm}``.

A layer takes and returns plain tensors (the residual stream's ``state()`` tuple, the MoE load, the indexer
loss): ZeRO-3 registers its backward hooks on a module's tensor outputs only (docs/zero3-ep.md).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.context import ContextSlice
from .attention_inputs import AttentionInputs, layer_inputs
from .attn_res import attn_res_point, ends_block, layer_stream
from .composition import LayerParts, run_layer
from .gated_dsa import GatedMLAAttention, MLACache
from .kda import KDAAttention, KDACache
from .mlp import GLUMLP
from .moe import StableLatentMoE
from .norm import RMSNorm

LayerCache = Union[KDACache, MLACache]
# (the stream's state after the layer, expert load [E] or None, indexer KL loss (scalar) or None)
LayerOutput = Tuple[Tuple[torch.Tensor, ...], Optional[torch.Tensor], Optional[torch.Tensor]]


def new_layer_cache(attention_type: str) -> LayerCache:
    return KDACache() if attention_type == "kda" else MLACache()


class DecoderLayer(nn.Module):
    recompute_mode = "off"  # layers.recompute: set_recompute sets it (and the checkpoint function) per layer
    recompute_checkpoint_fn = None

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if not 0 <= layer_idx < config.num_layers:
            raise ValueError(f"layer_idx: expected 0 <= layer_idx < {config.num_layers}, got {layer_idx}")
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        self.is_moe = config.is_moe_layer(layer_idx)
        self.ends_block = ends_block(layer_idx, config.attn_res_block_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = KDAAttention(config.kda) if self.attention_type == "kda" else GatedMLAAttention(config.mla)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.is_moe:
            self.block_sparse_moe = StableLatentMoE(config.moe)
        else:
            moe = config.moe
            self.mlp = GLUMLP(
                d,
                config.dense_intermediate_size,
                activation=moe.activation,
                situ_beta=moe.situ_beta,
                situ_linear_beta=moe.situ_linear_beta,
            )
        self.attn_res = config.attn_res
        self.block_size = config.attn_res_block_size
        if config.attn_res:
            self.self_attention_res_proj, self.self_attention_res_norm = attn_res_point(d, eps)
            self.mlp_res_proj, self.mlp_res_norm = attn_res_point(d, eps)

    @property
    def gradient_checkpointing(self) -> bool:
        """transformers' flag (``is_gradient_checkpointing``): whether this layer recomputes anything."""
        return self.recompute_mode != "off"

    def new_cache(self) -> LayerCache:
        return new_layer_cache(self.attention_type)

    def forward(
        self,
        residual: Tuple[torch.Tensor, ...],
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[LayerCache] = None,
        return_indexer_loss: bool = False,
        token_mask: Optional[torch.Tensor] = None,
        context: Optional[ContextSlice] = None,
        inputs: Optional[AttentionInputs] = None,
    ) -> LayerOutput:
        """Advance the residual stream through attention and MLP.

        residual: the stream's ``state()`` before this layer (``PlainStream``: ``(h,)``; ``AttnResStream``:
        the block values, then the partial sum unless this layer starts a block), each ``[B, T, D]``.
        Returns ``(state after the layer, expert_load [E] or None, indexer_loss or None)``.
        token_mask ``[B, T]`` bool, False = padding (a left-padded prompt): the attention layers keep padded
        tokens out of their state / keys, and the MoE load counts real tokens only.
        With ``recompute_mode`` (``layers.recompute``) the regions it names are recomputed in the backward; the
        MoE routes outside them (it holds the same mode). A cache (decoding) is never recomputed into.
        context: this rank's ``ContextSlice`` under context parallelism (``residual`` its slice of the row): the
        attention takes the row's documents from it, so cu_seqlens, cache and token_mask must be None.
        inputs: the forward's ``AttentionInputs`` (``layers.attention_inputs``), in place of cu_seqlens,
        token_mask and context.
        """
        mode = self.recompute_mode if cache is None else "off"
        inputs = layer_inputs(inputs, residual[0], cache, cu_seqlens=cu_seqlens, token_mask=token_mask, context=context)
        attn_kwargs = dict(cache=cache, inputs=inputs)
        want_index = return_indexer_loss and self.attention_type == "mla"  # only MLA layers have an indexer
        padding = None if inputs.token_mask is None else ~inputs.token_mask
        parts = LayerParts(
            stream=partial(layer_stream, attn_res=self.attn_res, layer_idx=self.layer_idx, block_size=self.block_size),
            attention=partial(self._attention, attn_kwargs=attn_kwargs, want_index=want_index),
            mlp_norm=self.post_attention_layernorm,
            mlp=None if self.is_moe else self.mlp,
            moe=partial(self.block_sparse_moe, padding_mask=padding) if self.is_moe else None,
            attention_point=self._res_point("self_attention"),
            mlp_point=self._res_point("mlp"),
            ends_block=self.attn_res and self.ends_block,
        )
        return run_layer(residual, parts, mode, self.recompute_checkpoint_fn)

    def _attention(self, x: torch.Tensor, attn_kwargs: dict, want_index: bool):
        """x ``[B, T, D]`` (the mixed residual) -> (attention output ``[B, T, D]``, indexer loss or None)."""
        h = self.input_layernorm(x)
        if want_index:
            return self.self_attn(h, return_indexer_loss=True, **attn_kwargs)
        return self.self_attn(h, **attn_kwargs), None

    def _res_point(self, name: str):
        if not self.attn_res:
            return ()
        return getattr(self, f"{name}_res_proj"), getattr(self, f"{name}_res_norm")
