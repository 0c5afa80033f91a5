"""Argument checks shared by the ops: each failure is a ValueError naming the argument and what was expected.

Shape and dtype checks read no device values and always run. Value checks (ids in range, packed offsets) read
the device, which on a GPU waits for the stream: ``check_ids_in_debug`` and ``check_cu_seqlens`` do them only
with ``MOE_PLUGIN_DEBUG_CHECKS=1`` (``ops/debug.py``; issue 24). ``check_ids`` always checks the range, for
callers outside the hot path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .debug import debug_checks


def check_tensor(
    name: str,
    x: torch.Tensor,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    floating: bool = False,
) -> None:
    """Check ``x``'s rank, its sizes (``None`` entries are free) and, optionally, that it is floating point."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions{_fmt(shape)}, got shape {tuple(x.shape)}")
    if shape is not None:
        for want, got in zip(shape, x.shape):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {_fmt(shape, bare=True)}, got {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Tensors of any shapes, passed by name (``None`` ignored), must share one dtype."""
    dtypes = {k: v.dtype for k, v in tensors.items() if v is not None}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in dtypes.items())
        raise ValueError(f"dtype mismatch: {listed}; cast them to one dtype")


def check_id_dtype(name: str, ids: torch.Tensor) -> None:
    """``ids`` must be an int32/int64 tensor (reads no values)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32/int64 tensor, got {ids.dtype}")


def check_ids(name: str, ids: torch.Tensor, low: int, high: int, what: str = "ids") -> None:
    """``ids`` (any shape) must be an int32/int64 tensor with every entry in ``[low, high)`` (an ``aminmax``
    read on the host, always: see ``check_ids_in_debug`` for the hot path). A meta tensor has no values: only
    its dtype is checked (the planner runs the layers on meta)."""
    check_id_dtype(name, ids)
    if ids.numel() and not ids.is_meta:
        lo, hi = (int(m) for m in torch.aminmax(ids))
        if lo < low or hi >= high:
            raise ValueError(f"{name}: expected {what} in [{low}, {high}), got values in [{lo}, {hi}]")


def check_ids_in_debug(name: str, ids: torch.Tensor, low: int, high: int, what: str = "ids") -> None:
    """The dtype always; the range of ``check_ids`` only with ``MOE_PLUGIN_DEBUG_CHECKS=1`` (no host read in the
    hot path). Unchecked, an out-of-range id fails later (an index error) or not at all, not with this message."""
    if debug_checks():
        check_ids(name, ids, low, high, what)
    else:
        check_id_dtype(name, ids)


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], batch: int, total: int) -> None:
    """cu_seqlens: ``[N+1]`` int32/int64 offsets of N packed sequences (flash-linear-attention's convention);
    needs batch 1 and must run 0 .. total, non-decreasing. The rank, dtype and batch always; the values (host
    reads) only with ``MOE_PLUGIN_DEBUG_CHECKS=1``."""
    if cu_seqlens is None:
        return
    check_tensor("cu_seqlens", cu_seqlens, ndim=1)
    check_id_dtype("cu_seqlens", cu_seqlens)
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got batch {batch}")
    if cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected offsets from 0 to the sequence length {total}, got {cu_seqlens.numel()} offset(s)"
        )
    if not debug_checks():
        return
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"cu_seqlens: expected offsets from 0 to the sequence length {total}, got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens: offsets must be non-decreasing, got {cu_seqlens.tolist()}")


def _fmt(shape, bare: bool = False) -> str:
    if shape is None:
        return ""
    text = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    return text if bare else f" {text}"
