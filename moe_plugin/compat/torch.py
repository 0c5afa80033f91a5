"""PyTorch (tested with 2.13.0): the private parts of torch moe_plugin reaches.

- ``torch._grouped_mm`` multiplies row blocks by their own matrices in one kernel (CUDA: bf16; CPU: fp32 and
  bf16). The project wraps it once, as the custom op ``moe_plugin::grouped_mm`` (``ops/moe/grouped_mm.py``)
  with a fake kernel and its own backward, so the planner runs it on ``meta`` in any dtype and
  ``torch.compile`` traces it.
- ``call_op_in_mode``: the dispatcher's boxed call of an op (``torch._C._dispatch_call_boxed`` on the
  ``OpOverload``'s handle), so that a ``TorchFunctionMode`` sees the torch calls inside the Python kernels of
  the project's custom ops (the host-read counter, ``training/metrics/host_reads.py``).
- ``fused_attention``: ``scaled_dot_product_attention``, but on ``meta`` the CPU's fused op
  (``aten._scaled_dot_product_flash_attention_for_cpu``): SDPA's dispatch takes the math path for meta tensors,
  which saves the ``L x L`` probabilities that the fused kernel a CPU or GPU runs never keeps, so the planner
  would count memory no device spends.
- ``makes_fresh_tensors``: reads an op's schema (``OpOverload._schema``) to tell the ops whose results are new
  tensors of their own (no argument written, no result a view of one) from the rest, so the planner's meter may
  reuse a meta result's shapes for the same op on the same shapes (``plan/saved_bytes.py``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ._upstream import missing

__all__ = [
    "TESTED_TORCH",
    "call_op_in_mode",
    "check",
    "custom_op_namespace",
    "fused_attention",
    "grouped_mm_kernel",
    "has_grouped_mm",
    "makes_fresh_tensors",
]

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


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention, q, k ``[B, H, L, D]``, v ``[B, H, L, Dv]`` -> ``[B, H, L, Dv]``: SDPA's fused
    kernel on a CPU or GPU; on meta the CPU's fused op, which saves what a fused kernel saves (q, k, v, the
    output and the log-sum-exp ``[B, H, L]``; module docstring)."""
    if q.is_meta:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
    return F.scaled_dot_product_attention(q, k, v)


@functools.lru_cache(maxsize=None)
def makes_fresh_tensors(func) -> bool:
    """True when the op ``func`` (an ``OpOverload``) writes none of its arguments, returns only tensors
    (``Tensor`` each, no list), none a view of an argument, and its results' shapes do not depend on its
    values: on meta such an op's results follow from its arguments' shapes, strides and dtypes alone."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    schema = func._schema
    if schema.is_mutable or not schema.returns:
        return False
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return False
    return all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)


def check() -> None:
    """``torch._grouped_mm``, ``torch._C._dispatch_call_boxed`` and the CPU's fused attention op exist in the
    installed torch (RuntimeError naming the missing one and the pin otherwise)."""
    if not has_grouped_mm():
        raise missing("torch", "torch", TESTED_TORCH, "torch._grouped_mm")
    if not hasattr(torch._C, "_dispatch_call_boxed"):
        raise missing("torch", "torch", TESTED_TORCH, "torch._C._dispatch_call_boxed")
    if not hasattr(torch.ops.aten.mm.default, "_schema") or not hasattr(torch.ops.aten.mm.default._schema, "returns"):
        raise missing("torch", "torch", TESTED_TORCH, "OpOverload._schema.returns")
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        raise missing("torch", "torch", TESTED_TORCH, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")
