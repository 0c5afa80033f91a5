"""Which keys a query may see: causality (with a query offset for cached decoding), packed sequences and,
optionally, a per-key mask (keys at padded positions of a left-padded batch are never seen).

Query ``t`` of a call sits at absolute position ``query_offset + t``; key ``s`` at position ``s``. With
``cu_seqlens`` (flash-linear-attention's packed layout, batch 1) a key is visible only to queries of the same
packed sequence; the boundaries are given over key positions ``0 .. S``.

Host reads (issue 24): none without ``cu_seqlens``; with it the boundaries are read once per cu_seqlens
tensor (``ops.offsets.host_offsets`` keeps the host copy on the tensor, so the layers of one step share one
read) to skip the keys of earlier sequences block by block; the masks are built on the device.

``remember_visible`` / ``recall_visible``: ``indexer_topk`` leaves on its result what it knew of its queries'
visible keys (host ints), so that ``sparse_attention`` on that result can bound each block's keys without
reading the indices.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..checks import check_cu_seqlens, check_tensor


def check_positions(
    query_offset: int, batch: int, num_queries: int, num_keys: int, cu_seqlens: Optional[torch.Tensor]
) -> None:
    """Validate ``query_offset`` and cu_seqlens: ``[N+1]`` int offsets, 0 .. ``num_keys``, over the key positions."""
    if not isinstance(query_offset, int) or query_offset < 0:
        raise ValueError(f"query_offset: expected a non-negative int, got {query_offset!r}")
    check_cu_seqlens(cu_seqlens, batch, num_keys)
    if cu_seqlens is not None and query_offset + num_queries > num_keys:
        raise ValueError(
            f"query_offset: with cu_seqlens the queries' positions (query_offset + T = "
            f"{query_offset + num_queries}) must lie inside the keys' 0 .. {num_keys}"
        )


def key_segments(cu_seqlens: Optional[torch.Tensor], num_keys: int, device) -> Optional[torch.Tensor]:
    """Packed-sequence id of every key position, ``[S]`` int64; ``None`` without ``cu_seqlens``."""
    if cu_seqlens is None:
        return None
    positions = torch.arange(num_keys, device=device)
    return torch.bucketize(positions, cu_seqlens[1:].to(device=device, dtype=torch.int64), right=True)


@dataclass(frozen=True)
class VisibleKeys:
    """Host ints that bound the keys of every query row of an index tensor: query ``t`` sits at
    ``query_offset + t`` and sees keys of ``0 .. num_keys`` only from its own sequence (``starts``, or one
    sequence), never later ones. ``version``: the tensor's version counter when this was true."""

    query_offset: int
    num_keys: int
    starts: Optional[List[int]]
    version: int

    def span(self, t0: int, t1: int) -> Tuple[int, int]:
        """``visible_range`` of queries ``t0 .. t1-1``."""
        return visible_range(t0, t1, self.num_keys, self.query_offset, self.starts)


_VISIBLE = "_moe_plugin_visible_keys"


def remember_visible(
    indices: torch.Tensor, query_offset: int, num_keys: int, starts: Optional[List[int]]
) -> torch.Tensor:
    """Mark ``indices`` ``[B, T, k]`` (key positions, ``-1`` empty) as holding, for each query ``t``, only keys
    ``visible_range`` allows it; returns ``indices``."""
    setattr(indices, _VISIBLE, VisibleKeys(query_offset, num_keys, starts, indices._version))
    return indices


def recall_visible(indices: torch.Tensor, num_keys: int) -> Optional[VisibleKeys]:
    """What ``remember_visible`` left on ``indices``, if it still holds: same tensor, not changed in place since,
    the same number of keys. ``None`` otherwise (then the caller finds its bounds from the values)."""
    seen = getattr(indices, _VISIBLE, None)
    if seen is None or seen.version != indices._version or seen.num_keys != num_keys:
        return None
    return seen


def visible_range(t0: int, t1: int, num_keys: int, query_offset: int, starts: Optional[List[int]]) -> Tuple[int, int]:
    """Smallest key span ``[lo, hi)`` holding every key visible to queries ``t0 .. t1-1`` (may be empty);
    starts: ``host_offsets(cu_seqlens)``. Host ints only: reads nothing."""
    hi = min(num_keys, query_offset + t1)
    lo = 0
    if starts is not None:  # keys before the first query's own sequence are hidden from the whole block
        lo = min(hi, starts[bisect.bisect_right(starts, query_offset + t0) - 1])
    return lo, hi


def visible_mask(
    t0: int, t1: int, lo: int, hi: int, query_offset: int, segments: Optional[torch.Tensor], device
) -> torch.Tensor:
    """``[t1-t0, hi-lo]`` bool: may query ``t`` (``t0 <= t < t1``) see key ``s`` (``lo <= s < hi``)?"""
    q_pos = torch.arange(t0, t1, device=device) + query_offset
    k_pos = torch.arange(lo, hi, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if segments is not None:
        mask &= segments[lo:hi][None, :] == segments[q_pos][:, None]
    return mask


def visible_keys(
    T: int, S: int, query_offset: int, cu_seqlens: Optional[torch.Tensor], key_mask: Optional[torch.Tensor], device
) -> torch.Tensor:
    """``[T, S]`` (or ``[B, T, S]`` with key_mask ``[B, S]``) bool over a whole sequence: may query ``t`` see key
    ``s`` (causal, same packed sequence, and not padding)?"""
    mask = visible_mask(0, T, 0, S, query_offset, key_segments(cu_seqlens, S, device), device)
    return mask if key_mask is None else mask & key_mask[:, None, :]


def check_key_mask(key_mask: Optional[torch.Tensor], batch: int, num_keys: int) -> None:
    """key_mask: ``None`` or ``[batch, num_keys]`` bool, True = a real key that may be seen."""
    if key_mask is not None:
        check_tensor("key_mask", key_mask, shape=(batch, num_keys))
        if key_mask.dtype != torch.bool:
            raise ValueError(f"key_mask: expected a bool tensor (True = a real key), got dtype {key_mask.dtype}")
