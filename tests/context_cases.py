"""What the context-parallel tests of the layers share (tests/layers/test_gated_dsa_context_parallel.py,
tests/ops/test_kda_context_parallel.py): a one-rank context, each case run on this rank's slice, and the
refusals every attention layer owes a context."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import pytest
import torch

from moe_plugin.ops.context import ContextSlice


def alone(total: int, offsets: Optional[Sequence[int]] = None) -> ContextSlice:
    """A context of one rank (the gather is the identity): the whole row on one process."""
    offsets = tuple(offsets or (0, total))
    return ContextSlice(rank=0, size=1, total=total, offsets=offsets, gather=lambda x: x.unsqueeze(0))


def run_on_slices(on_slice: Callable[[dict, ContextSlice], dict], cases: List[dict]) -> List[dict]:
    """Rank side: each case on this rank's slice of its row, over the default group, with the slice's bounds."""
    from moe_plugin.parallel.context_parallel import context_slice

    out = []
    for case in cases:
        context = context_slice(case["total"], case["offsets"])
        out.append({"start": context.start, "end": context.end, **on_slice(case, context)})
    return out


def check_refusals(attn, hidden: int, cache) -> None:
    """An attention layer with a context refuses cu_seqlens, a cache and a token mask (naming each), a tensor that
    is not the slice, and a batch of packed documents; one document takes any batch."""
    x = torch.randn(1, 8, hidden)
    context = alone(8, (0, 3, 8))
    for name, kw in (
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 8]))),
        ("cache", dict(cache=cache)),
        ("token_mask", dict(token_mask=torch.ones(1, 8, dtype=torch.bool))),
    ):
        with pytest.raises(ValueError, match=name):
            attn(x, context=context, **kw)
    with pytest.raises(ValueError, match="hidden_states"):
        attn(x[:, :4], context=context)  # not the slice's length
    with pytest.raises(ValueError, match="batch size 1"):
        attn(torch.randn(2, 8, hidden), context=context)  # packed documents need batch 1
    assert attn(torch.randn(2, 8, hidden), context=alone(8)).shape == (2, 8, hidden)  # one document: any batch
