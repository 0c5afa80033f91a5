"""The model faces the training loop can drive, by the name a recipe gives in ``parallel.backend``."""

from __future__ import annotations

from typing import Dict, Type

from .base import Backend

__all__ = ["Backend", "BACKENDS", "get_backend"]


def _megatron() -> Type[Backend]:
    from .megatron import MegatronBackend

    return MegatronBackend


def _hf() -> Type[Backend]:
    from .hf import HFBackend

    return HFBackend


# imported on demand: the hf backend must not pay for megatron-core's import, nor the reverse
BACKENDS: Dict[str, callable] = {"megatron": _megatron, "hf": _hf}


def get_backend(name: str) -> Type[Backend]:
    if name not in BACKENDS:
        raise ValueError(f"parallel.backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()
