"""Context parallelism's collectives: the differentiable all-gather the ops take through ``ContextSlice``.

Each rank of a context-parallel group holds one contiguous slice of every packed row
(``moe_plugin.ops.context``). The layers exchange only what they must (docs/context-parallel.md): KDA's
per-slice state and transition, the short convolutions' last kernel-1 inputs, MLA's compressed latent and
the indexer's keys. All of it goes through ``all_gather`` below, but KDA's states, which pass from rank to
rank through ``shift`` (a prefix scan: each rank holds one peer's pair at a time, whatever the group's size),
and head-parallel attention's queries, keys, values and outputs, which ``all_to_all`` re-lays out.

Backward of an all-gather is a reduce-scatter; gloo has none, so the gradient of the stacked copies is
all-reduced and each rank keeps its own part (the same numbers; NCCL's reduce-scatter would move less).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..ops.context import ContextSlice

__all__ = ["all_gather", "all_to_all", "shift", "context_slice"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` (same shape on every rank of ``group``) -> ``[size, *x.shape]`` in group-rank order; backward
    sums every rank's gradient of each copy and returns this rank's."""
    if dist.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group)


def _send_to(x: torch.Tensor, distance: int, group) -> torch.Tensor:
    """Send ``x`` to rank ``r + distance``, receive rank ``r - distance``'s (zeros where there is none): one
    all-to-all whose only non-empty blocks are those two, so no rank waits on a pairing of sends and receives."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    flat = x.contiguous().reshape(1, -1)
    send = [1 if peer == rank + distance else 0 for peer in range(size)]
    receive = [1 if peer == rank - distance else 0 for peer in range(size)]
    out = flat.new_empty(sum(receive), flat.shape[1])
    dist.all_to_all_single(out, flat if sum(send) else flat[:0], receive, send, group=group)
    return out.reshape(x.shape) if sum(receive) else torch.zeros_like(x)


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, distance: int, group) -> torch.Tensor:
        ctx.distance, ctx.group = distance, group
        return _send_to(x, distance, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _send_to(grad, -ctx.distance, ctx.group), None, None


def shift(x: torch.Tensor, distance: int, group=None) -> torch.Tensor:
    """Rank ``r - distance``'s ``x`` on rank ``r`` (zeros where ``r < distance``), every rank sending its own to
    ``r + distance``; backward sends each gradient back the same way. Collective over ``group``."""
    if dist.get_world_size(group) == 1:
        return torch.zeros_like(x) + 0 * x
    return _Shift.apply(x, distance, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` ``[size, ...]`` (part ``j`` for rank ``j`` of ``group``) -> ``[size, ...]`` whose part ``i`` came from
    rank ``i``; its backward is the same exchange of the gradient. Collective over ``group``."""
    if dist.get_world_size(group) == 1:
        return x.view_as(x)
    return _AllToAll.apply(x, group)


def context_slice(total: int, offsets: Optional[Sequence[int]] = None, group=None) -> ContextSlice:
    """This rank's ``ContextSlice`` of a row of ``total`` tokens with document ``offsets`` (host ints,
    ``0 .. total``; None: one document), over the context-parallel ``group`` (None: the default group)."""
    return ContextSlice(
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        total=int(total),
        offsets=tuple(offsets) if offsets is not None else (0, int(total)),
        gather=lambda x: all_gather(x, group),
        shift=lambda x, distance: shift(x, distance, group),
        exchange=lambda x: all_to_all(x, group),
    )
