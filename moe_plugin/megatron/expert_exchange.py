"""The expert-parallel token exchange of ``LatentMoELayer``, with one host read a layer.

Each rank sorts its token copies by global expert (``ops.moe.permute``: the counts stay on the device), so the
copies bound for one rank, which holds the contiguous experts ``r * E_local ..``, are one block. Then:

1. the ``[EP, E_local]`` counts go through one equal-split all-to-all on the device: rank r learns how many
   rows each peer sends each of its experts;
2. one host read brings both split lists to the host (``tolist`` of one ``[2 * EP]`` tensor): the sizes
   ``torch.distributed.all_to_all_single`` must be given, the read issue 24 allows a layer;
3. megatron-core's ``all_to_all`` (its autograd all-to-all-v; its backward reuses the same host splits) moves
   the rows, which arrive in (source rank, local expert) blocks;
4. a stable sort on the device groups them by local expert (within one, by source rank, then token order:
   megatron's chunk sort's order), and the expert counts are the column sums of step 1's result.

The return trip undoes 4 and 3. megatron's own alltoall dispatcher sizes its permute with ``masked_select``
and its chunk sort with ``tolist`` besides the split sizes: 11 host reads a layer at EP 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings

from ..ops.moe import inverse_order

__all__ = ["ExchangePlan", "plan_exchange", "send_to_experts", "return_from_experts"]


@dataclass
class ExchangePlan:
    """One forward's exchange over ``group`` (EP ranks, ``E_local`` experts each).

    input_splits / output_splits: rows sent to / received from each rank (host ints); order: ``[M]`` int64,
    the received rows' positions grouped by local expert; tokens_per_expert: ``[E_local]`` int64 on the device.
    """

    group: dist.ProcessGroup
    input_splits: List[int]
    output_splits: List[int]
    order: torch.Tensor
    tokens_per_expert: torch.Tensor


def plan_exchange(tokens_per_expert: torch.Tensor, group: dist.ProcessGroup) -> ExchangePlan:
    """tokens_per_expert: ``[E]`` int64 this rank's copies per global expert (``permute``'s counts), E a multiple
    of the group's size. Collective over ``group``; one host read."""
    ep = dist.get_world_size(group)
    sent = tokens_per_expert.reshape(ep, -1)  # row r: this rank's copies for rank r's experts
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent.contiguous(), group=group)  # row s: what rank s sends here
    splits = torch.cat([sent.sum(1), received.sum(1)]).tolist()  # the layer's one host read
    input_splits, output_splits = splits[:ep], splits[ep:]
    experts_local = sent.shape[1]
    chunk_expert = torch.arange(ep * experts_local, device=sent.device) % experts_local
    row_expert = chunk_expert.repeat_interleave(received.reshape(-1), output_size=sum(output_splits))
    order = torch.sort(row_expert, stable=True).indices
    return ExchangePlan(group, input_splits, output_splits, order, received.sum(0))


def send_to_experts(tokens: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """tokens: ``[N * k, L]`` this rank's copies sorted by global expert -> ``[M, L]`` the rows this rank's
    experts work on, grouped by local expert (``plan.tokens_per_expert``). Differentiable."""
    received = mappings.all_to_all(plan.group, tokens, plan.output_splits, plan.input_splits)
    return received.index_select(0, plan.order)


def return_from_experts(rows: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """rows: ``[M, L]`` in ``send_to_experts``' output order -> ``[N * k, L]`` back on their tokens' rank, in
    the order ``send_to_experts`` was given. Differentiable."""
    received_order = rows.index_select(0, inverse_order(plan.order))
    return mappings.all_to_all(plan.group, received_order, plan.input_splits, plan.output_splits)
