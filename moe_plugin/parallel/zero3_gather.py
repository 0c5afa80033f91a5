"""Sharded parameters seen whole for a moment: ``gathered``, for the recipe trainer's backends and the Hugging
Face face's expert parallelism (``hf_expert_parallel.adapter_state``) alike, under either engine: ZeRO-3's
partitioned parameters (DeepSpeed's ``GatheredParameters``) and FSDP2's sharded ones (``DTensor``; each
registered whole in its module for the moment, then its shard again: ``mark_sharded_owners`` records where)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, List

import torch
from torch import nn

from ..compat.deepspeed import is_zero3_param

__all__ = ["gathered", "mark_sharded_owners"]

_OWNERS = "_moe_plugin_sharded_in"  # on an FSDP2 sharded parameter: [(weakref to its module, its name there)]


def mark_sharded_owners(model: nn.Module) -> int:
    """Record on every FSDP2-sharded parameter of ``model`` (a ``DTensor``) the modules and names it is registered
    under, for ``gathered``; returns how many. Call after ``fully_shard``."""
    from torch.distributed.tensor import DTensor

    marked = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                if id(p) not in marked:
                    setattr(p, _OWNERS, [])
                    marked.add(id(p))
                getattr(p, _OWNERS).append((weakref.ref(module), name))
    return len(marked)


@contextlib.contextmanager
def _fsdp_gathered(params: List[nn.Parameter]) -> Iterator[None]:
    """Each of ``params`` (FSDP2 ``DTensor`` parameters) gathered whole (collective over its mesh, in the order
    given) and registered in its modules in its place; its shard again on exit (read-only: nothing is written
    back)."""
    swapped = []
    try:
        for p in params:
            with torch.no_grad():
                whole = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
            for module, name in getattr(p, _OWNERS):
                owner = module()
                if owner is not None:
                    owner.register_parameter(name, whole)
                    swapped.append((owner, name, p))
        yield
    finally:
        for owner, name, p in swapped:
            owner.register_parameter(name, p)


def gathered(params: Iterable[torch.Tensor], modifier_rank=None):
    """``deepspeed.zero.GatheredParameters`` over the ZeRO-3 partitioned ones among ``params`` (collective over
    their partition groups), FSDP2's sharded ones gathered whole (``_fsdp_gathered``: read-only, so
    ``modifier_rank`` must be None for them), a no-op context when none is partitioned."""
    params = list(params)
    sharded = [p for p in params if hasattr(p, _OWNERS)]
    if sharded:
        if modifier_rank is not None:
            raise ValueError("gathered: FSDP2's sharded parameters are gathered read-only; pass modifier_rank=None")
        return _fsdp_gathered(sharded)
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)
