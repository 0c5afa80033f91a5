"""The expert-parallel dispatcher: the MoE layer's ``dispatch`` slot when its experts are spread over ranks.

It lives beside megatron's MoE layer, which picks it for its own expert-parallel group as megatron's layers pick
their token dispatcher (``dispatch_for``); the Hugging Face face gets the same one from outside.

``ExpertParallelDispatch`` fills the slot that ``layers.moe.TokenDispatch`` fills on one device (both faces of
the model: ``StableLatentMoE`` and megatron's ``LatentMoELayer`` run the one forward of
``layers.moe.LatentMoEMixin``; ``parallel.expert_parallel.apply_expert_parallel`` puts this dispatcher in).
Rank ``r`` of the expert-parallel group holds the experts ``ParallelLayout.experts_held`` gives it
(``expert_adapters.experts_held``): the contiguous ``[r * E_local, (r + 1) * E_local)``.

One forward, with ``chunks`` = N (the recipe's ``parallel.moe_overlap_chunks``):

1. the token copies are sorted by expert (as with one chunk), then, for N > 1, regrouped chunk-major: the local
   experts of every rank are cut into N contiguous groups, and the copies go (chunk, destination rank, expert)
   - so chunk c's send buffer is one contiguous slice, already in the per-destination blocks an all-to-all
   takes (the regrouping moves each row once, and its inverse puts the returned rows back before the combine);
2. the ``[EP, E_local]`` counts cross one equal-split all-to-all and both split lists of every chunk come to
   the host in one read (``tolist`` of ``[2 x N x EP]``): the one host read a layer (issue 24);
3. chunk 0 is sent asynchronously and the layer's side work (the shared experts: they need no exchanged
   token) runs while it travels; then for each chunk c: send chunk c + 1, wait for chunk c, run its experts,
   send its rows back, wait for chunk c - 1's return. So chunk c's experts run while chunk c + 1 is
   dispatched and chunk c - 1 combined;
4. the returned chunks are concatenated in chunk order - exactly the sorted copies' order - and combined with
   the router's weights in one ``unpermute``.

The backward mirrors it: every all-to-all is two autograd nodes (``_Issue``, ``_Wait``), so the gradient's
all-to-all is issued by ``_Wait``'s backward and waited for in ``_Issue``'s, and autograd's engine, which
runs the latest-created ready node first, runs the compute the forward put between them in the meantime.

Chunks group experts, not tokens: each expert's rows are one block in one chunk, in the same order as with
one chunk (by source rank, then token), so every expert's products and weight gradients, and the combine, are
bitwise those of N = 1; the sort and its gradient onto the tokens are N = 1's too (the regrouping only moves
rows). The costs: a chunk is as big as its experts' share of the routing, and N > 1 copies the sorted rows
twice more (out to chunk order and back), forward and backward.

Exposed communication: the seconds a rank spends blocked on a handle (forward, backward and the counts'
exchange) add up in ``waited``; ``pop_waited`` reads and resets it (the training loop logs the step's sum as
``moe/a2a_exposed_s``). A buffer written while its all-to-all is in flight is refused when the handle is
waited on (``_Pending.wait``: RuntimeError), so a schedule that reuses a buffer too early fails loudly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import require
from ..layers.moe import TokenDispatch
from ..layers.recompute import is_recomputing
from ..ops.moe import inverse_order, permute, unpermute

__all__ = ["ExpertParallelDispatch", "dispatch_for", "ExchangePlan", "plan_exchange", "chunk_bounds"]


def dispatch_for(group: Optional[dist.ProcessGroup], chunks: int = 1) -> TokenDispatch:
    """The dispatch slot of an MoE layer whose experts are spread over ``group`` (the one place that chooses):
    this device's own without a group or at size 1, the expert-parallel all-to-all in ``chunks`` overlapped
    chunks otherwise."""
    if group is None or dist.get_world_size(group) == 1:
        return TokenDispatch()
    return ExpertParallelDispatch(group, chunks)


def chunk_bounds(local_experts: int, chunks: int) -> List[int]:
    """The local-expert boundaries of ``chunks`` contiguous groups, as even as possible: ``[0, ..., E_local]``."""
    require(
        isinstance(chunks, int) and not isinstance(chunks, bool) and 1 <= chunks <= local_experts,
        "parallel.moe_overlap_chunks",
        f"must be an integer from 1 to the experts a rank holds ({local_experts}), got {chunks!r}: chunks "
        "group a rank's experts",
    )
    return [c * local_experts // chunks for c in range(chunks + 1)]


@dataclass
class ExchangePlan:
    """One forward's exchange over ``group`` (EP ranks, ``E_local`` experts each, N chunks).

    input_splits[c] / output_splits[c]: rows sent to / received from each rank in chunk c (host ints);
    send_rows[c]: chunk c's rows of the sorted copies; order[c]: ``[M_c]`` int64, chunk c's received rows'
    positions grouped by local expert; tokens_per_expert[c]: ``[E_local]`` int64 (zero outside chunk c).
    """

    group: dist.ProcessGroup
    input_splits: List[List[int]]
    output_splits: List[List[int]]
    send_rows: List[int]
    order: List[torch.Tensor]
    tokens_per_expert: List[torch.Tensor]


def sort_key(num_experts: int, ep: int, bounds: List[int], device) -> torch.Tensor:
    """``[E]`` int64: the position of global expert e in the chunk-major order (chunk, rank, local expert)."""
    local = num_experts // ep
    e = torch.arange(num_experts, device=device)
    rank, j = e // local, e % local
    key = torch.empty_like(e)
    for c in range(len(bounds) - 1):
        lo, hi = bounds[c], bounds[c + 1]
        inside = (j >= lo) & (j < hi)
        key = torch.where(inside, ep * lo + rank * (hi - lo) + (j - lo), key)
    return key


def plan_exchange(tokens_per_key: torch.Tensor, group: dist.ProcessGroup, bounds: List[int]) -> ExchangePlan:
    """tokens_per_key: ``[E]`` int64 this rank's copies per expert in ``sort_key`` order. Collective over
    ``group``; one host read."""
    ep = dist.get_world_size(group)
    local = tokens_per_key.numel() // ep
    chunks = len(bounds) - 1
    # back to [EP, E_local] in expert order: row r, this rank's copies for rank r's experts
    blocks = [tokens_per_key[ep * lo : ep * hi].view(ep, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    sent = torch.cat(blocks, 1) if chunks > 1 else blocks[0]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent.contiguous(), group=group)  # row s: what rank s sends here
    per_chunk = [(sent[:, lo:hi].sum(1), received[:, lo:hi].sum(1)) for lo, hi in zip(bounds, bounds[1:])]
    splits = torch.cat([torch.cat(pair) for pair in per_chunk]).tolist()  # the layer's one host read
    input_splits = [splits[2 * ep * c : 2 * ep * c + ep] for c in range(chunks)]
    output_splits = [splits[2 * ep * c + ep : 2 * ep * (c + 1)] for c in range(chunks)]
    order, counts = [], []
    expert = torch.arange(local, device=sent.device)
    for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        block = received[:, lo:hi]  # [EP sources, width]: rows arrive in (source, expert) blocks
        row_expert = expert[lo:hi].repeat(ep).repeat_interleave(block.reshape(-1), output_size=sum(output_splits[c]))
        order.append(torch.sort(row_expert, stable=True).indices)
        chunk_counts = torch.zeros(local, dtype=received.dtype, device=received.device)
        chunk_counts[lo:hi] = block.sum(0)
        counts.append(chunk_counts)
    return ExchangePlan(group, input_splits, output_splits, [sum(s) for s in input_splits], order, counts)


class _Pending:
    """One all-to-all in flight: its handle, the buffers it reads and writes (and their autograd versions when
    it was issued), and the dispatcher whose ``waited`` the blocked time goes to."""

    def __init__(self, handle, sent: torch.Tensor, buffer: torch.Tensor, owner: "ExpertParallelDispatch", what: str):
        self.handle, self.sent, self.buffer, self.owner, self.what = handle, sent, buffer, owner, what
        self.versions = (sent._version, buffer._version)

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        self.handle.wait()
        self.owner.waited += time.perf_counter() - start
        if (self.sent._version, self.buffer._version) != self.versions:
            raise RuntimeError(
                f"expert dispatch: the {self.what} all-to-all's buffer was written while it was in flight; a "
                "buffer may be reused only after its handle is waited on"
            )
        buffer, self.sent, self.buffer = self.buffer, None, None
        return buffer


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group, owner, what) -> _Pending:
    x = x.contiguous()
    buffer = x.new_empty(sum(out_splits), *x.shape[1:])
    handle = dist.all_to_all_single(buffer, x, out_splits, in_splits, group=group, async_op=True)
    return _Pending(handle, x, buffer, owner, what)


class _Transfer:
    """What an ``_Issue``/``_Wait`` pair shares: the split sizes, the group and the forward's and backward's
    pending all-to-alls."""

    def __init__(self, out_splits, in_splits, group, owner, what):
        self.out_splits, self.in_splits, self.group, self.owner, self.what = out_splits, in_splits, group, owner, what
        self.forward: Optional[_Pending] = None
        self.backward: Optional[_Pending] = None


class _Issue(torch.autograd.Function):
    """Forward: start the all-to-all of x and return its (still filling) receive buffer. Backward: wait for the
    gradient's all-to-all that ``_Wait``'s backward started."""

    @staticmethod
    def forward(ctx, x, transfer: _Transfer):
        ctx.transfer = transfer
        transfer.forward = _all_to_all(
            x, transfer.out_splits, transfer.in_splits, transfer.group, transfer.owner, transfer.what
        )
        return transfer.forward.buffer

    @staticmethod
    def backward(ctx, _unfilled):
        pending, ctx.transfer.backward = ctx.transfer.backward, None
        return pending.wait(), None


class _Wait(torch.autograd.Function):
    """Forward: wait for ``_Issue``'s all-to-all; its buffer is now the received rows. Backward: start the
    gradient's all-to-all (the reverse splits), which ``_Issue``'s backward waits for."""

    @staticmethod
    def forward(ctx, buffer, transfer: _Transfer):
        ctx.transfer = transfer
        pending, transfer.forward = transfer.forward, None
        return pending.wait().view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        t = ctx.transfer
        t.backward = _all_to_all(grad, t.in_splits, t.out_splits, t.group, t.owner, t.what + " (gradient)")
        # _Issue's backward ignores what it is handed (it waits for t.backward): pass the gradient itself on,
        # which has the receive buffer's shape that autograd checks, and is only read while in flight
        return grad, None


class ExpertParallelDispatch(TokenDispatch):
    """The dispatch slot over an expert-parallel ``group`` with ``chunks`` overlapped chunks (module docstring).

    The layer's experts hold ``E / group size`` experts, the ones ``ParallelLayout.experts_held`` gives this
    rank."""

    def __init__(self, group: dist.ProcessGroup, chunks: int = 1):
        self.group, self.size = group, dist.get_world_size(group)
        self.chunks = chunks
        self.waited = 0.0  # seconds blocked on this layer's all-to-alls since pop_waited
        self._kept_plans: List[ExchangePlan] = []  # forwards whose backward will run them again

    def __deepcopy__(self, memo) -> "ExpertParallelDispatch":
        # a copied layer dispatches over the same group (a process group cannot be copied)
        return ExpertParallelDispatch(self.group, self.chunks)

    def pop_waited(self) -> float:
        value, self.waited = self.waited, 0.0
        return value

    def run(
        self,
        z: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        num_experts: int,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        region: Callable,
        side: Callable[[], Optional[torch.Tensor]],
        keep_plan: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``TokenDispatch.run``'s contract: z ``[N, L]``, indices/weights ``[N, k]`` -> the combined expert
        outputs ``[N, L]`` (outside the ``region``: only the experts are in it), the ``[E]`` copies per global
        expert this rank routed, and ``side()``'s value, computed while chunk 0 travels. With ``keep_plan`` the
        exchange plan (counts, split sizes, orders) is kept for the backward's rerun of this call, which sends
        the tokens again but neither exchanges the counts nor reads the host."""
        ep = self.size
        require(
            num_experts % ep == 0,
            "parallel.expert_parallel_size",
            f"must divide the number of experts ({num_experts}), got {ep}",
        )
        bounds = chunk_bounds(num_experts // ep, self.chunks)
        key = sort_key(num_experts, ep, bounds, indices.device)
        # sorted by expert as with one chunk, so the copies' gradients reach their tokens in the same order
        z_sorted, tokens_per_expert, order = permute(z, indices, num_experts)
        tokens_per_key = torch.empty_like(tokens_per_expert).index_copy_(0, key, tokens_per_expert)
        chunk_major = None
        if len(bounds) > 2:  # the copies regrouped (chunk, rank, expert): each row moved once, no sum
            row_key = key.index_select(0, indices.reshape(-1).index_select(0, order))
            chunk_major = torch.sort(row_key, stable=True).indices
            z_sorted = z_sorted.index_select(0, chunk_major)
        if is_recomputing() and self._kept_plans:  # "full_routing"'s backward: the forward's counts and splits
            plan = self._kept_plans.pop()
        else:
            start = time.perf_counter()
            plan = plan_exchange(tokens_per_key, self.group, bounds)
            self.waited += time.perf_counter() - start  # the counts' exchange is synchronous: all of it is exposed
            if keep_plan:  # the backward recomputes this call: last kept, first recomputed
                self._kept_plans.append(plan)
        sends = z_sorted.split(plan.send_rows)
        chunks = len(sends)
        transfers = [
            _Transfer(plan.output_splits[c], plan.input_splits[c], self.group, self, f"chunk {c} dispatch")
            for c in range(chunks)
        ]
        in_flight = {0: _Issue.apply(sends[0], transfers[0])}
        side_out = side()  # needs no exchanged token: runs while chunk 0 travels
        returned: List[Optional[torch.Tensor]] = [None] * chunks
        back: dict = {}
        for c in range(chunks):
            if c + 1 < chunks:
                in_flight[c + 1] = _Issue.apply(sends[c + 1], transfers[c + 1])
            rows = _Wait.apply(in_flight.pop(c), transfers[c]).index_select(0, plan.order[c])
            out = region(experts, rows, plan.tokens_per_expert[c])
            out = out.index_select(0, inverse_order(plan.order[c]))  # back to (source rank, expert) blocks
            back_transfer = _Transfer(
                plan.input_splits[c], plan.output_splits[c], self.group, self, f"chunk {c} combine"
            )
            back[c] = (_Issue.apply(out, back_transfer), back_transfer)
            if c >= 1:
                returned[c - 1] = _Wait.apply(*back.pop(c - 1))
        returned[chunks - 1] = _Wait.apply(*back.pop(chunks - 1))
        rows_back = self.concat(returned)
        if chunk_major is not None:  # back to the copies' expert order
            rows_back = rows_back.index_select(0, inverse_order(chunk_major))
        return unpermute(rows_back, order, weights), tokens_per_expert, side_out

    def concat(self, returned: List[torch.Tensor]) -> torch.Tensor:
        """The returned chunks ``[M_c, L]`` as the sorted copies ``[N * k, L]``: chunk order is their order."""
        return torch.cat(returned) if len(returned) > 1 else returned[0]
