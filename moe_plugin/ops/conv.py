"""Short causal depthwise convolution (KDA's q/k/v conv, docs/architecture.md 2.1) with state carry and packing."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from moe_plugin.ops.checks import check_cu_seqlens, check_same_dtype, check_tensor
from moe_plugin.ops.context import ContextSlice, check_context_rows, join_backward
from moe_plugin.ops.offsets import host_offsets, offsets_tensor

ACTIVATIONS = (None, "silu")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """y[t, c] = act(bias[c] + sum_w weight[c, w] x[t - (W-1) + w, c]), inputs before a sequence's start
    taken from ``initial_state`` (zeros when None).

    Args:
        x: ``[B, T, C]``; weight: ``[C, W]``; bias: ``[C]``; activation: "silu" or None.
        initial_state: ``[N, C, W-1]``, the last W-1 inputs before each sequence (oldest first); N = B, or
            the number of packed sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences in a batch of one; the window restarts at each.
            A tensor (read once, ``ops.offsets``) or host ints: the op needs them on the host only.
    Returns:
        y ``[B, T, C]`` and, if asked, the final state ``[N, C, W-1]`` (the last W-1 inputs of each sequence,
        reaching into the initial state for sequences shorter than W-1).
    """
    check_tensor("x", x, ndim=3, floating=True)
    B, T, C = x.shape
    check_tensor("weight", weight, shape=(C, None), floating=True)
    W = weight.shape[1]
    if bias is not None:
        check_tensor("bias", bias, shape=(C,), floating=True)
    check_same_dtype(x=x, weight=weight, bias=bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    offsets = _host_offsets(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(N, C, W - 1), floating=True)
        initial_state = initial_state.to(x.dtype)

    def tail(rows: int, seq: Optional[int] = None) -> torch.Tensor:  # [rows, W-1, C]
        if initial_state is None:
            return x.new_zeros(rows, W - 1, C)
        state = initial_state if seq is None else initial_state[seq : seq + 1]
        return state.transpose(1, 2)

    if offsets is None:
        ext = torch.cat([tail(B), x], dim=1)  # [B, W-1+T, C]
        ends = None
    else:
        # Each packed sequence gets its own W-1 history in front, so no window crosses a boundary: token t of
        # sequence s sits at t + (s+1)(W-1) of the extended row, s's history at the W-1 places before its start.
        # The places are made on the host at once (one copy over), not as a piece per sequence: a packed row of
        # thousands of documents would cost thousands of small ops.
        starts, history = torch.tensor(offsets[:-1]), torch.arange(W - 1)
        seq_of = torch.repeat_interleave(torch.arange(N), torch.tensor(offsets[1:]) - starts)  # [T]
        at = (torch.arange(T) + (seq_of + 1) * (W - 1)).to(x.device)
        # W-1 more zeros in front, so that output j is the window ending at place j and `at` picks the outputs
        # too (one index tensor kept for the backward, not two); written in place, as index_copy would keep x
        ext = x.new_zeros(1, (W - 1) + T + N * (W - 1), C)
        row = ext[:, W - 1 :]  # [1, T + N(W-1), C]
        row[:, at] = x
        if initial_state is not None:
            before = (starts + torch.arange(N) * (W - 1))[:, None] + history  # [N, W-1]
            row[:, before.reshape(-1).to(x.device)] = initial_state.transpose(1, 2).reshape(1, -1, C)
        ends = torch.tensor(offsets[1:]) + (torch.arange(N) + 1) * (W - 1)  # [N]: one past each sequence's last

    length = ext.shape[1] - (W - 1)
    y = sum(ext[:, w : w + length] * weight[:, w] for w in range(W))
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = F.silu(y)
    final = None
    if ends is not None:
        y = y.index_select(1, at)
        if output_final_state:
            last = (ends[:, None] - (W - 1) + history).reshape(-1).to(x.device)  # [N (W-1)]
            final = row.index_select(1, last).view(N, W - 1, C).transpose(1, 2)
    elif output_final_state:
        final = ext[:, ext.shape[1] - (W - 1) :].transpose(1, 2)
    return y, (final.contiguous() if final is not None else None)


def _host_offsets(cu_seqlens, batch: int, total: int) -> Optional[List[int]]:
    """cu_seqlens (a tensor, checked by ``check_cu_seqlens``, or host ints, checked here: free) as host ints."""
    if cu_seqlens is None or torch.is_tensor(cu_seqlens):
        check_cu_seqlens(cu_seqlens, batch, total)
        return host_offsets(cu_seqlens)
    offsets = [int(o) for o in cu_seqlens]
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got batch {batch}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total or offsets != sorted(offsets):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to the sequence length {total}, got {offsets}"
        )
    return offsets


def causal_conv1d_context(
    x: torch.Tensor,
    weight: torch.Tensor,
    context: ContextSlice,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """``causal_conv1d`` of the whole row under context parallelism, this rank's part ``[B, L, C]`` of it.

    x: this rank's slice ``[B, L, C]`` (B 1 when the row packs several documents); weight ``[C, W]``.
    The W-1 inputs before the slice come from the predecessors in one all-gather of every rank's last
    ``min(W-1, L)`` inputs (``[B, min(W-1, L), C]``, whatever the row's length); those before the start of the
    slice's first document are zeros, as on one process. Documents come from ``context.offsets``: no host read.
    """
    check_tensor("x", x, ndim=3, floating=True)
    B, T, C = x.shape
    check_context_rows(context, "x", B, T)
    check_tensor("weight", weight, shape=(C, None), floating=True)
    history = weight.shape[1] - 1
    local = context.local_offsets()
    cu_seqlens = offsets_tensor(local, x.device) if len(local) > 2 else None
    if history == 0:
        return causal_conv1d(x, weight, bias, activation, cu_seqlens=cu_seqlens)[0]
    tails = context.gather(x[:, T - min(history, T) :])  # [size, B, min(W-1, L), C]
    if not context.continues:
        return join_backward(causal_conv1d(x, weight, bias, activation, cu_seqlens=cu_seqlens)[0], tails)
    before = torch.cat(tails[: context.rank].unbind(0), dim=1)[:, -history:]  # the inputs up to the slice
    # only the document's own inputs: the ones before its start (or before the row) are zeros
    own = min(history, context.start - context.document_start(context.start), before.shape[1])
    before = torch.cat([x.new_zeros(B, history - own, C), before[:, before.shape[1] - own :]], dim=1)
    state = before.transpose(1, 2)  # [B, C, W-1]
    if cu_seqlens is not None:  # the first local document continues; the others start from zeros
        state = torch.cat([state, state.new_zeros(len(local) - 2, C, history)])
    return causal_conv1d(x, weight, bias, activation, initial_state=state, cu_seqlens=cu_seqlens)[0]
