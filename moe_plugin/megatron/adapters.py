"""Thin adapters that let megatron-core's ``TransformerLayer`` / ``TransformerBlock`` build and call the
single-device layers of ``moe_plugin.layers``.

Each adapter *is* the single-device module (a subclass, so parameter names and the math stay in one place)
with megatron's constructor and call conventions added:

* constructors take megatron's keyword arguments (``config: TransformerConfig``, ``layer_number``,
  ``pg_collection``, ``hidden_size``/``eps`` for norms) next to our config dataclass from the spec's params;
* attention is called sequence-first, ``hidden_states [S, B, H]``, with megatron's keyword arguments, and
  returns megatron's ``(output [S, B, H], bias=None)``; our layers work on ``[B, T, D]``;
* packed sequences arrive as ``PackedSeqParams`` (``qkv_format="thd"``, batch 1); ``cu_seqlens_q`` becomes our
  ``cu_seqlens``. Under context parallelism they arrive as ``ContextPackedSeqParams``, whose ``context``
  (``ops.context.ContextSlice``: this rank's slice of the row and its documents) the attention layers take
  instead (docs/context-parallel.md).

The MoE MLP is ``moe_plugin.megatron.latent_moe.LatentMoELayer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import KDAConfig, MLAConfig, require
from ..layers.gated_dsa import GatedMLAAttention
from ..layers.kda import KDAAttention
from ..layers.mlp import GLUMLP
from ..layers.norm import RMSNorm
from ..layers.recompute import is_recomputing
from ..ops.context import ContextSlice

__all__ = [
    "ContextPackedSeqParams",
    "MegatronRMSNorm",
    "KDASelfAttention",
    "GatedDSASelfAttention",
    "DenseMLP",
    "packed_cu_seqlens",
    "indexer_loss_of",
]


@dataclass
class ContextPackedSeqParams(PackedSeqParams):
    """megatron's packed-sequence description of this rank's slice (``cu_seqlens_q``: the slice's local
    document boundaries) plus the ``ContextSlice`` the attention layers exchange over."""

    context: Optional[ContextSlice] = None


def packed_cu_seqlens(packed_seq_params: Optional[PackedSeqParams], batch: int) -> Optional[torch.Tensor]:
    """megatron's packed-sequence description -> our ``cu_seqlens [N+1]`` (None when not packed).

    Packed rows are batch 1 in both conventions. Padded packing (``cu_seqlens_q_padded`` differing from
    ``cu_seqlens_q``, megatron's layout for context parallelism) is refused: our layers have no notion of
    padding inside a document.
    """
    if packed_seq_params is None:
        return None
    p = packed_seq_params
    require(
        p.qkv_format in (None, "thd"),
        "packed_seq_params.qkv_format",
        f"must be 'thd' (packed tokens), got {p.qkv_format!r}",
    )
    require(p.cu_seqlens_q is not None, "packed_seq_params.cu_seqlens_q", "must be set for packed sequences")
    require(batch == 1, "packed_seq_params", f"packed sequences need batch size 1, got {batch}")
    padded = p.cu_seqlens_q_padded
    require(
        # the same tensor (as the trainer passes it) needs no comparison: torch.equal is a host read
        padded is None or padded is p.cu_seqlens_q or torch.equal(padded.to(p.cu_seqlens_q), p.cu_seqlens_q),
        "packed_seq_params.cu_seqlens_q_padded",
        "padded packing is not supported (must equal cu_seqlens_q)",
    )
    if p.cu_seqlens_kv is not None and p.cu_seqlens_kv is not p.cu_seqlens_q:
        require(
            torch.equal(p.cu_seqlens_kv.to(p.cu_seqlens_q), p.cu_seqlens_q),
            "packed_seq_params.cu_seqlens_kv",
            "must equal cu_seqlens_q (self-attention)",
        )
    return p.cu_seqlens_q.long()


def _check_hidden(config: TransformerConfig, hidden_size: int, what: str) -> None:
    require(
        config.hidden_size == hidden_size,
        "TransformerConfig.hidden_size",
        f"must equal {what}.hidden_size ({hidden_size}), got {config.hidden_size}",
    )


class MegatronRMSNorm(RMSNorm):
    """Our RMSNorm, built as megatron builds norms: ``(config=, hidden_size=, eps=)``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps)


class _SequenceFirstAttention:
    """Mixin: megatron's self-attention call on top of a ``[B, T, D] -> [B, T, D]`` layer's forward."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        inference_context: Any = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **unused: Any,
    ):
        """hidden_states ``[S, B, H]`` -> ``(out [S, B, H], None)``.

        ``attention_mask`` is ignored: the layers are causal by construction (and per document with
        ``packed_seq_params``). Rotary arguments are ignored: the model has no position embedding.
        """
        require(
            inference_context is None,
            "inference_context",
            "megatron inference contexts are not supported; decode with the Hugging Face model's cache",
        )
        x = hidden_states.transpose(0, 1)
        context = getattr(packed_seq_params, "context", None)
        if context is not None:  # the slice's documents come from the context, with their global offsets
            return self._attend(x, None, context).transpose(0, 1), None
        cu_seqlens = packed_cu_seqlens(packed_seq_params, x.shape[0])
        out = self._attend(x, cu_seqlens)
        return out.transpose(0, 1), None

    def _attend(
        self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], context: Optional[ContextSlice] = None
    ) -> torch.Tensor:
        """The single-device layer's forward on ``x [B, T, D]`` (this rank's slice ``[1, L, D]`` with a context)."""
        if context is not None:
            return super().forward(x, context=context)
        return super().forward(x, cu_seqlens=cu_seqlens)


class KDASelfAttention(_SequenceFirstAttention, KDAAttention):
    """``self_attention`` of a KDA layer: ``KDAAttention`` with megatron's calling convention."""

    def __init__(
        self,
        config: TransformerConfig,
        kda: KDAConfig,
        layer_number: Optional[int] = None,
        pg_collection: Any = None,
        **unused: Any,
    ):
        _check_hidden(config, kda.hidden_size, "KDAConfig")
        super().__init__(kda)
        self.layer_number = layer_number


class GatedDSASelfAttention(_SequenceFirstAttention, GatedMLAAttention):
    """``self_attention`` of a Gated DSA (gated MLA + lightning indexer) layer.

    The indexer's KL loss (``GatedMLAAttention``'s, the only signal that trains the indexer) has no place in
    megatron's ``(out, bias)``: with ``indexer_loss`` (the spec's param) a training forward whose indexer has
    a trainable parameter (full training, or LoRA on it) keeps it in ``indexer_loss``; the trainer's loss
    takes it with ``pop_indexer_loss`` and adds ``indexer_loss_coeff`` times the mean over layers, as the
    Hugging Face model does. The indexer's inputs are detached, so the term reaches the indexer only.
    """

    def __init__(
        self,
        config: TransformerConfig,
        mla: MLAConfig,
        layer_number: Optional[int] = None,
        pg_collection: Any = None,
        indexer_loss: bool = False,
        **unused: Any,
    ):
        _check_hidden(config, mla.hidden_size, "MLAConfig")
        super().__init__(mla)
        self.layer_number = layer_number
        self.compute_indexer_loss = bool(indexer_loss)
        self.indexer_loss: Optional[torch.Tensor] = None

    def wants_indexer_loss(self) -> bool:
        return (
            self.compute_indexer_loss
            and self.training
            and self.indexer is not None
            and any(p.requires_grad for p in self.indexer.parameters())
        )

    def _attend(
        self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], context: Optional[ContextSlice] = None
    ) -> torch.Tensor:
        where = {"cu_seqlens": cu_seqlens} if context is None else {"context": context}
        if not self.wants_indexer_loss():
            self.indexer_loss = None
            return GatedMLAAttention.forward(self, x, **where)
        out, loss = GatedMLAAttention.forward(self, x, return_indexer_loss=True, **where)
        if not is_recomputing():  # a backward's recompute (layers.recompute) redoes it; the loss was taken already
            self.indexer_loss = loss
        return out

    def pop_indexer_loss(self) -> Optional[torch.Tensor]:
        """The scalar KL of the last training forward (None if it computed none), cleared."""
        loss, self.indexer_loss = self.indexer_loss, None
        return loss


def indexer_loss_of(model) -> Optional[torch.Tensor]:
    """Mean of the Gated DSA layers' popped indexer losses of the last forward of megatron ``model``
    (a ``GPTModel``), None when none computed one. Pops every layer's, so each forward is counted once."""
    losses = [m.pop_indexer_loss() for m in model.modules() if isinstance(m, GatedDSASelfAttention)]
    losses = [loss for loss in losses if loss is not None]
    return torch.stack(losses).mean() if losses else None


class DenseMLP(GLUMLP):
    """``mlp`` of the first ``first_k_dense`` layers: ``GLUMLP`` returning megatron's ``(out, None)``."""

    def __init__(
        self,
        config: TransformerConfig,
        intermediate_size: int,
        activation: str = "situ",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        **unused: Any,
    ):
        super().__init__(config.hidden_size, intermediate_size, activation, situ_beta, situ_linear_beta)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, **unused: Any):
        """hidden_states ``[S, B, H]`` -> ``(out [S, B, H], None)`` (token-wise, so the layout does not matter)."""
        return super().forward(hidden_states), None
