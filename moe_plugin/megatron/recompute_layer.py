"""megatron-core's ``TransformerLayer`` with this project's activation checkpointing (``moe_plugin.layers.recompute``).

megatron's own recomputation (``recompute_granularity``) checkpoints whole layers or the whole MoE layer, router
and all-to-all included, with its reentrant ``tensor_parallel.checkpoint``. The layers here take
``recompute_mode`` instead, the Hugging Face model's rule: with ``"off"`` the forward is megatron's own; otherwise
it is the same computation for this model family (no bias, dropout 0, no cross-attention: ``specs`` builds
nothing else) split into the regions of ``layers.recompute``, and the MoE layer (``LatentMoELayer``, which holds
the same mode) routes and dispatches outside them. That split computation is ``layers.composition.run_layer``,
the Hugging Face ``DecoderLayer``'s own, given megatron's sublayers and its bias-dropout-add as the residual add.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..layers.composition import LayerParts, run_layer

__all__ = ["CheckpointedTransformerLayer"]


class _ResidualStream:
    """megatron's one residual ``[S, B, H]`` as a ``layers.composition`` stream: ``add`` is the layer's
    bias-dropout-add, ``self_attn_bda`` for the attention's output and ``mlp_bda`` for the MLP's, as megatron's
    forward runs them (a layer's stream sees the attention's add, then the MLP's)."""

    def __init__(self, layer: "CheckpointedTransformerLayer", hidden: torch.Tensor, after_attention: bool):
        self.layer, self.hidden = layer, hidden
        self.bda = layer.mlp_bda if after_attention else layer.self_attn_bda

    def read(self) -> torch.Tensor:
        return self.hidden

    def add(self, out) -> None:
        """out: the sublayer's output ``[S, B, H]``, or its ``(out, bias)`` as megatron's MLP returns it."""
        out_with_bias = out if isinstance(out, tuple) else (out, None)
        self.hidden = self.layer._bias_add(self.bda, out_with_bias, self.hidden)
        self.bda = self.layer.mlp_bda

    def end_block(self) -> None:
        pass

    def state(self) -> torch.Tensor:
        return self.hidden


def merged_bias(out_with_bias) -> torch.Tensor:
    """A megatron sublayer's ``(out, bias)`` -> ``out + bias`` (``out`` when there is no bias)."""
    out, bias = out_with_bias
    return out if bias is None else out + bias


class CheckpointedTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose ``recompute_mode`` (``layers.recompute.set_recompute``) names what its backward
    recomputes. forward(hidden_states ``[S, B, H]``, ...) -> ``(hidden_states [S, B, H], context)`` as megatron's.
    The recomputed forward is ``layers.composition.run_layer``, the Hugging Face layer's."""

    recompute_mode = "off"
    recompute_checkpoint_fn = None

    def forward(self, *args: Any, **kwargs: Any):
        if self.recompute_mode == "off" or kwargs.get("inference_context") is not None:
            return super().forward(*args, **kwargs)
        return self._forward_regions(*args, **kwargs), None

    def _forward_regions(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        padding_mask: Optional[torch.Tensor] = None,
        **unused: Any,
    ) -> torch.Tensor:
        attn_kwargs = dict(attention_mask=attention_mask, packed_seq_params=packed_seq_params)
        # the bare tensor, not (hidden_states,): torch's non-reentrant checkpoint saves a top-level tensor argument
        # of the "layer" region through the saved-tensor hooks (a tuple's tensors it holds by reference), as before
        hidden, _, _ = run_layer(
            hidden_states,
            self._layer_parts(attn_kwargs, padding_mask),
            self.recompute_mode,
            self.recompute_checkpoint_fn,
        )
        return hidden

    def _layer_parts(self, attn_kwargs: dict, padding_mask: Optional[torch.Tensor]) -> LayerParts:
        """This layer's sublayers in megatron's convention, for ``run_layer``."""
        mlp = partial(self._mlp, padding_mask=padding_mask)
        return LayerParts(
            stream=self._stream,
            attention=partial(self._attention, attn_kwargs=attn_kwargs),
            mlp_norm=self.pre_mlp_layernorm,
            mlp=None if self.is_moe_layer else mlp,
            moe=partial(self._moe, mlp) if self.is_moe_layer else None,
            **self._mixing_points(),
        )

    def _stream(self, hidden: torch.Tensor, after_attention: bool):
        return _ResidualStream(self, hidden, after_attention)

    def _mixing_points(self) -> dict:
        return {}

    def _mlp_output(self, out_with_bias):
        """What the stream adds of the MLP's ``(out, bias)``: megatron's bias-dropout-add takes the pair."""
        return out_with_bias

    def _mlp(self, h: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        """h ``[S, B, H]`` (normed) -> the MLP's output, as ``_mlp_output`` gives it to the stream."""
        return self._mlp_output(self.mlp(h, padding_mask=padding_mask))

    @staticmethod
    def _moe(mlp, h: torch.Tensor):
        return mlp(h), None  # megatron's MoE layer keeps its load itself (LatentMoELayer)

    def _bias_add(self, bda, out_with_bias, residual: torch.Tensor) -> torch.Tensor:
        """megatron's bias-dropout-add of a sublayer's ``(out, bias)`` onto ``residual``, as its forward runs it."""
        with self.bias_dropout_add_exec_handler():
            return bda(self.training, self.config.bias_dropout_fusion)(out_with_bias, residual, self.hidden_dropout)

    def _attention(self, x: torch.Tensor, attn_kwargs: dict):
        """x ``[S, B, H]`` -> (the attention sublayer's output ``[S, B, H]``, its input norm included; None: the
        adapters keep the indexer loss themselves)."""
        return merged_bias(self.self_attention(self.input_layernorm(x), **attn_kwargs)), None
