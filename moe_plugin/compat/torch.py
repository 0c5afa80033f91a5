"""PyTorch (tested with 2.13.0): the one private op moe_plugin calls, ``torch._grouped_mm``.

It multiplies row blocks by their own matrices in one kernel (CUDA: bf16; CPU: fp32 and bf16). The project
wraps it once, as the custom op ``moe_plugin::grouped_mm`` (``ops/moe/grouped_mm.py``) with a fake kernel and
its own backward, so the planner runs it on ``meta`` in any dtype and ``torch.compile`` traces it.
"""

from __future__ import annotations

import torch

from ._upstream import missing

__all__ = ["TESTED_TORCH", "check", "grouped_mm_kernel", "has_grouped_mm"]

TESTED_TORCH = "2.13.0"


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_kernel(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: ``[M, K] x [G, K, N] -> [M, N]`` (row blocks ending at
    ``offs``), or ``[K, M] x [M, N] -> [G, K, N]`` (blocks of the shared ``M``)."""
    return torch._grouped_mm(a, b, offs=offs)


def check() -> None:
    """``torch._grouped_mm`` exists in the installed torch (RuntimeError naming it and the pin otherwise)."""
    if not has_grouped_mm():
        raise missing("torch", "torch", TESTED_TORCH, "torch._grouped_mm")
