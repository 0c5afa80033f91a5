"""The trainer's base loading: a recipe's resolved base streamed into the model both backends build."""

from __future__ import annotations

from torch import nn

from ..precision import apply_precision
from .loader import load_state
from .names import VISION_PREFIXES

__all__ = ["load_base", "PRECISION_NOTE"]

# where load_base leaves the loader's precision line on the model (which fp32-stored tensors were kept, which
# cast: docs/precision.md), for the trainer to print at start
PRECISION_NOTE = "base_precision_note"


def load_base(model: nn.Module, resolved, names: str) -> None:
    """Load a recipe's resolved base (``moe_plugin.recipe.resolved_model.ResolvedModel``: a Hugging Face or
    K3-layout checkpoint at ``resolved.path``) into ``model`` strictly, each rank writing only its own slices and
    ZeRO-3 partitions (a text model over an image base reads the text tensors only); a preset
    (``resolved.path`` None) keeps the weights it was initialised with from the seed. What both backends call."""
    if resolved.path is None:
        return
    apply_precision(model)  # built under zero.Init, the fp32 tensors are bf16 partitions: whole fp32 before loading
    # a text-only run of an image base builds the text model (images.wants_images): the base's vision tower is
    # no part of it, so it is left in the checkpoint (the exports copy it through); an image model reads it
    text_only = not any(n.startswith(VISION_PREFIXES) for n, _ in model.named_parameters())
    stats = load_state(
        model, resolved.path, names=names, config=resolved.model_config, strict=True, ignore_vision=text_only
    )
    if stats.precision:
        object.__setattr__(model, PRECISION_NOTE, stats.precision)  # a plain attribute, not a module or buffer
