"""Rank-side code of test_gated_dsa_context_parallel.py: GatedMLAAttention on this rank's slice of a packed row
under context parallelism, every case of one world size in one launch. Nothing here asserts; the test process
compares what comes back with ``one_process`` (also here, so both sides build the layer and the loss alike).

The backward loss of a case is ``sum(out * probe)`` plus, with the indexer loss, that loss divided by the
context size: the mean over the ranks of their local means is the whole row's loss, so the parameter
gradients summed over the ranks equal one process's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional

import torch

from moe_plugin.config import MLAConfig
from moe_plugin.layers import gated_dsa
from moe_plugin.layers.gated_dsa import GatedMLAAttention
from moe_plugin.ops.dsa import latent_attention as latent_ops
from moe_plugin.ops.context import ContextSlice

HIDDEN = 32
# Weights far above the layer's init std (0.02): there the attention and the index scores are nearly uniform,
# the indexer loss is ~1e-5 (a KL between near-equal distributions) and its gradients are differences of
# near-equal terms, whose fp32 rounding would dominate any comparison. At this scale both are O(0.1 .. 1).
WEIGHT_STD = 0.3
BLOCK, KEY_CHUNK = 2, 5


def config(**kw) -> MLAConfig:
    base = dict(
        hidden_size=HIDDEN,
        num_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        use_indexer=True,
        index_topk=3,
        index_n_heads=8,
        index_head_dim=8,
    )
    base.update(kw)
    return MLAConfig(**base)


def build(case: dict) -> GatedMLAAttention:
    torch.manual_seed(case.get("seed", 0))
    attn = GatedMLAAttention(config(**case["config"]))
    with torch.no_grad():
        for module in attn.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, case.get("std", WEIGHT_STD))
    attn.indexer_warmup = case.get("warmup", False)
    # the gathered path in several query blocks and chunks of expanded keys, whatever the slice
    attn.context_block_size, attn.context_key_chunk = BLOCK, KEY_CHUNK
    return attn


def row(case: dict):
    """The whole row's hidden states and the output probe of the loss, ``[1, total, HIDDEN]`` each (fp32)."""
    g = torch.Generator().manual_seed(case.get("seed", 0) + 1)
    x = torch.randn(1, case["total"], HIDDEN, generator=g)
    probe = torch.randn(1, case["total"], HIDDEN, generator=g)
    return x, probe


@contextlib.contextmanager
def recorded_topk(into: List[tuple]):
    """Record every ``indexer_topk`` result the layer computes with its queries' first position (patched where
    gated_dsa looks it up)."""
    original = gated_dsa.indexer_topk

    def record(*args, **kwargs):
        out = original(*args, **kwargs)
        into.append((args[5] if len(args) > 5 else kwargs.get("query_offset", 0), out))
        return out

    gated_dsa.indexer_topk = record
    try:
        yield
    finally:
        gated_dsa.indexer_topk = original


def topk_by_position(recorded: List[tuple]) -> Optional[Dict[int, List[int]]]:
    """Global query position -> its sorted selected key positions (empty slots dropped), or None when nothing
    was selected."""
    if not recorded:
        return None
    return {
        offset + t: sorted(i for i in row.tolist() if i >= 0)
        for offset, out in recorded
        for t, row in enumerate(out[0])
    }


@contextlib.contextmanager
def counted_attention(into: List[int]):
    """Add to ``into[0]`` the FLOPs of every block the gathered path's attention forward runs: ``2 H Bq n (d_qk +
    d_v)`` for a block of Bq queries on n keys (the products over its span, whatever the mask keeps)."""
    original = latent_ops._online_block

    def count(q_blk, k_t, v_t, keys, *rest):
        H, Bq, D = q_blk.shape
        into[0] += 2 * H * Bq * (keys.hi - keys.lo) * (D + v_t.shape[-1])
        return original(q_blk, k_t, v_t, keys, *rest)

    latent_ops._online_block = count
    try:
        yield
    finally:
        latent_ops._online_block = original


def _step(attn, x, probe, case: dict, scale: float, **forward_kw) -> dict:
    x = x.detach().clone().requires_grad_(True)
    topk: List[tuple] = []
    flops = [0]
    with recorded_topk(topk), counted_attention(flops):
        result = attn(x, return_indexer_loss=case.get("loss", False), **forward_kw)
    out, kl = result if isinstance(result, tuple) else (result, None)
    total = (out * probe).sum()
    if kl is not None:
        total = total + kl * scale
    total.backward()
    grads: Dict[str, Optional[torch.Tensor]] = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in attn.named_parameters()
    }
    return {
        "out": out.detach(),
        "x_grad": x.grad.detach(),
        "grads": grads,
        "kl": None if kl is None else kl.detach(),
        "topk": topk_by_position(topk),
        "attention_flops": flops[0],
    }


def one_process(case: dict) -> dict:
    """The whole row on one process (cu_seqlens from the case's offsets)."""
    attn = build(case)
    x, probe = row(case)
    offsets = tuple(case["offsets"])
    cu = None if len(offsets) == 2 else torch.tensor(offsets, dtype=torch.int64)
    return _step(attn, x, probe, case, 1.0, cu_seqlens=cu)


def on_slice(case: dict, context: ContextSlice) -> dict:
    attn = build(case)
    x, probe = row(case)
    exchanges, exchange = [], context.exchange  # the all-to-alls head-parallel attention calls

    def counted(t):
        exchanges.append(tuple(t.shape))
        return exchange(t)

    if context.exchange is not None:
        context = dataclasses.replace(context, exchange=counted)
    widths, expand = [], attn._expand  # the keys expanded at once on the gathered path

    def recorded(latent):
        widths.append(latent.shape[1])
        return expand(latent)

    attn._expand = recorded
    got = _step(attn, context.take(x), context.take(probe), case, 1.0 / context.size, context=context)
    return {**got, "exchanges": len(exchanges), "expanded": widths, "key_chunk": attn.context_key_chunk}


def run(cases: List[dict]) -> List[dict]:
    from tests.context_cases import run_on_slices

    return run_on_slices(on_slice, cases)
