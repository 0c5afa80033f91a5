"""The sharding engines behind the one training loop, by the name a recipe gives in ``parallel.sharding``:
``"zero3"`` (DeepSpeed's engine, ZeRO-3 within the layout's groups: ``zero3.py``) and ``"fsdp2"`` (torch's
``fully_shard`` over the layout's data x context mesh, routed experts kept whole on their expert-parallel rank:
``fsdp2.py``).

The loop (``training/loop.py``) calls only this interface. Per optimizer step of ``A`` micro-batches::

    for each micro-batch m:
        loss = backend.loss(engine.forward, micro_batch, scale)
        engine.backward(loss, last=(m == A - 1))   # the loss / A; gradients reduced only on the last one
        norm = engine.step(last=(m == A - 1))      # the last: clip by one global norm, AdamW, schedule, zero grads

``norm`` is the global gradient norm before clipping over every trainable tensor of every rank (None on the
other micro-batches). The checkpoint's layout-free state (``trainable_state.py``) reads and writes every
trainable tensor whole through ``whole_fp32``/``set_whole``; ``save``/``load`` are the engine's own files beside
it (DeepSpeed's ``engine/``; FSDP2 has none: its checkpoint is the layout-free state alone).
"""

from __future__ import annotations

from typing import Type

from .base import Engine, adamw

__all__ = ["Engine", "ENGINES", "engine_class", "adamw"]


def _zero3() -> Type[Engine]:
    from .zero3 import DeepSpeedEngine

    return DeepSpeedEngine


def _fsdp2() -> Type[Engine]:
    from .fsdp2 import FSDP2Engine

    return FSDP2Engine


# imported on demand: an FSDP2 run does not build DeepSpeed's engine, nor the reverse
ENGINES = {"zero3": _zero3, "fsdp2": _fsdp2}


def engine_class(sharding: str) -> Type[Engine]:
    """The engine of ``parallel.sharding``."""
    if sharding not in ENGINES:
        raise ValueError(f"parallel.sharding: expected one of {sorted(ENGINES)}, got {sharding!r}")
    return ENGINES[sharding]()
