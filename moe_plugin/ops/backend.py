"""The one place that chooses between a GPU kernel and the plain torch path.

Kernels are chosen by the tensors' device, never by what happens to be importable: transformers'
kimi_linear picks flash-linear-attention's Triton kernel for CPU tensors whenever fla is installed and
then fails (docs/cpu.md). Here a Triton kernel is used only when every tensor is on CUDA
*and* the kernel imports.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable, Optional

import torch

# Set MOE_PLUGIN_DISABLE_KERNELS=1 to force the torch paths everywhere (for A/B checks on a GPU).
_DISABLE_ENV = "MOE_PLUGIN_DISABLE_KERNELS"


@functools.lru_cache(maxsize=None)
def _import_attr(module: str, attr: str) -> Optional[Callable[..., Any]]:
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:  # ImportError, or triton failing to find a driver at import time
        return None


def on_cuda(*tensors: Optional[torch.Tensor]) -> bool:
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.is_cuda for t in present)


def gpu_kernel(module: str, attr: str, *tensors: Optional[torch.Tensor]) -> Optional[Callable[..., Any]]:
    """Return ``module.attr`` when the tensors live on CUDA and it imports; otherwise ``None``."""
    if os.environ.get(_DISABLE_ENV) == "1" or not on_cuda(*tensors):
        return None
    return _import_attr(module, attr)
