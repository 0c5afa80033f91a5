"""PyTorch (tested with 2.13.0): the private parts of torch moe_plugin reaches.

- ``torch._grouped_mm`` multiplies row blocks by their own matrices in one kernel (CUDA: bf16; CPU: fp32 and
  bf16). The project wraps it once, as the custom op ``moe_plugin::grouped_mm`` (``ops/moe/grouped_mm.py``)
  with a fake kernel and its own backward, so the planner runs it on ``meta`` in any dtype and
  ``torch.compile`` traces it.
- ``call_op_in_mode``: the dispatcher's boxed call of an op (``torch._C._dispatch_call_boxed`` on the
  ``OpOverload``'s handle), so that a ``TorchFunctionMode`` sees the torch calls inside the Python kernels of
  the project's custom ops (the host-read counter, ``training/metrics/host_reads.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._upstream import missing

__all__ = ["TESTED_TORCH", "call_op_in_mode", "check", "custom_op_namespace", "grouped_mm_kernel", "has_grouped_mm"]

TESTED_TORCH = "2.13.0"


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_kernel(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: ``[M, K] x [G, K, N] -> [M, N]`` (row blocks ending at
    ``offs``), or ``[K, M] x [M, N] -> [G, K, N]`` (blocks of the shared ``M``)."""
    return torch._grouped_mm(a, b, offs=offs)


def custom_op_namespace(func) -> Optional[str]:
    """The namespace of ``func`` when it is an op of the dispatcher (``torch.ops.<namespace>.<name>.<overload>``,
    what a ``torch.library.custom_op`` call reaches a ``TorchFunctionMode`` as); None for anything else."""
    return func.namespace if isinstance(func, torch._ops.OpOverload) else None


def call_op_in_mode(mode, func, args, kwargs):
    """Call the op ``func`` (an ``OpOverload``) with the ``TorchFunctionMode`` ``mode`` active inside it.

    A mode's ``__torch_function__`` runs with the mode popped, so the torch calls of a Python kernel the
    dispatcher runs for ``func`` (a custom op's eager implementation, its autograd) would go unseen; calling
    ``func`` again would only re-enter ``__torch_function__``. The dispatcher's boxed call enters the op
    without that check, with the mode pushed back for its kernels."""
    with mode:
        return torch._C._dispatch_call_boxed(func._handle, *args, **kwargs)


def check() -> None:
    """``torch._grouped_mm`` and ``torch._C._dispatch_call_boxed`` exist in the installed torch (RuntimeError
    naming the missing one and the pin otherwise)."""
    if not has_grouped_mm():
        raise missing("torch", "torch", TESTED_TORCH, "torch._grouped_mm")
    if not hasattr(torch._C, "_dispatch_call_boxed"):
        raise missing("torch", "torch", TESTED_TORCH, "torch._C._dispatch_call_boxed")
