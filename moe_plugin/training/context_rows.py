"""The one place a packed micro-batch row is cut for context parallelism (docs/context-parallel.md): what each
backend feeds its model on this rank, and the per-document balance inputs of its slice.

Without a context the row is fed whole. With one, rank r of the context group feeds tokens ``[r T/CP, (r+1)
T/CP)``; the documents keep their global offsets (the attention layers read them from the ``ContextSlice``), the
labels stay the whole row's (``ops.losses.training_loss`` scores this rank's positions, their next labels
included), and the row's images are encoded on every rank, this slice's placeholders taking the image tokens
``image_tokens`` of the row."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..layers.moe import balancing
from ..ops.context import ContextSlice
from ..ops.losses import balance_terms, training_loss
from ..ops.moe import document_weights
from ..ops.offsets import offsets_tensor

__all__ = ["RowSlice", "slice_row", "slice_documents", "row_loss"]


@dataclass
class RowSlice:
    """One rank's share of a packed micro-batch row ``[1, T]``.

    input_ids: ``[1, L]`` on the device (L = T without a context, ``context.length`` with one);
    labels: ``[1, T]`` the whole row's; cu_seqlens: ``[D + 1]`` the row's document offsets (global);
    local_cu_seqlens: ``[n + 1]`` the documents inside the slice, local (a document cut by a slice boundary
    counts in each); longest: the longest of those (host int); context: the slice, None without context
    parallelism; images: the model's image arguments on the device (``{}`` without images), with
    ``image_tokens`` under a context: which of the row's image tokens this slice's placeholders take."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    local_cu_seqlens: torch.Tensor
    longest: int
    context: Optional[ContextSlice]
    images: Dict[str, object]


def slice_row(micro_batch, layout, device, image_token_id: Optional[int]) -> RowSlice:
    """``micro_batch`` (``training.data.pipeline`` batch: ``input_ids``, ``labels`` ``[1, T]``, ``cu_seqlens``,
    its images) cut for this rank of ``layout`` (a started ``ParallelLayout``: its context group, if any); nothing
    is read from the device."""
    offsets = micro_batch.cu_seqlens.tolist()  # host ints from the data pipeline
    context = layout.context_slice(micro_batch.input_ids.shape[1], offsets)
    cu = offsets_tensor(offsets, device)  # carries its host copy: the layers read nothing
    ids, labels = micro_batch.input_ids.to(device), micro_batch.labels.to(device)
    images = micro_batch.image_inputs(device)
    if context is None:
        longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
        return RowSlice(ids, labels, cu, cu, longest, None, images)
    mine = context.local_offsets()
    if images and image_token_id is not None:
        placeholders = (micro_batch.input_ids[0] == image_token_id).tolist()  # host
        before = sum(placeholders[: context.start])
        images["image_tokens"] = slice(before, before + sum(placeholders[context.start : context.end]))
    longest = max(b - a for a, b in zip(mine[:-1], mine[1:]))
    return RowSlice(context.take(ids), labels, cu, offsets_tensor(mine, device), longest, context, images)


def row_loss(
    row: RowSlice,
    forward: Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]],
    moe_layers: List,
    num_items: float,
    balance_coeff: float,
    indexer_coeff: float,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The training loss of one row slice as both backends compose it (``ops.losses.training_loss``) and its
    metrics: ``forward()`` runs the model on the slice and returns ``(logits [1, L, V], indexer KL or None)``;
    with ``balance_coeff`` above 0 the MoE layers record their per-document balance terms meanwhile
    (``layers.moe.balancing``, from ``slice_documents``)."""
    balance = (
        balancing(moe_layers, *slice_documents(row, num_items)) if balance_coeff > 0 else contextlib.nullcontext([])
    )
    with balance as layers:
        logits, indexer_kl = forward()
    terms = balance_terms([layer.pop_balance() for layer in layers])
    loss = training_loss(
        logits,
        row.labels,
        row.cu_seqlens,
        num_items,
        indexer_kl,
        indexer_coeff,
        terms,
        balance_coeff,
        context=row.context,
    )
    metrics = {}
    if indexer_kl is not None:
        metrics["indexer_kl"] = indexer_kl.detach()
    if terms is not None:
        metrics["aux_loss"] = balance_coeff * terms.detach()
    return loss, metrics


def slice_documents(
    row: RowSlice, num_items: float
) -> Tuple[torch.Tensor, torch.Tensor, Optional[Callable[[torch.Tensor], torch.Tensor]]]:
    """The balance term's inputs for ``layers.moe.balancing``: each of the slice's tokens' document ``[L]``, the
    documents' weights ``[D]`` (``ops.moe.document_weights``) and how the per-document statistics combine over
    the context ranks (None without a context). Every context rank adds the whole documents' terms, so each
    adds a ``1 / CP`` share of the weights."""
    doc_ids, weights = document_weights(row.labels, row.cu_seqlens, num_items)
    context = row.context
    if context is None:
        return doc_ids, weights, None
    return context.take(doc_ids.view(1, -1)).reshape(-1), weights / context.size, _summed_over(context)


def _summed_over(context: ContextSlice) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x`` summed over the context ranks, differentiably (the balance term's per-document statistics)."""
    return lambda x: context.gather(x).sum(0)
