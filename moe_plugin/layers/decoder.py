"""A decoder layer: one attention kind (KDA or gated MLA/DSA) and one MLP kind (Stable Latent MoE or dense).

Parameter names are K3's (docs/architecture.md 7): ``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, then ``block_sparse_moe`` or ``mlp``; with Attention Residuals also
``self_attention_res_{proj,norm}`` and ``mlp_res_{proj,norm}``.

A layer takes and returns plain tensors (the residual stream's ``state()`` tuple, the MoE load, the indexer
loss): ZeRO-3 registers its backward hooks on a module's tensor outputs only (docs/zero3-ep.md).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..config import ModelConfig
from .attn_res import attn_res_point, stream_from_state
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
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if not 0 <= layer_idx < config.num_layers:
            raise ValueError(f"layer_idx: expected 0 <= layer_idx < {config.num_layers}, got {layer_idx}")
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        self.is_moe = config.is_moe_layer(layer_idx)
        self.ends_block = (layer_idx + 1) % config.attn_res_block_size == 0
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = KDAAttention(config.kda) if self.attention_type == "kda" else GatedMLAAttention(config.mla)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.is_moe:
            self.block_sparse_moe = StableLatentMoE(config.moe)
        else:
            moe = config.moe
            self.mlp = GLUMLP(d, config.dense_intermediate_size, activation=moe.activation,
                              situ_beta=moe.situ_beta, situ_linear_beta=moe.situ_linear_beta)
        self.attn_res = config.attn_res
        self.block_size = config.attn_res_block_size
        if config.attn_res:
            self.self_attention_res_proj, self.self_attention_res_norm = attn_res_point(d, eps)
            self.mlp_res_proj, self.mlp_res_norm = attn_res_point(d, eps)

    def new_cache(self) -> LayerCache:
        return new_layer_cache(self.attention_type)

    def forward(self, residual: Tuple[torch.Tensor, ...], cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None, return_indexer_loss: bool = False,
                token_mask: Optional[torch.Tensor] = None) -> LayerOutput:
        """Advance the residual stream through attention and MLP.

        residual: the stream's ``state()`` before this layer (``PlainStream``: ``(h,)``; ``AttnResStream``:
        the block values, then the partial sum unless this layer starts a block), each ``[B, T, D]``.
        Returns ``(state after the layer, expert_load [E] or None, indexer_loss or None)``.
        token_mask ``[B, T]`` bool, False = padding (a left-padded prompt): the attention layers keep padded
        tokens out of their state / keys, and the MoE load counts real tokens only.
        """
        stream = stream_from_state(residual, self.attn_res, self.layer_idx, self.block_size)
        load = indexer_loss = None
        x = stream.read(*self._res_point("self_attention"))
        h = self.input_layernorm(x)
        attn_kwargs = dict(cu_seqlens=cu_seqlens, cache=cache, token_mask=token_mask)
        if return_indexer_loss and self.attention_type == "mla":  # only MLA layers have an indexer
            out, indexer_loss = self.self_attn(h, return_indexer_loss=True, **attn_kwargs)
        else:
            out = self.self_attn(h, **attn_kwargs)
        stream.add(out)

        x = stream.read(*self._res_point("mlp"))
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            padding = None if token_mask is None else ~token_mask.bool()
            out, load = self.block_sparse_moe(h, padding_mask=padding)
        else:
            out = self.mlp(h)
        stream.add(out)
        if self.attn_res and self.ends_block:
            stream.end_block()
        return stream.state(), load, indexer_loss

    def _res_point(self, name: str):
        if not self.attn_res:
            return ()
        return getattr(self, f"{name}_res_proj"), getattr(self, f"{name}_res_norm")
