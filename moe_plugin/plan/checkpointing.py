"""Activation memory under activation checkpointing (docs/planner.md, "Activation checkpointing"): what each
decoder layer keeps in a mode, and what the backward's recompute of one region holds at once.

Both are read off the model's own layers run on ``meta`` with the mode set (``layers.recompute.set_recompute``,
the trainer's own switch), as ``activations.py`` reads the saved sets without it: the rule for what is kept is
the layers' ``RECOMPUTED`` table itself, so the planner and the trainer cannot disagree on it. A mode's kept set
is what autograd saves outside the checkpointed regions plus the regions' inputs (non-reentrant checkpointing
saves them through the same hooks); the layer's input state is left out and counted once per layer
(``layer_inputs``). The backward is run too: a layer's forward and backward on meta, its regions recomputed as the
trainer's are, give the most it holds at once beyond its input (``peaks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .activations import (
    RUN_TOKENS,
    _built_from,
    _state_shape,
    context_offsets,
    layer_kinds,
    layer_saved_bytes,
    linear_run_tokens,
    packed_boundaries,
)
from ..compat.deepspeed import linear_as_trained
from ..ops.backend import planning_for
from .routing import BalancedDispatch, kernels_device

__all__ = ["CheckpointedPlan", "plan_checkpointed"]


@dataclass
class CheckpointedPlan:
    """One micro-batch on one rank in a checkpointing ``mode``: ``layer_inputs`` the bytes of every layer's
    input state; per layer, ``kept`` what it keeps beyond that (the MoE input, the routing, the dispatched
    tokens; under ``"selective"`` also its attention's and MLP's inputs), ``peaks`` the most its forward and
    backward (its recomputes included) hold at once, what it keeps among them."""

    mode: str
    layer_inputs: float
    kept: List[float] = field(default_factory=list)
    peaks: List[float] = field(default_factory=list)


def plan_checkpointed(
    mc,
    lora_section,
    batch: int,
    seq_len: int,
    local_experts: int,
    capacity: float,
    dtype: torch.dtype,
    cache: Optional[dict],
    documents: Optional[Sequence[int]],
    kernels: str,
    mode: str,
    context: int = 1,
    linear: str = "torch",
) -> CheckpointedPlan:
    """The ``CheckpointedPlan`` of ``mc`` in ``mode`` ("selective", "full" or "full_routing"); the other arguments as
    ``activations.plan_activations`` (long micro-batches extended linearly from two runs, as there; ``context``:
    the context-parallel size, ``seq_len`` one rank's slice; ``linear``: as ``plan_activations``)."""
    cache = {} if cache is None else cache
    documents = tuple(documents) if documents else None
    args = (mc, lora_section, local_experts, capacity, dtype, cache, documents, kernels, mode, context, linear)
    if batch * seq_len <= 2 * RUN_TOKENS:
        return _measure(*args, batch, seq_len)
    t1 = linear_run_tokens(mc)
    a, b = _measure(*args, 1, t1), _measure(*args, 1, 2 * t1)
    f = (batch * seq_len - t1) / t1

    def ext(xs, ys):
        return [x + (y - x) * f for x, y in zip(xs, ys)]

    return CheckpointedPlan(
        mode, a.layer_inputs + (b.layer_inputs - a.layer_inputs) * f, ext(a.kept, b.kept), ext(a.peaks, b.peaks)
    )


def _measure(
    mc, lora_section, local_experts, capacity, dtype, cache, documents, kernels, mode, context, linear, batch, seq_len
) -> CheckpointedPlan:
    cu = packed_boundaries(batch, seq_len, documents)
    shape = (1, batch * seq_len, mc.hidden_size)
    kinds = layer_kinds(mc)
    per_kind: Dict[Tuple[str, bool], Tuple[float, float]] = {}
    with planning_for(kernels_device(kernels)), linear_as_trained(linear == "zero3"):
        for kind in dict.fromkeys(kinds):
            index = kinds.index(kind)
            routed = (_built_from(mc), local_experts, capacity) if kind[1] else _built_from(mc, routed=False)
            cp = context if kind[0] == "mla" and context > 1 else 1  # only MLA layers see the whole row
            key = ("checkpointed", mode, kind, routed, batch, seq_len, dtype, repr(lora_section), documents, kernels)
            key += (cp, linear)
            if key not in cache:
                cands = len(_state_shape(index, mc))
                run = dict(cu_seqlens=cu, mode=mode, routing=BalancedDispatch(local_experts, capacity))
                run["context"] = (cp, context_offsets(batch, seq_len, cp, documents)) if cp > 1 else None
                kept = layer_saved_bytes(mc, index, lora_section, shape, dtype, cands, **run)
                peak: list = []
                layer_saved_bytes(mc, index, lora_section, shape, dtype, cands, peak=peak, **run)
                cache[key] = float(sum(kept.values())), float(peak[0])
            per_kind[kind] = cache[key]
    plan = CheckpointedPlan(
        mode, float(batch * seq_len * mc.hidden_size * torch.empty(0, dtype=dtype).element_size() * mc.num_layers)
    )
    # every mode recomputes the AttnRes mixes (layers.recompute): what a layer keeps does not depend on its
    # number of candidates, so one layer of each kind stands for all of its kind
    for kind in kinds:
        kept, peak = per_kind[kind]
        plan.kept.append(kept)
        plan.peaks.append(peak)
    return plan
