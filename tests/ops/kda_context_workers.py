"""Rank-side code of test_kda_context_parallel.py: the KDA op, the short convolution and the KDA layer on this
rank's slice of a row under context parallelism, every case of one world size in one launch. Nothing here
asserts; the test process compares what comes back with ``one_process`` (also here, so both sides draw the
same inputs). Each case's backward loss is ``sum(out * probe)``; the parameter gradients summed over the ranks
then equal one process's.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F

from moe_plugin.config import KDAConfig
from moe_plugin.layers.kda import KDAAttention
from moe_plugin.ops.context import ContextSlice
from moe_plugin.ops.conv import causal_conv1d, causal_conv1d_context
import moe_plugin.ops.kda.chunk as kda_chunk
from moe_plugin.ops.kda import chunk_kda
from moe_plugin.ops.kda.context_parallel import chunk_kda_context

HEADS, KEY, VALUE, HIDDEN, CHANNELS = 2, 4, 3, 16, 5


def inputs(case: dict) -> Dict[str, torch.Tensor]:
    """The whole row's inputs of the case's op (fp32), drawn from the case's seed."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, T = case.get("batch", 1), case["total"]
    if case["op"] == "kda":
        q, k = (F.normalize(torch.randn(B, T, HEADS, KEY, generator=g), dim=-1) for _ in range(2))
        return {
            "q": q,
            "k": k,
            "v": torch.randn(B, T, HEADS, VALUE, generator=g),
            # decays from about 0.5 to 1 a token, so the state carries across several slices
            "g": -0.7 * torch.rand(B, T, HEADS, KEY, generator=g),
            "beta": torch.rand(B, T, HEADS, generator=g),
            "probe": torch.randn(B, T, HEADS, VALUE, generator=g),
        }
    if case["op"] == "conv":
        return {
            "x": torch.randn(B, T, CHANNELS, generator=g),
            "weight": torch.randn(CHANNELS, case["width"], generator=g),
            "bias": torch.randn(CHANNELS, generator=g),
            "probe": torch.randn(B, T, CHANNELS, generator=g),
        }
    return {"x": torch.randn(B, T, HIDDEN, generator=g), "probe": torch.randn(B, T, HIDDEN, generator=g)}


def layer(case: dict) -> KDAAttention:
    torch.manual_seed(case.get("seed", 0))
    attn = KDAAttention(KDAConfig(hidden_size=HIDDEN, num_heads=HEADS, head_dim=KEY, chunk_size=case["chunk"]))
    with torch.no_grad():  # larger weights than the 0.02 init, so every path moves the output
        for p in attn.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return attn


def _run(case: dict, tensors: Dict[str, torch.Tensor], context=None, cu_seqlens=None) -> dict:
    """The case's op on ``tensors`` (a whole row with cu_seqlens, or a slice with its context)."""
    probe = tensors.pop("probe")
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    attn = None
    if case["op"] == "kda":
        args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
        if context is None:
            out = chunk_kda(*args, cu_seqlens=cu_seqlens, chunk_size=case["chunk"])[0]
        else:
            out = chunk_kda_context(*args, context, chunk_size=case["chunk"])
    elif case["op"] == "conv":
        x, w, b = leaves["x"], leaves["weight"], leaves["bias"]
        if context is None:
            out = causal_conv1d(x, w, b, cu_seqlens=cu_seqlens)[0]
        else:
            out = causal_conv1d_context(x, w, context, bias=b)
    else:
        attn = layer(case)
        out = attn(leaves["x"], cu_seqlens=cu_seqlens) if context is None else attn(leaves["x"], context=context)
    (out * probe).sum().backward()
    grads = {n: t.grad.detach() for n, t in leaves.items()}
    if attn is not None:
        grads.update({f"param.{n}": p.grad.detach() for n, p in attn.named_parameters()})
    return {"out": out.detach(), "grads": grads}


def one_process(case: dict) -> dict:
    """The whole row on one process, its documents as cu_seqlens."""
    offsets = tuple(case["offsets"])
    cu = None if len(offsets) == 2 else torch.tensor(offsets, dtype=torch.int64)
    return _run(case, inputs(case), cu_seqlens=cu)


# Which inputs are slices of the row (the rest, e.g. the conv's weight, are whole on every rank).
_SLICED = {"q", "k", "v", "g", "beta", "x", "probe"}


def on_slice(case: dict, context: ContextSlice) -> dict:
    sent: List[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        sent.append(x.numel() * x.element_size())
        return context.gather(x)

    def counted_shift(x: torch.Tensor, distance: int) -> torch.Tensor:
        sent.append(x.numel() * x.element_size())
        return context.shifted(x, distance)

    counting = ContextSlice(context.rank, context.size, context.total, context.offsets, counted, counted_shift)
    tensors = {n: context.take(t) if n in _SLICED else t for n, t in inputs(case).items()}
    # a case's "window": the context path's chunks per window (chunk.run_chunks), so that its slice spans
    # several; the one-process reference keeps the default
    window, kda_chunk.WINDOW_CHUNKS = kda_chunk.WINDOW_CHUNKS, case.get("window", kda_chunk.WINDOW_CHUNKS)
    try:
        return {"bytes_sent": sent, **_run(case, tensors, context=counting)}
    finally:
        kda_chunk.WINDOW_CHUNKS = window


def run(cases: List[dict]) -> List[dict]:
    from tests.context_cases import run_on_slices

    return run_on_slices(on_slice, cases)
