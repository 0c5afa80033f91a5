"""megatron-core's ``TransformerLayer`` with this project's activation checkpointing (``moe_plugin.layers.recompute``).

megatron's own recomputation (``recompute_granularity``) checkpoints whole layers or the whole MoE layer, router
and all-to-all included, with its reentrant ``tensor_parallel.checkpoint``. The layers here take
``recompute_mode`` instead, the Hugging Face model's rule: with ``"off"`` the forward is megatron's own; otherwise
it is the same computation for this model family (no bias, dropout 0, no cross-attention: ``specs`` builds
nothing else) split into the regions of ``layers.recompute``, and the MoE layer (``LatentMoELayer``, which holds
the same mode) routes and dispatches outside them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..layers.recompute import recomputed

__all__ = ["CheckpointedTransformerLayer"]


class CheckpointedTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose ``recompute_mode`` (``layers.recompute.set_recompute``) names what its backward
    recomputes. forward(hidden_states ``[S, B, H]``, ...) -> ``(hidden_states [S, B, H], context)`` as megatron's."""

    recompute_mode = "off"
    recompute_checkpoint_fn = None

    def forward(self, *args: Any, **kwargs: Any):
        if self.recompute_mode == "off" or kwargs.get("inference_context") is not None:
            return super().forward(*args, **kwargs)
        return self._forward_regions(*args, **kwargs), None

    def _forward_regions(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                         packed_seq_params: Any = None, padding_mask: Optional[torch.Tensor] = None,
                         **unused: Any) -> torch.Tensor:
        mode = self.recompute_mode
        attn_kwargs = dict(attention_mask=attention_mask, packed_seq_params=packed_seq_params)
        if not self.is_moe_layer:
            return self._recomputed(mode, "layer", self._dense_layer, hidden_states, attn_kwargs, padding_mask,
                                    mode)
        hidden, normed = self._recomputed(mode, "layer", self._before_router, hidden_states, attn_kwargs, mode)
        return self._bias_add(self.mlp_bda, self.mlp(normed, padding_mask=padding_mask), hidden)

    def _recomputed(self, mode: str, region: str, fn, *args, **kwargs):
        return recomputed(mode, region, fn, *args, checkpoint_fn=self.recompute_checkpoint_fn, **kwargs)

    def _bias_add(self, bda, out_with_bias, residual: torch.Tensor) -> torch.Tensor:
        """megatron's bias-dropout-add of a sublayer's ``(out, bias)`` onto ``residual``, as its forward runs it."""
        with self.bias_dropout_add_exec_handler():
            return bda(self.training, self.config.bias_dropout_fusion)(out_with_bias, residual, self.hidden_dropout)

    def _attention(self, x: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """x ``[S, B, H]`` -> the attention sublayer's output ``[S, B, H]`` (its input norm included)."""
        out, bias = self.self_attention(self.input_layernorm(x), **attn_kwargs)
        return out if bias is None else out + bias

    def _through_attention(self, x: torch.Tensor, attn_kwargs: dict, mode: str) -> torch.Tensor:
        out = self._recomputed(mode, "attention", self._attention, x, attn_kwargs)
        return self._bias_add(self.self_attn_bda, (out, None), x)

    def _before_router(self, x: torch.Tensor, attn_kwargs: dict, mode: str):
        """An MoE layer up to its router: (the residual after attention, the MoE's input), both ``[S, B, H]``."""
        hidden = self._through_attention(x, attn_kwargs, mode)
        return hidden, self._recomputed(mode, "mlp_norm", self.pre_mlp_layernorm, hidden)

    def _dense_mlp(self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        return self.mlp(self.pre_mlp_layernorm(hidden), padding_mask=padding_mask)

    def _dense_layer(self, x: torch.Tensor, attn_kwargs: dict, padding_mask: Optional[torch.Tensor],
                     mode: str) -> torch.Tensor:
        hidden = self._through_attention(x, attn_kwargs, mode)
        out = self._recomputed(mode, "dense_mlp", self._dense_mlp, hidden, padding_mask)
        return self._bias_add(self.mlp_bda, out, hidden)
