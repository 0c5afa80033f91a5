"""Strict loading for the model classes: a checkpoint whose tensors do not fit the config is named in one
ValueError (``check_loading_info``), and the tensors a checkpoint left unloaded are initialised without
overwriting the loaded ones (``reset_unloaded``)."""

from __future__ import annotations

import re
from typing import List

import torch
from torch import nn

from ..layers.attn_res import AttnResProjection
from ..layers.kda import KDAAttention, ShortConvolution
from ..layers.stacked_experts import StackedExperts
from ..layers.vision import VisionTower

__all__ = ["check_loading_info", "reset_unloaded", "SELF_INITIALISED"]


# The DSA indexer is optional on both sides: a checkpoint without it (K3 ships none) loads into a model with
# it (the indexer starts fresh), and a model without it loads a checkpoint that has one (dense attention).
_INDEXER = re.compile(r"\.self_attn\.indexer\.")
LISTED = 10  # tensor names shown per kind in a load error


def check_loading_info(info: dict, model_order: List[str], ignore_mismatched_sizes: bool = False) -> None:
    """Raise ValueError naming the first tensors whose names or shapes differ between checkpoint and model.

    info: transformers' loading info (``missing_keys``, ``unexpected_keys``, ``mismatched_keys`` as
    ``(name, checkpoint_shape, model_shape)``); model_order: the model's tensor names in state-dict order,
    which is the order names are listed in. Indexer tensors may be missing or extra (see ``_INDEXER``).
    """
    rank = {name: i for i, name in enumerate(model_order)}
    first = lambda name: (rank.get(name, len(rank)), name)  # noqa: E731
    problems: List[str] = []
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda item: first(item[0]))
    if mismatched and not ignore_mismatched_sizes:
        listed = ", ".join(
            f"{name} (checkpoint {tuple(ckpt)}, model {tuple(model)})" for name, ckpt, model in mismatched[:LISTED]
        )
        problems.append(f"{len(mismatched)} with other shapes: {listed}")
    missing = sorted((k for k in info.get("missing_keys") or () if not _INDEXER.search(k)), key=first)
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint: {', '.join(missing[:LISTED])}")
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not _INDEXER.search(k))
    if unexpected:
        problems.append(f"{len(unexpected)} the model does not have: {', '.join(unexpected[:LISTED])}")
    if problems:
        raise ValueError(
            "checkpoint: its tensors do not match the config; "
            + "; ".join(problems)
            + " (pass strict=False to load anyway)"
        )


# Modules whose reset_parameters() initialises their own tensors that are not plain Linear/Embedding/norm
# weights (decay parameters, convolutions, stacked experts, position table) or that must not be drawn like
# a Linear (the AttnRes projections start at zero).
SELF_INITIALISED = (AttnResProjection, KDAAttention, ShortConvolution, StackedExperts, VisionTower)


@torch.no_grad()
def reset_unloaded(module: nn.Module) -> None:
    """``module.reset_parameters()`` for the module's own tensors, keeping those transformers has loaded.

    transformers marks loaded tensors ``_is_hf_initialized`` and guards ``nn.init`` with it, but the layers'
    init also uses plain tensor ops (``log_``, ``copy_``), so loaded values are saved and put back here.
    """
    own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
    loaded = [(t, t.detach().clone()) for t in own if getattr(t, "_is_hf_initialized", False)]
    if len(loaded) == len(own):
        return
    module.reset_parameters()
    for tensor, value in loaded:
        tensor.detach().copy_(value)
