"""The training loss, composed once for both faces: next-token cross entropy plus the DSA indexer's KL term plus
the router balance term.

The Hugging Face face (``models.modeling.MoEPluginForCausalLM.forward``) and the megatron face
(``training.backends.megatron.MegatronBackend.loss``) both call ``training_loss``; what differs between them is
only where the pieces come from, which they pass in: the logits (``lm_head`` of the HF model, megatron's
``GPTModel`` output), the indexer KL (the mean over the Gated DSA layers of ``ops.dsa.indexer_kl_loss``, collected
by ``MoEPluginModel.forward`` or ``megatron.adapters.indexer_loss_of``) and the balance terms (each MoE layer's
``pop_balance``, docs/router-balance.md). Plain torch, so the fast path is its own reference.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .context import ContextSlice

__all__ = ["balance_terms", "causal_lm_loss", "next_token_targets", "training_loss"]


def next_token_targets(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]``: what position t is scored against, ``labels[:, t + 1]``, and -100 where nothing is (each
    document's last token and the row's last position)."""
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    return targets if cu_seqlens is None else _ignore_document_ends(targets, cu_seqlens)


def _ignore_document_ends(targets: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """targets ``[1, W]`` with -100 at each packed document's last token but the final one's
    (``cu_seqlens[1:-1] - 1``) where it lies in the W columns. A boolean index of the ends in range would size
    its result by a host read; ends out of range go to a spare column instead, which is dropped."""
    ends = cu_seqlens[1:-1].to(targets.device).long() - 1
    width = targets.shape[1]
    spare = torch.where((ends >= 0) & (ends < width), ends, width)
    padded = F.pad(targets, (0, 1), value=-100)
    padded[0].index_fill_(0, spare, -100)
    return padded[:, :width]


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_items_in_batch: Optional[float] = None,
    context: Optional[ContextSlice] = None,
) -> torch.Tensor:
    """Next-token cross entropy (fp32), ignoring -100 and, for packed rows, predictions across documents.

    logits ``[B, T, V]``; labels ``[B, T]`` (the input ids, not shifted: position t is scored against label
    t+1); cu_seqlens ``[D + 1]`` (B = 1) marks packed documents, whose last token predicts nothing. Reduction:
    the mean over the scored label tokens of this batch, or, with ``num_items_in_batch`` (the step's label-token
    count over all micro-batches and the engine's averaging factors, as the Hugging Face Trainer passes it), the
    sum divided by it. Returns a scalar fp32 tensor.

    context: under context parallelism, ``logits`` ``[1, L, V]`` are this rank's slice while ``labels`` and
    ``cu_seqlens`` are the whole row's (a slice's last token is scored against the next rank's first);
    ``num_items_in_batch`` is required then, and the ranks' sums add up to the whole row's.
    """
    if context is not None:
        if num_items_in_batch is None:
            raise ValueError(
                "num_items_in_batch: required under context parallelism (each rank holds part of the row); "
                "give the step's label-token count"
            )
        targets = context.take(next_token_targets(labels, cu_seqlens))
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / num_items_in_batch
    targets = labels[:, 1:]
    if cu_seqlens is not None:
        targets = _ignore_document_ends(targets, cu_seqlens)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    if num_items_in_batch is None:
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / num_items_in_batch


def balance_terms(terms: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The MoE layers' popped balance terms (each a scalar ``sum_d w_d L_d``, or None where a layer recorded
    none) as one ``[num_moe_layers]`` tensor, or None unless every layer recorded one: a forward either balances
    all its MoE layers (training, labels, a positive coefficient) or none."""
    return torch.stack(list(terms)) if terms and all(t is not None for t in terms) else None


def training_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_items_in_batch: Optional[float] = None,
    indexer_loss: Optional[torch.Tensor] = None,
    indexer_loss_coeff: float = 0.0,
    balance: Optional[torch.Tensor] = None,
    balance_coeff: float = 0.0,
    context: Optional[ContextSlice] = None,
) -> torch.Tensor:
    """``causal_lm_loss + indexer_loss_coeff * indexer_loss + balance_coeff * balance.sum()``, a scalar fp32.

    logits ``[B, T, V]``, labels ``[B, T]`` (unshifted, -100 = not scored; padding already set to -100 by the
    caller), cu_seqlens ``[D + 1]`` and num_items_in_batch: as ``causal_lm_loss`` takes them (mean over the
    scored label tokens, or their sum over ``num_items_in_batch``). indexer_loss: scalar, the mean over the
    Gated DSA layers of each layer's ``mean_t KL(p_t || softmax(I_t))`` (``ops.dsa.indexer_kl_loss``), or None
    when no layer computed one (not training, or the indexer frozen): no term then. balance: ``[num_moe_layers]``
    (``balance_terms``), each layer's ``sum_d w_d L_d`` already weighted by the documents' scored labels over the
    same N as the token loss (``ops.moe.document_weights``), or None: no term. The terms are added in this order,
    each only when present, so a model without DSA or balancing gets the bare token loss. context: as
    ``causal_lm_loss`` takes it (the indexer and balance terms are then this rank's shares already).
    """
    loss = causal_lm_loss(logits, labels, cu_seqlens, num_items_in_batch, context)
    if indexer_loss is not None:
        loss = loss + indexer_loss_coeff * indexer_loss
    if balance is not None:
        loss = loss + balance_coeff * balance.sum()
    return loss
