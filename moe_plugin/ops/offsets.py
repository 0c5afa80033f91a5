"""Packed-sequence offsets (``cu_seqlens``) as host ints, read at most once per tensor.

The ops need the offsets on the host to lay out their work (KDA's chunks, the convolution's windows, DSA's
key ranges). Reading a device tensor stalls the stream, so the host copy is kept on the tensor with its
version counter: the layers of one step share one read, and a tensor made by ``offsets_tensor`` from host
ints is never read at all.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_HOST_COPY = "_moe_plugin_host_offsets"


def host_offsets(cu_seqlens: Optional[torch.Tensor]) -> Optional[List[int]]:
    """cu_seqlens as host ints, or ``None``. Read once per tensor: the copy is kept on the tensor with its
    version counter and read again only after an in-place change."""
    if cu_seqlens is None:
        return None
    kept = getattr(cu_seqlens, _HOST_COPY, None)
    if kept is not None and kept[0] == cu_seqlens._version:
        return kept[1]
    offsets = cu_seqlens.tolist()
    setattr(cu_seqlens, _HOST_COPY, (cu_seqlens._version, offsets))
    return offsets


def offsets_tensor(offsets: Sequence[int], device=None) -> torch.Tensor:
    """``cu_seqlens`` ``[N + 1]`` int64 on ``device`` from host ints, carrying its host copy (no read later)."""
    values = [int(o) for o in offsets]
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    setattr(tensor, _HOST_COPY, (tensor._version, values))
    return tensor


def counts_tensor(counts: Sequence[int], device=None) -> torch.Tensor:
    """Tokens per expert ``[G]`` int64 on ``device`` from host ints, carrying its host copy (``host_counts``
    then reads nothing: on ``meta``, where there is nothing to read, and on a GPU)."""
    return offsets_tensor(counts, device)


def host_counts(counts: torch.Tensor) -> torch.Tensor:
    """counts ``[G]`` int as a CPU int64 tensor, for host-side grouping: a CPU tensor as it is, else its kept
    host copy (``counts_tensor``), else one read kept on the tensor for the next caller (as ``host_offsets``)."""
    if counts.device.type == "cpu":
        return counts.long()
    return torch.tensor(host_offsets(counts), dtype=torch.int64)
