"""One rank's contiguous slice of a packed row under context parallelism, as the ops and layers see it.

A row of ``total`` tokens is cut into ``size`` equal contiguous slices; rank ``r`` holds global positions
``[start, end)`` = ``[r L, (r+1) L)`` with ``L = total / size``. Contiguous slices (not megatron's zigzag) keep
each KDA chunk's state exchange a chain over the ranks (docs/context-parallel.md).

The ops never import ``torch.distributed``: the collectives they need come in as ``gather``, a differentiable
all-gather that ``moe_plugin.parallel.context_parallel`` builds over the context group, and ``shift``, its
differentiable point-to-point (``shifted``), and ``exchange``, its differentiable all-to-all (``exchanged``, which
re-lays a slice of every head out as the whole row of some heads: ``to_heads``, ``from_heads``; or a slice's queries
as pieces of every rank's for balanced attention work: ``to_balanced``, ``from_balanced``). ``gather(x)``
takes this rank's tensor (the same shape on every rank) and returns ``[size, *x.shape]`` in rank order; its
backward sums the gradient of every rank's copy and hands each rank its own part. ``shift(x, d)`` returns rank
``r - d``'s ``x`` (zeros on the first ``d`` ranks). ``exchange(x)`` takes ``[size, ...]`` and returns
``[size, ...]`` whose part ``i`` is rank ``i``'s part ``r``.

``offsets`` are the row's packed-document boundaries in global positions (flash-linear-attention's
``cu_seqlens``, host ints, ``0 .. total``); ``(0, total)`` for a row that is one document.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch

from .offsets import offsets_tensor

Gather = Callable[[torch.Tensor], torch.Tensor]
Shift = Callable[[torch.Tensor, int], torch.Tensor]
Exchange = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ContextSlice:
    rank: int
    size: int
    total: int
    offsets: Tuple[int, ...]
    gather: Gather = field(repr=False, compare=False)
    # differentiable point-to-point over the group (``shifted``); None: taken out of ``gather``
    shift: Optional[Shift] = field(default=None, repr=False, compare=False)
    # differentiable all-to-all over the group (``exchanged``); None: taken out of ``gather``
    exchange: Optional[Exchange] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ContextSlice.size: expected a positive int, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"ContextSlice.rank: expected an int in [0, {self.size}), got {self.rank!r}")
        if not isinstance(self.total, int) or self.total <= 0 or self.total % self.size:
            raise ValueError(
                f"ContextSlice.total: the row length must be a positive multiple of the context-parallel size "
                f"{self.size}, got {self.total!r}; pad or pack rows to a multiple of it"
            )
        offsets = tuple(int(o) for o in self.offsets)
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != self.total or list(offsets) != sorted(offsets):
            raise ValueError(
                f"ContextSlice.offsets: expected non-decreasing document boundaries from 0 to {self.total}, "
                f"got {self.offsets!r}"
            )
        object.__setattr__(self, "offsets", offsets)

    @property
    def length(self) -> int:
        """Tokens on each rank, ``L``."""
        return self.total // self.size

    @property
    def start(self) -> int:
        return self.rank * self.length

    @property
    def end(self) -> int:
        return self.start + self.length

    def document_start(self, position: int) -> int:
        """Global position where the document holding global ``position`` begins."""
        return self.offsets[bisect.bisect_right(self.offsets, position) - 1]

    @property
    def continues(self) -> bool:
        """Whether this slice's first token belongs to a document that began on an earlier rank."""
        return self.document_start(self.start) < self.start

    def local_offsets(self) -> Tuple[int, ...]:
        """The document boundaries inside this slice, local (``0 .. L``): a document cut by the slice's start
        or end counts as a document of the slice."""
        inside = [o - self.start for o in self.offsets if self.start < o < self.end]
        return tuple([0, *inside, self.length])

    def local_cu_seqlens(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``local_offsets`` as ``cu_seqlens`` ``[N + 1]`` int64 (with its host copy: ``ops.offsets``)."""
        return offsets_tensor(self.local_offsets(), device)

    def global_cu_seqlens(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``offsets`` as ``cu_seqlens`` ``[D + 1]`` int64 (with its host copy: ``ops.offsets``)."""
        return offsets_tensor(self.offsets, device)

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's ``x`` (this rank's slice along ``dim``) joined in order along ``dim``: the whole row (a view
        of the gathered ``[size, *x.shape]`` where its layout allows, as with a batch of one along dim 1)."""
        dim = dim % x.dim()
        return self.gather(x).movedim(0, dim).flatten(dim, dim + 1)

    def shifted(self, x: torch.Tensor, distance: int) -> torch.Tensor:
        """Rank ``rank - distance``'s ``x`` (the same shape on every rank; zeros where there is no such rank; a
        negative ``distance`` reads a later rank), every
        rank sending its own to ``rank + distance``. Collective: every rank calls it with the same ``distance``.
        Its backward sends each gradient back. With the group's point-to-point ``shift`` this holds one peer's
        tensor, not ``size`` of them; without it, it is read out of ``gather``."""
        if self.shift is not None:
            return self.shift(x, distance)
        gathered = self.gather(x)
        source = self.rank - distance
        return gathered[source] if 0 <= source < self.size else join_backward(torch.zeros_like(x), gathered)

    def exchanged(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[size, ...]`` (part ``j`` for rank ``j``) -> ``[size, ...]`` whose part ``i`` is what rank ``i``
        sent this rank. Collective; its backward sends each gradient back. With the group's all-to-all
        ``exchange`` this holds one tensor of ``x``'s size; without it, it is read out of ``gather``."""
        if x.shape[0] != self.size:
            raise ValueError(f"exchanged: expected {self.size} parts along dim 0, got shape {tuple(x.shape)}")
        if self.exchange is not None:
            return self.exchange(x)
        return self.gather(x)[:, self.rank]

    def to_heads(self, *parts: torch.Tensor) -> torch.Tensor:
        """This rank's slice of every head, ``parts`` ``[B, L, H, D_i]`` each -> the whole row of this rank's
        ``H / size`` heads (heads ``r H/size .. (r+1) H/size``), the parts joined along the last dim: ``[B, total,
        H / size, sum D_i]``. One all-to-all (head-parallel attention, docs/context-parallel.md); the parts are
        joined straight into the exchange's layout (one copy)."""
        B, L, H, _ = parts[0].shape
        if H % self.size:
            raise ValueError(f"to_heads: {H} heads do not divide over {self.size} context ranks")
        heads = H // self.size
        # [size, B, L, H/size, D_i] views: part j of the exchange goes to rank j
        views = [p.reshape(B, L, self.size, heads, p.shape[-1]).permute(2, 0, 1, 3, 4) for p in parts]
        got = self.exchanged(torch.cat(views, dim=-1))  # [size, B, L, H/size, D]: rank i's tokens
        return got.permute(1, 0, 2, 3, 4).reshape(B, self.size * L, heads, got.shape[-1])

    def from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``to_heads``'s inverse: the whole row of this rank's heads ``[B, total, H / size, D]`` -> this rank's
        slice of every head ``[B, L, H, D]``."""
        B, T, heads, D = x.shape
        if T != self.total:
            raise ValueError(f"from_heads: expected the row's {self.total} positions, got shape {tuple(x.shape)}")
        parts = x.reshape(B, self.size, self.length, heads, D).permute(1, 0, 2, 3, 4)  # part j: rank j's tokens
        return self.exchanged(parts).permute(1, 2, 0, 3, 4).reshape(B, self.length, self.size * heads, D)

    @property
    def balanced(self) -> bool:
        """Whether attention can re-lay the queries out for balanced work (``to_balanced``): several ranks and
        slices that cut into ``size`` equal pieces (the row a multiple of ``size**2``)."""
        return self.size > 1 and self.length % self.size == 0

    def _piece_for(self, source: int, destination: int) -> int:
        """Which piece of rank ``source``'s slice rank ``destination`` attends: piece ``destination`` of an
        even rank's, piece ``size - 1 - destination`` of an odd rank's."""
        return destination if source % 2 == 0 else self.size - 1 - destination

    def balanced_runs(self) -> Tuple[Tuple[int, int, int], ...]:
        """This rank's queries after ``to_balanced``, as runs ``(first, end, global position of the first)``: one
        piece of ``length / size`` tokens from each rank, in rank order."""
        n = self.length // self.size
        return tuple(
            (j * n, (j + 1) * n, j * self.length + self._piece_for(j, self.rank) * n) for j in range(self.size)
        )

    def to_balanced(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``[B, L, ...]`` -> the queries it attends for balanced work ``[B, L, ...]``
        (``balanced_runs``): each slice is cut into ``size`` pieces and piece ``i`` of rank ``j`` goes to rank ``i``
        (``j`` even) or ``size - 1 - i`` (``j`` odd), so that every rank gets one piece from each rank and the sum
        of its pieces' positions, which causal attention's work follows, is the same on every rank. One
        all-to-all of equal parts (``exchanged``)."""
        B, L = x.shape[:2]
        n = L // self.size
        pieces = x.reshape(B, self.size, n, *x.shape[2:])
        order = [self._piece_for(self.rank, r) for r in range(self.size)]  # part r: the piece rank r attends
        got = self.exchanged(pieces[:, order].movedim(1, 0))  # [size, B, n, ...]: part j from rank j
        return got.movedim(0, 1).reshape(x.shape)

    def from_balanced(self, y: torch.Tensor) -> torch.Tensor:
        """``to_balanced``'s inverse: the results of the queries this rank attended ``[B, L, ...]`` -> those of its
        own slice ``[B, L, ...]``. One all-to-all."""
        B, L = y.shape[:2]
        n = L // self.size
        got = self.exchanged(y.reshape(B, self.size, n, *y.shape[2:]).movedim(1, 0))  # part r: from rank r
        back = [0] * self.size
        for r in range(self.size):
            back[self._piece_for(self.rank, r)] = r
        return got[back].movedim(0, 1).reshape(y.shape)

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part ``[start, end)`` of a whole row ``x`` along ``dim``."""
        if x.shape[dim] != self.total:
            raise ValueError(f"take: expected {self.total} positions along dim {dim}, got shape {tuple(x.shape)}")
        return x.narrow(dim, self.start, self.length)


def check_context_rows(context: ContextSlice, name: str, batch: int, length: int) -> None:
    """A tensor ``name`` of ``batch`` rows of ``length`` tokens must be this rank's slice of the context's row;
    packed documents (one ``offsets`` for the row) need batch 1."""
    if length != context.length:
        raise ValueError(
            f"{name}: with a context, expected this rank's slice of {context.length} tokens "
            f"(a row of {context.total} over {context.size} ranks), got {length}"
        )
    if batch != 1 and len(context.offsets) > 2:
        raise ValueError(f"{name}: a context with packed documents needs batch size 1, got batch {batch}")


def refuse_with_context(**arguments) -> None:
    """A layer's arguments that context parallelism replaces (the documents come from ``context.offsets``;
    no cache, no padding) must be None."""
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(
                f"{name}: cannot be combined with a context (context parallelism takes the row's documents "
                f"from context.offsets, and has no cache or padding)"
            )


class _JoinBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device = gathered.shape, gathered.dtype, gathered.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def join_backward(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with ``gathered`` (a ``gather`` result this rank does not use) tied into its graph.

    The gather's backward is a collective over the context group, so every rank's backward must reach it,
    also where its result goes unused (the first rank needs no predecessor's state); it receives zeros there.
    """
    if not (torch.is_grad_enabled() and gathered.requires_grad):
        return out
    return _JoinBackward.apply(out, gathered)
