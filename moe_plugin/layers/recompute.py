"""Activation checkpointing of a decoder layer: one rule, read by every face of the model and by the planner.

A mode (the recipe's ``schedule.activation_checkpointing``) names the regions of a layer whose saved tensors
are dropped after the forward and recomputed in the backward (``RECOMPUTED``); everything else is kept.
What no mode recomputes is the routing: the router's scores, top-k ids and weights are computed once, outside
every region, and the recompute reuses them. So the router runs once per layer per forward whatever the mode,
the expert-load and balance records see each token once, and a recompute can never pick other experts than the
forward did (ties, bf16). Every mode but ``"full_routing"`` also keeps the dispatch layout and the dispatched
tokens, so the expert-parallel all-to-all is never run again in the backward.

* ``"off"``: nothing is recomputed.
* ``"selective"``: each layer keeps its input, its attention's and MLP's inputs, the router's choices and the
  dispatched tokens; the norms (the Attention-Residual mixes' too), the attention internals (KDA's chunk
  intermediates, MLA's up-projections and softmax, the DSA indexer's scores), the routed experts' GLU and
  the combine, the latent norm and up-projection and the shared experts are recomputed.
* ``"full"``: each layer keeps only its input and the routing (its MoE input, which the router reads, and the
  dispatched tokens): a layer is split into [everything before the router] -> route (kept) -> dispatch (kept)
  -> [experts + combine] -> [latent norm, up-projection, shared experts]; a dense layer is one region.
* ``"full_routing"``: as ``"full"``, but the MoE keeps only its input and its routing decision (top-k ids and
  weights, and under expert parallelism the exchange's counts and split sizes): [everything before the router]
  -> route (kept) -> [the dispatch, the experts, the combine, the latent norm and up-projection, the shared
  experts]. The backward sorts and sends the tokens again (the all-to-alls run twice; the counts' exchange and
  its host read do not), so the dispatched tokens (``N x top_k`` rows a layer) are never held between forward
  and backward. The routing is the forward's, so the gradients are bitwise those of ``"full"``.

Regions are ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the autograd graph is the one
the forward built (so gradients are bitwise those of ``"off"`` where the recomputed ops are deterministic),
parameters are reached through their modules again (ZeRO-3 gathers them in the recompute; a frozen base
recomputes correctly from DeepSpeed 0.19.3, setup.cfg pins a later one), and no input needs ``requires_grad``.
A layer holds its mode in ``recompute_mode``; ``set_recompute`` sets it on a whole model.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, FrozenSet, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "MODES",
    "REGIONS",
    "RECOMPUTED",
    "KEPT",
    "check_mode",
    "recomputed",
    "read_stream",
    "set_recompute",
    "is_recomputing",
]

MODES = ("off", "selective", "full", "full_routing")

# every region a layer may recompute, and what is in it
REGIONS: Dict[str, str] = {
    "attention": "the input norm and the attention (KDA chunk intermediates, MLA up-projections and softmax, "
    "DSA indexer scores)",
    "attn_res_mix": "an Attention-Residual mixing point (its candidates' fp32 stack, RMSNorm, softmax)",
    "mlp_norm": "the post-attention norm (the MoE's input)",
    "dense_mlp": "a dense layer's post-attention norm and GLU MLP",
    "layer": "a layer up to its router (AttnRes mixes, norms, attention, the residual add); a dense layer whole",
    "experts": "the routed experts' GLU on the dispatched tokens, weighted by the router, and the local combine",
    "moe_out": "after the combine: the latent norm and up-projection, and the shared experts' GLU",
    "dispatch": "the MoE after its routing: the dispatch (and its all-to-alls), the experts, the combine, the "
    "latent norm and up-projection and the shared experts",
}

RECOMPUTED: Dict[str, FrozenSet[str]] = {
    "off": frozenset(),
    "selective": frozenset({"attn_res_mix", "attention", "mlp_norm", "dense_mlp", "experts", "moe_out"}),
    "full": frozenset({"layer", "experts", "moe_out"}),
    "full_routing": frozenset({"layer", "dispatch"}),
}

# what every mode keeps (the planner prints it beside its numbers)
KEPT: Dict[str, str] = {
    "off": "every saved tensor",
    "selective": "each layer's input, its attention's and MLP's inputs, the MoE input and the routing (scores, "
    "top-k ids and weights), the dispatched tokens",
    "full": "each layer's input, the MoE input and the routing (scores, top-k ids and weights), the dispatched tokens",
    "full_routing": "each layer's input, the MoE input and the routing (top-k ids and weights, the exchange's counts)",
}

_STATE = threading.local()


def check_mode(mode: str, field: str = "schedule.activation_checkpointing") -> str:
    """``mode`` if it is one of ``MODES``, else a one-line ValueError naming ``field``."""
    if mode not in MODES:
        raise ValueError(f"{field}: expected one of {list(MODES)}, got {mode!r}")
    return mode


def is_recomputing() -> bool:
    """True inside a region's backward recompute (a layer's side effects, e.g. a stored loss, skip it)."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def recomputed(mode: str, region: str, fn: Callable, *args, checkpoint_fn: Optional[Callable] = None, **kwargs):
    """``fn(*args, **kwargs)``, checkpointed when ``mode`` recomputes ``region`` and autograd is recording.

    checkpoint_fn: the ``torch.utils.checkpoint.checkpoint`` to use (transformers passes its own partial,
    e.g. with CPU offloading); it is called with ``use_reentrant=False`` unless it already fixes that.
    """
    if region not in RECOMPUTED[mode] or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    calls = [0]

    def run(*a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a, **kw)
        with _recomputing():
            return fn(*a, **kw)

    ckpt = checkpoint_fn or checkpoint
    fixed = getattr(ckpt, "keywords", None) or {}
    if "use_reentrant" in fixed:
        if fixed["use_reentrant"]:
            raise ValueError(
                "gradient_checkpointing_kwargs.use_reentrant: must be False (reentrant checkpointing "
                "would recompute the router and breaks ZeRO-3's frozen parameters); drop it"
            )
        return ckpt(run, *args, **kwargs)
    return ckpt(run, *args, use_reentrant=False, **kwargs)


def read_stream(mode: str, stream, point: tuple = (), checkpoint_fn: Optional[Callable] = None) -> torch.Tensor:
    """``stream.read(*point)`` (``layers.attn_res``), an Attention-Residual mix as region ``"attn_res_mix"``: its
    candidates are passed in as they are now (the stream grows after the read; a recompute must mix these)."""
    if not point:
        return stream.read()
    from .attn_res import attn_res_read

    return recomputed(mode, "attn_res_mix", attn_res_read, stream.candidates(), *point, checkpoint_fn=checkpoint_fn)


def set_recompute(module: nn.Module, mode: str, checkpoint_fn: Optional[Callable] = None) -> int:
    """Set ``mode`` on every sub-module of ``module`` that has a ``recompute_mode`` (decoder layers and MoE
    layers of both faces), with ``checkpoint_fn`` (None: torch's), and a vision tower's own switch
    (``VisionTower.gradient_checkpointing``): on when ``mode`` recomputes anything and the tower has a trainable
    parameter (a frozen tower records no graph, so there is nothing to recompute). Returns the number of layers
    set."""
    from .vision import VisionTower  # the tower keeps its own switch (whole blocks, no routing in it)

    check_mode(mode)
    count = 0
    for m in module.modules():
        if hasattr(m, "recompute_mode"):
            m.recompute_mode = mode
            m.recompute_checkpoint_fn = checkpoint_fn
            count += 1
        elif isinstance(m, VisionTower):
            m.gradient_checkpointing = mode != "off" and any(p.requires_grad for p in m.parameters())
    return count
