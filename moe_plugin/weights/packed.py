"""Names and dtypes of packed routed-expert tensors (docs/packed-experts.md), beside ``weights.names``' rules.

A packed expert stack keeps the dense stack's name for its codes (``...experts.w1``, so peft's
``target_parameters`` find it) and adds ``...experts.w1_scale``. A K3-format checkpoint stores them per expert
as compressed-tensors does: ``...experts.{e}.w1.weight_packed`` and ``...experts.{e}.w1.weight_scale`` (INT4
adds ``...weight_shape``, the logical ``[out, in]``, which the loader accepts and does not need).

Bytes are never converted: a stored tensor loads into a packed target only with the target's dtype, or with
one that holds the same bits (E8M0 scales stored as ``float8_e8m0fnu`` into uint8, INT4's bf16 scales into
the uint8 bytes a layer keeps, two a scale), reinterpreted with ``Tensor.view(dtype)``.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

__all__ = ["SCALE_SUFFIX", "PACKED_DTYPES", "is_packed_dtype", "stack_of", "is_packed_expert_stack",
           "k3_packed_names", "k3_packed_name", "bit_compatible"]

SCALE_SUFFIX = "_scale"
PACKED_DTYPES = ("uint8", "int32")  # what packed targets hold (ops.quant.formats.packed_spec)
_STACK = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>w[123])(?P<scale>_scale)?$")
# (stored dtype, target dtype) pairs with the same bits
_SAME_BITS = {("float8_e8m0fnu", "uint8"), ("bfloat16", "uint8"), ("uint8", "uint8"), ("int32", "int32")}
_ITEMSIZE = {"float8_e8m0fnu": 1, "uint8": 1, "bfloat16": 2, "int32": 4}
_SHAPE_SUFFIX = ".weight_shape"


def is_packed_dtype(dtype: Optional[str]) -> bool:
    return dtype in PACKED_DTYPES


def stack_of(name: str) -> Optional[Tuple[str, str, bool]]:
    """``...experts.w1_scale`` -> (``...experts``, "w1", True); a dense-named stack gives False; else None."""
    m = _STACK.match(name)
    return (m["prefix"], m["kind"], m["scale"] is not None) if m else None


def is_packed_expert_stack(name: str, dtype: Optional[str]) -> bool:
    """Whether the model tensor ``name`` of torch dtype name ``dtype`` is a packed stack (codes or scales)."""
    found = stack_of(name)
    return found is not None and (found[2] or is_packed_dtype(dtype))


def k3_packed_name(stacked: str, expert: int) -> str:
    """``...experts.w1`` / ``...experts.w1_scale`` and expert 5 -> ``...experts.5.w1.weight_packed`` /
    ``...experts.5.w1.weight_scale``."""
    prefix, kind, scale = stack_of(stacked)
    return f"{prefix}.{expert}.{kind}.weight_{'scale' if scale else 'packed'}"


def k3_packed_names(stacked: str, num_experts: int):
    return [k3_packed_name(stacked, e) for e in range(num_experts)]


def shape_tensor_name(packed_name: str) -> str:
    """The INT4 ``weight_shape`` beside a per-expert ``weight_packed`` name."""
    return packed_name.rsplit(".", 1)[0] + _SHAPE_SUFFIX


def viewed_shape(shape, stored: str, target: str):
    """A stored tensor's shape seen as ``target`` dtype (``Tensor.view``: the last dim scales by the widths)."""
    if not shape or (stored, target) not in _SAME_BITS:
        return tuple(shape)
    return (*shape[:-1], shape[-1] * _ITEMSIZE[stored] // _ITEMSIZE[target])


def bit_compatible(stored: str, target: str) -> bool:
    """Whether a stored tensor of dtype ``stored`` loads bit for bit into a packed target of dtype ``target``."""
    return (stored, target) in _SAME_BITS
