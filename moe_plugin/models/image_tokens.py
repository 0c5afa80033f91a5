"""One image placeholder per image, as K3's prompts hold it, expanded to the image's tokens (docs/multimodal.md 7).

K3's chat format writes ``<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`` per image: one
placeholder id (``media_placeholder_token_id``) however many tokens the image has. This project's own processor
writes one placeholder per image token instead. ``expand_image_placeholders`` turns the first form into the
second, in the model (before its embeddings and labels are made) or in a data pipeline; a batch already in the
second form passes through unchanged. The two forms are told apart by the count: ``sum(tokens)`` placeholders are
already expanded, ``len(tokens)`` are one a image (where they coincide, every image has one token and both forms
are the same sequence).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..config import require

IGNORE = -100


def tokens_per_image(grid: torch.Tensor, merge_size: int) -> List[int]:
    """Image tokens of each image: ``h * w / merge_size**2`` for a grid ``[n, 2]`` (h, w) or ``[n, 3]`` (t, h, w;
    the frames are pooled into the same tokens)."""
    return [int(row[-2]) * int(row[-1]) // merge_size**2 for row in grid.tolist()]


def expand_image_placeholders(
    input_ids: torch.Tensor,
    image_token_id: int,
    counts: Sequence[int],
    attention_mask: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    pad_token_id: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(input_ids, attention_mask, labels, cu_seqlens) with the i-th placeholder of ``input_ids`` ``[B, T]`` (row-major
    order) repeated ``counts[i]`` times.

    Labels are ``IGNORE`` on every image token. Rows grow by different amounts, so each is padded to the longest
    with ``pad_token_id`` (labels ``IGNORE``, mask 0) on the side it was padded on (left when its mask starts with
    0); an attention mask is made when rows end up of different lengths. ``cu_seqlens`` (documents packed in one
    row, ``B == 1``) shift by the tokens added before each boundary. A placeholder count other than ``len(counts)``
    or ``sum(counts)`` raises a ValueError naming input_ids.
    """
    placeholders = input_ids == image_token_id
    found = int(placeholders.sum())
    if found == sum(counts):
        return input_ids, attention_mask, labels, cu_seqlens
    require(
        found == len(counts),
        "input_ids",
        f"hold {found} image placeholders for {len(counts)} images of {sum(counts)} tokens; give one placeholder "
        "per image (K3's <|media_pad|>) or one per image token",
    )
    batch, length = input_ids.shape
    require(cu_seqlens is None or batch == 1, "cu_seqlens", "packed documents need one row (input_ids [1, T])")
    repeats = torch.ones_like(input_ids)
    repeats[placeholders] = torch.tensor(list(counts), dtype=repeats.dtype, device=repeats.device)
    new_lengths = repeats.sum(1).tolist()
    longest = max(new_lengths)
    left = attention_mask is not None and bool((attention_mask[:, 0] == 0).any())
    rows_ids, rows_mask, rows_labels = [], [], []
    for b in range(batch):
        pad = longest - new_lengths[b]
        row_left = attention_mask is not None and left and int(attention_mask[b, 0]) == 0
        ids = input_ids[b].repeat_interleave(repeats[b])
        mask = (attention_mask[b] if attention_mask is not None else torch.ones_like(input_ids[b])).repeat_interleave(
            repeats[b]
        )
        rows_ids.append(_pad(ids, pad, pad_token_id, row_left))
        rows_mask.append(_pad(mask, pad, 0, row_left))
        if labels is not None:
            lab = labels[b].repeat_interleave(repeats[b]).masked_fill(ids == image_token_id, IGNORE)
            rows_labels.append(_pad(lab, pad, IGNORE, row_left))
    new_ids = torch.stack(rows_ids)
    new_mask = torch.stack(rows_mask) if attention_mask is not None or len(set(new_lengths)) > 1 else None
    new_labels = torch.stack(rows_labels) if labels is not None else None
    if cu_seqlens is not None:
        added = torch.nn.functional.pad((repeats[0] - 1).cumsum(0), (1, 0))  # tokens added before each position
        cu_seqlens = cu_seqlens + added.to(cu_seqlens.device)[cu_seqlens.long()].to(cu_seqlens.dtype)
    return new_ids, new_mask, new_labels, cu_seqlens


def _pad(row: torch.Tensor, count: int, value: int, left: bool) -> torch.Tensor:
    if not count:
        return row
    filler = row.new_full((count,), value)
    return torch.cat([filler, row] if left else [row, filler])
