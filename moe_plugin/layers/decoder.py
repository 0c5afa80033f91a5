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
from .attn_res import AttnResStream, PlainStream, attn_res_point, ends_block, stream_from_state
from .gated_dsa import GatedMLAAttention, MLACache
from .kda import KDAAttention, KDACache
from .mlp import GLUMLP
from .moe import StableLatentMoE
from .norm import RMSNorm
from .recompute import read_stream, recomputed

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
            self.mlp = GLUMLP(d, config.dense_intermediate_size, activation=moe.activation,
                              situ_beta=moe.situ_beta, situ_linear_beta=moe.situ_linear_beta)
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

    def forward(self, residual: Tuple[torch.Tensor, ...], cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[LayerCache] = None, return_indexer_loss: bool = False,
                token_mask: Optional[torch.Tensor] = None) -> LayerOutput:
        """Advance the residual stream through attention and MLP.

        residual: the stream's ``state()`` before this layer (``PlainStream``: ``(h,)``; ``AttnResStream``:
        the block values, then the partial sum unless this layer starts a block), each ``[B, T, D]``.
        Returns ``(state after the layer, expert_load [E] or None, indexer_loss or None)``.
        token_mask ``[B, T]`` bool, False = padding (a left-padded prompt): the attention layers keep padded
        tokens out of their state / keys, and the MoE load counts real tokens only.
        With ``recompute_mode`` (``layers.recompute``) the regions it names are recomputed in the backward; the
        MoE routes outside them (it holds the same mode). A cache (decoding) is never recomputed into.
        """
        mode = self.recompute_mode if cache is None else "off"
        attn_kwargs = dict(cu_seqlens=cu_seqlens, cache=cache, token_mask=token_mask)
        want_index = return_indexer_loss and self.attention_type == "mla"  # only MLA layers have an indexer
        if not self.is_moe:
            state, indexer_loss = self._recomputed(mode, "layer", self._dense_layer, residual, attn_kwargs,
                                                   want_index, mode)
            return state, None, indexer_loss
        state, h, indexer_loss = self._recomputed(mode, "layer", self._before_router, residual, attn_kwargs,
                                                  want_index, mode)
        padding = None if token_mask is None else ~token_mask.bool()
        out, load = self.block_sparse_moe(h, padding_mask=padding)
        return self._after_mlp(state, out), load, indexer_loss

    def _recomputed(self, mode: str, region: str, fn, *args):
        return recomputed(mode, region, fn, *args, checkpoint_fn=self.recompute_checkpoint_fn)

    def _attention(self, x: torch.Tensor, attn_kwargs: dict, want_index: bool):
        """x ``[B, T, D]`` (the mixed residual) -> (attention output ``[B, T, D]``, indexer loss or None)."""
        h = self.input_layernorm(x)
        if want_index:
            return self.self_attn(h, return_indexer_loss=True, **attn_kwargs)
        return self.self_attn(h, **attn_kwargs), None

    def _through_attention(self, residual, attn_kwargs: dict, want_index: bool, mode: str):
        """The stream after the attention sublayer, and the indexer loss."""
        stream = stream_from_state(residual, self.attn_res, self.layer_idx, self.block_size)
        x = read_stream(mode, stream, self._res_point("self_attention"), self.recompute_checkpoint_fn)
        out, indexer_loss = self._recomputed(mode, "attention", self._attention, x, attn_kwargs, want_index)
        stream.add(out)
        return stream, indexer_loss

    def _before_router(self, residual, attn_kwargs: dict, want_index: bool, mode: str):
        """An MoE layer up to its router: (the stream's state after attention, the MoE input ``[B, T, D]``,
        the indexer loss or None)."""
        stream, indexer_loss = self._through_attention(residual, attn_kwargs, want_index, mode)
        x = read_stream(mode, stream, self._res_point("mlp"), self.recompute_checkpoint_fn)
        h = self._recomputed(mode, "mlp_norm", self.post_attention_layernorm, x)
        return stream.state(), h, indexer_loss

    def _dense_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))

    def _dense_layer(self, residual, attn_kwargs: dict, want_index: bool, mode: str):
        """A dense layer whole: (the stream's state after it, the indexer loss or None)."""
        stream, indexer_loss = self._through_attention(residual, attn_kwargs, want_index, mode)
        x = read_stream(mode, stream, self._res_point("mlp"), self.recompute_checkpoint_fn)
        out = self._recomputed(mode, "dense_mlp", self._dense_mlp, x)
        return self._after_mlp(stream.state(), out), indexer_loss

    def _after_mlp(self, state: Tuple[torch.Tensor, ...], out: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The stream's state after the attention plus the MLP's output ``[B, T, D]``: the state after the layer."""
        # after the attention's add an AttnRes stream always ends with the block's partial sum
        stream = AttnResStream.from_state(state, True) if self.attn_res else PlainStream.from_state(state)
        stream.add(out)
        if self.attn_res and self.ends_block:
            stream.end_block()
        return stream.state()

    def _res_point(self, name: str):
        if not self.attn_res:
            return ()
        return getattr(self, f"{name}_res_proj"), getattr(self, f"{name}_res_norm")
