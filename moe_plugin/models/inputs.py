"""What goes into the model: input checks, padding <-> packing (the loss is ``ops.losses``).

Every check raises a ValueError naming the argument before any work is done.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops.checks import check_ids, check_tensor


def pack_padded(x: torch.Tensor, attention_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T, D]`` with mask ``[B, T]`` -> (``[1, N, D]`` real tokens, ``cu_seqlens [B+1]``, flat index ``[N]``)."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    first = torch.where(mask, positions, mask.shape[1]).amin(1)
    last = torch.where(mask, positions, -1).amax(1)
    if bool(((last - first + 1).clamp(min=0) != lengths).any()):
        raise ValueError("attention_mask: each row's real tokens must be contiguous (left or right padding)")
    index = mask.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int64)
    return x.reshape(-1, x.shape[-1])[index].unsqueeze(0), cu_seqlens, index


def unpack_padded(packed: torch.Tensor, index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_padded``: packed ``[1, N, D]`` real tokens and their flat index ``[N]`` into
    ``batch * length`` -> ``[batch, length, D]``, zeros at the padded positions."""
    out = packed.new_zeros(batch * length, packed.shape[-1])
    return out.index_copy(0, index, packed.squeeze(0)).view(batch, length, -1)


def left_padding_mask(attention_mask: torch.Tensor, length: int, past_length: int) -> Optional[torch.Tensor]:
    """The ``[B, length]`` bool mask (True = real) of the new tokens of a cached forward, or None if all are real.

    attention_mask: ``[B, length]`` or ``[B, past_length + length]``. With a cache, padding may only come
    before a row's real tokens in the prompt (left padding, as ``generate`` pads); the padding of earlier
    steps is remembered by the cache itself. Anything else raises a ValueError naming attention_mask.
    """
    new = attention_mask[:, -length:].bool()
    if bool(new.all()):
        return None
    if past_length:
        raise ValueError(
            "attention_mask: with a cache, padding may only be in the prompt (left padding); "
            "tokens fed after it must all be real (1)"
        )
    if bool((new[:, 1:] < new[:, :-1]).any()):
        raise ValueError(
            "attention_mask: with a cache only left padding is supported (pad before the real "
            "tokens, e.g. tokenizer(..., padding_side='left')); right padding needs use_cache=False"
        )
    return new


def check_inputs(
    input_ids: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    vocab_size: int,
    hidden_size: int,
    past_length: int = 0,
) -> Tuple[int, int]:
    """Check the model inputs before any work, each failure a ValueError naming the argument; returns (B, T).

    Exactly one of input_ids ``[B, T]`` int32/int64 in ``[0, vocab_size)`` or inputs_embeds ``[B, T, D]``
    float; attention_mask ``[B, T]``, or ``[B, past_length + T]`` (the Hugging Face form that also covers
    the tokens a cache already holds).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("input_ids/inputs_embeds: pass exactly one of them")
    if input_ids is not None:
        check_tensor("input_ids", input_ids, ndim=2)
        check_ids("input_ids", input_ids, 0, vocab_size, "token ids")  # one aminmax
        batch, length = input_ids.shape
    else:
        check_tensor("inputs_embeds", inputs_embeds, shape=(None, None, hidden_size), floating=True)
        batch, length = inputs_embeds.shape[:2]
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, ndim=2)
        if attention_mask.shape[0] != batch or attention_mask.shape[1] not in (length, past_length + length):
            raise ValueError(
                f"attention_mask: expected shape [{batch}, {length}] like the input ids"
                + (f" (or [{batch}, {past_length + length}] with the cached tokens)" if past_length else "")
                + f", got {tuple(attention_mask.shape)}"
            )
    return batch, length


def check_labels(labels: torch.Tensor, batch: int, length: int, vocab_size: int, logits_to_keep: int) -> None:
    """labels ``[B, T]`` int with entries in ``[0, vocab_size)`` or -100; ValueError naming what is wrong."""
    if logits_to_keep:
        raise ValueError(
            f"logits_to_keep: the loss needs the logits of every position, got logits_to_keep="
            f"{logits_to_keep} with labels; pass one or the other"
        )
    check_tensor("labels", labels, shape=(batch, length))
    ignored = labels == -100
    check_ids("labels", labels.masked_fill(ignored, 0), 0, vocab_size, "token ids (or -100 to ignore)")
