"""Context parallelism in the plan (docs/planner.md, "Context parallelism"): ``parallel.context_parallel_size``
= CP ranks split every packed row into contiguous slices of ``T / CP`` tokens (docs/context-parallel.md).

What one rank holds, planned for the worst rank, the last (its queries see every earlier key of the row):

- everything token-wise (layer inputs, norms, MLPs, the MoE and its dispatch, Attention Residuals, the head)
  at the rank's ``T / CP`` tokens: the layers run on meta at that length;
- a gated MLA layer runs on meta with a ``ContextSlice`` of the row's last rank (``meta_slice``), so the
  layer's own context path decides what it holds. Head-parallel (no indexer, the heads dividing over CP):
  the whole row's queries, keys and values of ``H / CP`` heads, which its attention op saves (q, k, v, output
  and log-sum-exp), the same on every rank. Otherwise the all-gathered latent (``c_kv`` + rope key) and index
  keys of the whole row, saved by the blockwise attention (``ops.dsa.latent_attention``) with the rank's
  re-laid-out queries, its keys and values expanded a chunk at a time (never the row's);
- a KDA layer exchanges a fixed amount, whatever T is (``kda_exchange``): each rank's fp32 state and transition,
  ``H d_k (d_k + d_v)`` values, in each round of a prefix scan over the group (``ops/kda/context_parallel.py``),
  and the short convolutions' last ``W - 1`` inputs. The layer's HF face takes no context, so the bytes held for
  the backward (the rank's own transition and entering state, whatever the group's size) are added by this
  arithmetic (per layer without checkpointing, inside the recomputing layer's peak with it). Under CP the trainer
  runs KDA's torch chunk path (the exchange needs the chunk transitions), so KDA is planned on it.

ZeRO-3 shards over data x context = the world, so the weights' shares do not change with CP at a fixed world;
the ranks reading distinct rows are the world / CP data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..config import require

__all__ = [
    "check_context_parallel",
    "context_attention",
    "context_candidates",
    "kda_exchange",
    "meta_slice",
    "smallest_context",
]


def check_context_parallel(cp, devices: int, seq_len: int, field: str, devices_field: str, seq_len_field: str):
    """Refuse a context-parallel size that is not a positive int dividing the world and the row length."""
    require(
        isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1,
        field,
        f"must be a positive whole number of ranks (1: no context parallelism), got {cp!r}",
    )
    require(
        devices % cp == 0,
        field,
        f"{cp} does not divide the world size {devices} ({devices_field}); every context group is {cp} ranks: "
        f"use a divisor of {devices} or a multiple of {cp} devices",
    )
    require(
        seq_len % cp == 0,
        field,
        f"{cp} does not divide the sequence length {seq_len} ({seq_len_field}); each rank holds an equal "
        f"slice of a row: make the length a multiple of {cp} or use a divisor of {seq_len}",
    )


def kda_exchange(mc, cp: int, precision_bytes: int) -> Dict[str, float]:
    """One KDA layer's exchange on one rank in the forward: ``sent`` (its state and transition, fp32, in each of
    the prefix scan's ``log2(cp)`` rounds, then its state; its convolutions' last ``W - 1`` inputs) and ``held``
    for the backward (its own transition and entering state: the scan keeps none of the other ranks' pairs, so
    this does not grow with ``cp``), bytes."""
    k = mc.kda
    if cp <= 1:
        return {"sent": 0.0, "held": 0.0}
    state = k.num_heads * k.head_dim * k.head_dim * 4  # d_v = d_k = head_dim, fp32
    pair = 2 * state  # the transition A [K, K] beside the state b [K, V]
    rounds = (cp - 1).bit_length()  # ceil(log2(cp))
    conv = (k.conv_size - 1) * 3 * k.num_heads * k.head_dim * precision_bytes  # q, k, v convolutions
    return {"sent": float(rounds * pair + state + conv), "held": float(pair)}


class _MetaGather(torch.autograd.Function):
    """The context group's all-gather on meta: ``[size, *x.shape]`` out, this rank's part of the gradient back;
    saves nothing, as the real one."""

    @staticmethod
    def forward(ctx, x, size: int, rank: int):
        ctx.rank = rank
        return x.new_empty((size, *x.shape))

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank].clone(), None, None


class _MetaExchange(torch.autograd.Function):
    """The context group's all-to-all on meta: a tensor of ``x``'s shape each way; saves nothing, as the real one."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(grad.shape)


def meta_slice(size: int, offsets: Sequence[int]):
    """The last rank's ``ContextSlice`` of a row with global document ``offsets`` (its end is the row's)."""
    from ..ops.context import ContextSlice

    offsets = tuple(int(o) for o in offsets)
    rank = size - 1
    return ContextSlice(
        rank, size, offsets[-1], offsets, lambda x: _MetaGather.apply(x, size, rank), exchange=_MetaExchange.apply
    )


@contextlib.contextmanager
def context_attention(layer, context) -> Iterator[torch.Tensor]:
    """Run ``layer`` (a gated-MLA ``DecoderLayer``) as the trainer's context path runs it: its attention gets
    ``context`` in place of ``cu_seqlens`` (its document boundaries come from the slice); yields the slice's
    local ``cu_seqlens`` for the rest of the layer (the MoE's per-document terms)."""
    from ..layers import gated_dsa

    attn = layer.self_attn
    forward, boundaries = attn.forward, gated_dsa._context_cu_seqlens

    def with_context(h, cu_seqlens=None, cache=None, token_mask=None, inputs=None, **kwargs):
        # the rest of the layer sees the slice's own documents (inputs, cu_seqlens); the attention the slice
        return forward(h, cache=cache, token_mask=token_mask, context=context, **kwargs)

    attn.forward = with_context
    # a meta tensor has no values: the boundaries stay a host tensor, as the planner passes cu_seqlens
    gated_dsa._context_cu_seqlens = lambda ctx, device, end=None: boundaries(ctx, "cpu", end)
    try:
        yield context.local_cu_seqlens()
    finally:
        attn.forward = forward
        gated_dsa._context_cu_seqlens = boundaries


def smallest_context(
    peak_at: Callable[[int, int, str], float],
    devices: int,
    seq_len: int,
    ep: int,
    device_memory: float,
    largest_devices: int,
    modes: Sequence[str],
) -> Dict[str, object]:
    """The smallest power-of-two CP dividing ``devices`` and ``seq_len`` whose peak (``peak_at(cp, devices,
    mode)``) fits ``device_memory`` with one of the checkpointing ``modes`` (the first that fits, in their
    order); none fitting, the smallest one past ``devices`` that would, on the fewest devices it needs (a
    multiple of CP and EP). Returns ``cp`` (None: none up to ``largest_devices``), ``devices``, ``peak``,
    ``mode``, ``more_devices`` (whether it needs more than ``devices``) and ``tried`` (CP -> (peak, mode) of
    the lowest peak among the modes, in CP order: the candidates the search planned); none fitting, also
    ``floor``, the (CP, devices) of the lowest peak tried (None: nothing tried).

    A rank's peak does not grow with CP (its slice shrinks; past ``devices`` the devices grow too), so the
    candidates are bisected: the first, the last, then halves, about ``log2`` of their number planned (each is
    a set of meta runs at that slice: the plan's time), and the CP just below the answer is always among them."""
    candidates = context_candidates(devices, seq_len, ep, largest_devices)
    tried: Dict[int, Tuple[float, str]] = {}

    def fits(i: int) -> bool:
        cp, on = candidates[i]
        peaks = {mode: peak_at(cp, on, mode) for mode in modes}
        fitting = [mode for mode in modes if peaks[mode] <= device_memory]
        mode = fitting[0] if fitting else min(modes, key=peaks.__getitem__)
        tried[cp] = (peaks[mode], mode)
        return bool(fitting)

    def answer(i: Optional[int]) -> Dict[str, object]:
        in_order = dict(sorted(tried.items()))
        if i is None:
            # where the peak is lowest, for the plan to show what stops it
            lowest = min(range(len(candidates)), key=lambda j: tried.get(candidates[j][0], (math.inf,))[0])
            floor = candidates[lowest] if tried else None
            return {
                "cp": None,
                "devices": None,
                "peak": None,
                "mode": None,
                "more_devices": True,
                "tried": in_order,
                "floor": floor,
            }
        cp, on = candidates[i]
        peak, mode = tried[cp]
        return {"cp": cp, "devices": on, "peak": peak, "mode": mode, "more_devices": on != devices, "tried": in_order}

    if not candidates:
        return answer(None)
    if fits(0):
        return answer(0)
    last = len(candidates) - 1
    if last == 0 or not fits(last):
        return answer(None)
    below, above = 0, last  # candidates[below] does not fit, candidates[above] does
    while above - below > 1:
        middle = (below + above) // 2
        if fits(middle):
            above = middle
        else:
            below = middle
    return answer(above)


def context_candidates(devices: int, seq_len: int, ep: int, largest_devices: int) -> List[Tuple[int, int]]:
    """The (CP, devices) pairs the search may answer, in order: every power of two dividing ``devices`` and
    ``seq_len`` on ``devices``, then the larger ones dividing ``seq_len`` on the fewest devices each needs (a
    multiple of CP and EP), up to ``largest_devices``."""
    candidates, cp = [], 1
    while cp <= min(devices, seq_len):
        if devices % cp == 0 and seq_len % cp == 0:
            candidates.append((cp, devices))
        cp *= 2
    while cp <= seq_len and seq_len % cp == 0:
        need = math.lcm(cp, ep)
        if need > largest_devices:
            break
        candidates.append((cp, need))
        cp *= 2
    return candidates


def describe_search(found: Dict[str, object], seq_len: int, devices: int, modes: Sequence[str], memory: float) -> str:
    """The search's answer as lines of the plan's text (``modes``: the checkpointing modes it tried)."""
    gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
    named = len(modes) > 1
    tried = ", ".join(f"CP {c}: {gb(p)}" + (f" ({m})" if named else "") for c, (p, m) in found["tried"].items())
    head = (
        f"context parallelism for one {seq_len:,}-token row, checkpointing {' or '.join(modes)}, "
        f"{memory / 1e9:.0f} GB a device:"
    )
    if found["cp"] is None:
        term, size = found.get("stopped_by", ("", 0.0))
        floor = found.get("floor")
        stop = f"; at CP {floor[0]} on {floor[1]} devices the largest term is {term} ({gb(size)})" if term else ""
        return f"{head}\n  no CP fits (peak per device: {tried}){stop}"
    cp, peak, mode = found["cp"], found["peak"], found["mode"]
    where = (
        f"on {found['devices']} devices (more than the layout's {devices}; none dividing {devices} fits)"
        if found["more_devices"]
        else f"on the layout's {devices} devices"
    )
    below = [c for c in found["tried"] if c < cp]
    tail = f"; CP {below[-1]} does not fit ({gb(found['tried'][below[-1]][0])})" if below else ""
    setting = (
        f'\n  with checkpointing {mode}: set schedule.activation_checkpointing "{mode}" and '
        f"parallel.context_parallel_size {cp} in the recipe"
    )
    return (
        f"{head}\n  smallest CP that fits: {cp} {where}, {seq_len // cp:,} tokens a rank, peak {gb(peak)}{tail}"
        f"{setting}\n  peak per device: {tried}"
    )


def with_kda_exchange(act, mc, cp: int, precision_bytes: int):
    """``act`` (an ``ActivationPlan`` of one rank's slice) with every KDA layer's gathered exchange added: held
    for the backward without checkpointing (the ``"context exchange"`` segment), inside the layer's own peak
    with it (the recompute gathers again)."""
    from dataclasses import replace

    held = kda_exchange(mc, cp, precision_bytes)["held"]
    if not held:
        return act
    is_kda = [t == "kda" for t in mc.layer_types]
    per_layer = [v + (held if k else 0.0) for v, k in zip(act.per_layer, is_kda)]
    by_segment = {**act.by_segment, "context exchange": held * sum(is_kda)}
    ck = act.checkpointed
    if ck is not None:
        ck = replace(ck, peaks=[v + (held if k else 0.0) for v, k in zip(ck.peaks, is_kda)])
    return replace(act, per_layer=per_layer, by_segment=by_segment, checkpointed=ck)
