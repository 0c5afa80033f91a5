"""The one place that chooses between a GPU kernel and the plain torch path.

Kernels are chosen by the tensors' device, never by what happens to be importable: transformers'
kimi_linear picks flash-linear-attention's Triton kernel for CPU tensors whenever fla is installed and
then fails (docs/cpu.md). Here a Triton kernel is used only when every tensor is on CUDA
*and* the kernel imports.

CUDA tensors whose kernel does not import are not silent: the first time, a warning names the kernel and the
pinned version (``moe_plugin.compat.fla``), since the torch path is 35-90x slower; with
``MOE_PLUGIN_REQUIRE_KERNELS=1`` that is a RuntimeError instead. CPU tensors never warn: the torch path is
the intended one there. ``MOE_PLUGIN_DISABLE_KERNELS=1`` (the torch path on purpose) says nothing either.

The planner measures the model on ``meta`` (docs/planner.md). Meta tensors take the torch path, as the CPU
runs it, unless the planner asks for the GPU's memory with ``planning_for("cuda")``: then a kernel's meta
stand-in (``META_KERNELS``, in the kernel's compat module, saving what the kernel saves) runs in its place.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

import torch

from ..compat import fla

# Set MOE_PLUGIN_DISABLE_KERNELS=1 to force the torch paths everywhere (for A/B checks on a GPU).
_DISABLE_ENV = "MOE_PLUGIN_DISABLE_KERNELS"
# Set MOE_PLUGIN_REQUIRE_KERNELS=1 to make CUDA tensors without their kernel an error, not a warning.
_REQUIRE_ENV = fla.REQUIRE_ENV
# why (module, attr) did not import, for the message; the kernels already warned about
_IMPORT_ERRORS: Dict[Tuple[str, str], str] = {}
_WARNED: Set[Tuple[str, str]] = set()
# the device the meta tensors of a planner run stand for ("cpu" or "cuda"), set by planning_for
_PLANNED_FOR: contextvars.ContextVar[str] = contextvars.ContextVar("moe_plugin_planned_for", default="cpu")
# GPU kernel (module, function) -> its meta stand-in (module, function): the kernel's saved set and working tensors
META_KERNELS: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("fla.ops.kda", "chunk_kda"): ("moe_plugin.compat.fla", "chunk_kda_on_meta"),
}


@contextlib.contextmanager
def planning_for(device: str) -> Iterator[None]:
    """Within the block, meta tensors choose as tensors on ``device`` would: ``"cpu"`` (the default) the torch
    paths, ``"cuda"`` each GPU kernel's meta stand-in (``META_KERNELS``; a kernel without one counts as its
    torch path). The planner's switch between the CPU's and the GPU's memory."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: must be 'cpu' or 'cuda', got {device!r}")
    token = _PLANNED_FOR.set(device)
    try:
        yield
    finally:
        _PLANNED_FOR.reset(token)


@functools.lru_cache(maxsize=None)
def _import_attr(module: str, attr: str) -> Optional[Callable[..., Any]]:
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as err:  # ImportError, or triton failing to find a driver at import time
        _IMPORT_ERRORS[(module, attr)] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return None


def _missing_kernel(module: str, attr: str) -> None:
    """CUDA tensors reached ``module.attr`` and it did not import: warn once, or raise under REQUIRE_KERNELS."""
    message = fla.missing_kernel_message(module, attr, _IMPORT_ERRORS.get((module, attr), ""))
    if os.environ.get(_REQUIRE_ENV) == "1":
        raise RuntimeError(message)
    if (module, attr) not in _WARNED:
        _WARNED.add((module, attr))
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def on_cuda(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether every given tensor is on CUDA (the kernels' device); the one device test of the choice."""
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.is_cuda for t in present)


def gpu_kernel(module: str, attr: str, *tensors: Optional[torch.Tensor]) -> Optional[Callable[..., Any]]:
    """Return ``module.attr`` when the tensors live on CUDA and it imports; otherwise ``None`` (the torch path).
    CUDA tensors whose kernel does not import warn once, or raise with ``MOE_PLUGIN_REQUIRE_KERNELS=1``. Meta
    tensors inside ``planning_for("cuda")`` get the kernel's meta stand-in instead (module docstring)."""
    if os.environ.get(_DISABLE_ENV) == "1":
        return None
    present = [t for t in tensors if t is not None]
    if present and all(t.is_meta for t in present) and _PLANNED_FOR.get() == "cuda":
        stand_in = META_KERNELS.get((module, attr))
        return None if stand_in is None else _import_attr(*stand_in)
    if not on_cuda(*tensors):
        return None
    kernel = _import_attr(module, attr)
    if kernel is None:
        _missing_kernel(module, attr)
    return kernel


# Packed routed experts (ops.quant, docs/packed-experts.md): format -> (module, function) of a fused dequant
# (-matmul) GPU kernel, or None for the torch decoder. None for both: no installed or pinned package ships
# one usable here. compressed-tensors 0.20.1's Triton kernels quantise and pack FP4 (cast_to_fp4,
# pack_fp4_to_uint8, quantize_and_pack_fp4) but none unpacks or multiplies; fla-core 0.6.0 has no
# quantised kernel; triton itself is only the gpu extra. A kernel written later goes in this table.
PACKED_DEQUANT_KERNELS: Dict[str, Optional[Tuple[str, str]]] = {"mxfp4": None, "int4": None}


def packed_dequant_kernel(fmt: str, *tensors: Optional[torch.Tensor]) -> Optional[Callable[..., Any]]:
    """The fused dequantisation kernel for packed ``fmt`` experts on these tensors, or None: the torch path.
    Today always None (``PACKED_DEQUANT_KERNELS``), and nothing is imported for it."""
    if fmt not in PACKED_DEQUANT_KERNELS:
        raise ValueError(f"format: unknown packed format {fmt!r}; expected one of {sorted(PACKED_DEQUANT_KERNELS)}")
    entry = PACKED_DEQUANT_KERNELS[fmt]
    return None if entry is None else gpu_kernel(*entry, *tensors)
