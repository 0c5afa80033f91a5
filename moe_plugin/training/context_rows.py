"""The one place a packed micro-batch row is cut for context parallelism (docs/context-parallel.md): what each
backend feeds its model on this rank, and the per-document balance inputs of its slice.

Without a context the row is fed whole. With one, rank r of the context group feeds tokens ``[r T/CP, (r+1)
T/CP)``; the documents keep their global offsets (the attention layers read them from the ``ContextSlice``), the
labels stay the whole row's (``ops.losses.training_loss`` scores this rank's positions, their next labels
included), and the row's images are encoded on every rank, this slice's placeholders taking the image tokens
``image_tokens`` of the row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ..ops.context import ContextSlice
from ..ops.moe import document_weights
from ..ops.offsets import offsets_tensor

__all__ = ["RowSlice", "slice_row", "slice_documents"]


@dataclass
class RowSlice:
    """One rank's share of a packed micro-batch row ``[1, T]``.

    input_ids: ``[1, L]`` on the device (L = T without a context, ``context.length`` with one);
    labels: ``[1, T]`` the whole row's; cu_seqlens: ``[D + 1]`` the row's document offsets (global);
    local_cu_seqlens: ``[n + 1]`` the documents inside the slice, local (a document cut by a slice boundary
    counts in each); longest: the longest of those (host int); context: the slice, None without context
    parallelism; image_tokens: which of the row's image tokens this slice's placeholders take (None: all, or
    no context)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    local_cu_seqlens: torch.Tensor
    longest: int
    context: Optional[ContextSlice]
    image_tokens: Optional[slice]


def slice_row(micro_batch, layout, device, image_token_id: Optional[int]) -> RowSlice:
    """``micro_batch`` (``training.data.pipeline`` batch: ``input_ids``, ``labels`` ``[1, T]``, ``cu_seqlens``)
    cut for this rank of ``layout`` (a started ``ParallelLayout``: its context group, if any); nothing is read
    from the device."""
    offsets = micro_batch.cu_seqlens.tolist()  # host ints from the data pipeline
    context = layout.context_slice(micro_batch.input_ids.shape[1], offsets)
    cu = offsets_tensor(offsets, device)  # carries its host copy: the layers read nothing
    ids, labels = micro_batch.input_ids.to(device), micro_batch.labels.to(device)
    if context is None:
        longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
        return RowSlice(ids, labels, cu, cu, longest, None, None)
    mine = context.local_offsets()
    image_tokens = None
    if micro_batch.pixel_patches is not None and image_token_id is not None:
        placeholders = (micro_batch.input_ids[0] == image_token_id).tolist()  # host
        before = sum(placeholders[: context.start])
        image_tokens = slice(before, before + sum(placeholders[context.start : context.end]))
    longest = max(b - a for a, b in zip(mine[:-1], mine[1:]))
    return RowSlice(context.take(ids), labels, cu, offsets_tensor(mine, device), longest, context, image_tokens)


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
