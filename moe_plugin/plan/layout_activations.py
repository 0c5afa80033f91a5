"""``activations_of``: one model's ``layout -> ActivationPlan``, measured on meta once per distinct shape and
cached, for the planner's layouts (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from .activations import plan_activations
from .checkpointing import plan_checkpointed
from .context_parallel import with_kda_exchange
from .memory import Layout
from .vision import vision_activation_bytes

__all__ = ["activations_of"]


def activations_of(mc, lora_section, cache: dict, documents: Optional[List[int]], shared: dict):
    """``layout -> ActivationPlan`` for this model, run on meta at the layout's micro-batch and sizes (the
    vision encoder's on the layout's pictures). ``cache`` is this model's; ``shared`` holds the layer forwards,
    keyed by what each layer is built from, so a model that differs only in its experts (the knob's other
    expert format) reuses its dense layers."""
    import torch

    # the cache is shared by recipes of one model; hashed once here, not at every lookup
    documents_key = (len(documents), hash(tuple(documents))) if documents else None

    def of(layout: Layout):
        # plan_memory asks once per layout it plans (the knobs, the device-count search): the activations do
        # not depend on the device count, ZeRO or checkpointing, so each distinct shape is planned once
        shape = (
            "activations",
            layout.micro_batch,
            layout.seq_len,
            layout.ep,
            layout.capacity,
            layout.precision_bytes,
            layout.kernels,
            layout.images,
            layout.image_size,
            documents_key,
            layout.checkpointing,
            layout.context,
            _linear(layout),
        )
        if shape not in cache:
            cache[shape] = _activations(layout)
        return cache[shape]

    def _activations(layout: Layout):
        dtype = torch.bfloat16 if layout.precision_bytes == 2 else torch.float32
        cp = layout.context
        # one rank's slice of each row; under CP the trainer runs KDA's torch chunk path (its exchange needs the
        # chunk transitions, docs/context-parallel.md), so the GPU kernel is not planned there
        tokens, kernels = layout.seq_len // cp, ("cpu" if cp > 1 else layout.kernels)
        act = plan_activations(
            mc,
            lora_section,
            layout.micro_batch,
            tokens,
            mc.moe.num_experts // layout.ep,
            layout.capacity,
            dtype,
            shared,
            documents,
            kernels,
            cp,
            _linear(layout),
        )
        if layout.checkpointing != "off":  # what the mode keeps, from the layers' own rule (plan/checkpointing.py)
            act = replace(
                act,
                checkpointed=plan_checkpointed(
                    mc,
                    lora_section,
                    layout.micro_batch,
                    tokens,
                    mc.moe.num_experts // layout.ep,
                    layout.capacity,
                    dtype,
                    shared,
                    documents,
                    kernels,
                    layout.checkpointing,
                    cp,
                    _linear(layout),
                ),
            )
        act = with_kda_exchange(act, mc, cp, layout.precision_bytes)
        if not layout.images:
            return act
        key = ("vision", layout.images, layout.image_size, dtype, repr(lora_section))
        if key not in cache:
            cache[key] = vision_activation_bytes(mc.vision, lora_section, layout.images, layout.image_size, dtype)
        saved, working, _ = cache[key]
        return replace(act, by_segment={**act.by_segment, "vision": saved}, vision_working=working)

    return of


def _linear(layout: Layout) -> str:
    """Which ``F.linear`` the layout's run trains with: ``"zero3"``, DeepSpeed's, which saves every input
    (``compat.deepspeed.linear_as_trained``), under ZeRO-3 with ``memory_efficient_linear`` on (DeepSpeed's
    default): ``zero.Init`` puts it in place, both around a checkpoint's build and when the engine partitions a
    preset built whole; else ``"torch"``."""
    return "zero3" if layout.zero3 and layout.zero.get("memory_efficient_linear", True) else "torch"
