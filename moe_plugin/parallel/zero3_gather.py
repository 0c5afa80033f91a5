"""ZeRO-3 partitioned parameters seen whole for a moment: ``gathered``, for the recipe trainer's backends and
the Hugging Face face's expert parallelism (``hf_expert_parallel.adapter_state``) alike."""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ..compat.deepspeed import is_zero3_param

__all__ = ["gathered"]


def gathered(params: Iterable[torch.Tensor], modifier_rank=None):
    """``deepspeed.zero.GatheredParameters`` over the ZeRO-3 partitioned ones among ``params`` (collective over
    their partition groups), a no-op context when none is partitioned."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)
