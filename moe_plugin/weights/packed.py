"""Names and dtypes of packed routed-expert tensors (docs/packed-experts.md), beside ``weights.names``' rules.

A packed expert stack keeps the dense stack's name for its codes (``...experts.w1``, so peft's
``target_parameters`` find it) and adds ``...experts.w1_scale``. A K3-format checkpoint stores them per expert
as compressed-tensors does: ``...experts.{e}.w1.weight_packed`` and ``...experts.{e}.w1.weight_scale`` (INT4
adds ``...weight_shape``, the logical ``[out, in]``, which the planner checks against the model).

The K2 family (K2-Thinking, K2.5, K2.6) names its INT4 experts as DeepSeek-V3 does:
``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight_packed`` (gate = w1, up = w3, down = w2), its
whole MoE block under ``mlp.`` rather than ``block_sparse_moe.`` (``mlp.gate.weight`` is the router,
``mlp.shared_experts.*`` the shared experts); K2.5/K2.6 put ``language_model.`` in front. ``expert_naming``
tells the two namings apart by the stored names; ``k2_block_name`` and ``packed_expert_name`` give the names
a model tensor is stored under in each.

Bytes are never converted: a stored tensor loads into a packed target only with the target's dtype, or with
one that holds the same bits (E8M0 scales stored as ``float8_e8m0fnu`` into uint8, INT4's bf16 scales into
the uint8 bytes a layer keeps, two a scale), reinterpreted with ``Tensor.view(dtype)``.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Tuple

__all__ = [
    "SCALE_SUFFIX",
    "PACKED_DTYPES",
    "EXPERT_NAMINGS",
    "K2_KINDS",
    "is_packed_dtype",
    "stack_of",
    "is_packed_expert_stack",
    "k3_packed_names",
    "k3_packed_name",
    "k2_packed_name",
    "packed_expert_name",
    "packed_expert_names",
    "is_k2_expert",
    "expert_naming",
    "k2_block_name",
    "k3_block_name",
    "shape_tensor_name",
    "logical_shape",
    "bit_compatible",
]

SCALE_SUFFIX = "_scale"
PACKED_DTYPES = ("uint8", "int32")  # what packed targets hold (ops.quant.formats.packed_spec)
_STACK = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>w[123])(?P<scale>_scale)?$")
# (stored dtype, target dtype) pairs with the same bits
_SAME_BITS = {("float8_e8m0fnu", "uint8"), ("bfloat16", "uint8"), ("uint8", "uint8"), ("int32", "int32")}
_ITEMSIZE = {"float8_e8m0fnu": 1, "uint8": 1, "bfloat16": 2, "int32": 4}
_SHAPE_SUFFIX = ".weight_shape"
EXPERT_NAMINGS = ("k3", "k2")
K2_KINDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_K2_EXPERT = re.compile(
    r"^(language_model\.)?model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\."
    r"weight_(packed|scale|shape)$"
)
_MOE_BLOCK = re.compile(r"^(?P<head>(language_model\.)?model\.layers\.\d+\.)block_sparse_moe\.")
_K2_BLOCK = re.compile(r"^(?P<head>(language_model\.)?model\.layers\.\d+\.)mlp\.")


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


def k2_packed_name(stacked: str, expert: int) -> str:
    """``model.layers.1.block_sparse_moe.experts.w1`` (or its ``_scale``) and expert 5 -> K2's
    ``model.layers.1.mlp.experts.5.gate_proj.weight_packed`` (``.weight_scale``)."""
    prefix, kind, scale = stack_of(stacked)
    return f"{k2_block_name(prefix)}.{expert}.{K2_KINDS[kind]}.weight_{'scale' if scale else 'packed'}"


def packed_expert_name(stacked: str, expert: int, naming: str = "k3") -> str:
    """The per-expert checkpoint name of expert ``expert`` of a packed stack in ``naming`` ("k3" or "k2")."""
    return (k2_packed_name if naming == "k2" else k3_packed_name)(stacked, expert)


def packed_expert_names(stacked: str, num_experts: int, naming: str = "k3"):
    return [packed_expert_name(stacked, e, naming) for e in range(num_experts)]


def is_k2_expert(name: str) -> bool:
    """Whether a checkpoint name is a K2-family packed expert tensor (``...mlp.experts.{E}.gate_proj.weight_packed``,
    ``.weight_scale`` or ``.weight_shape``)."""
    return _K2_EXPERT.match(name) is not None


def expert_naming(names: Iterable[str]) -> str:
    """ "k2" when the checkpoint names hold a K2-family packed expert, else "k3"."""
    return "k2" if any(map(is_k2_expert, names)) else "k3"


def k2_block_name(name: str) -> str:
    """A name of an MoE layer's block as the K2 family stores it: ``model.layers.1.block_sparse_moe.gate.weight``
    -> ``model.layers.1.mlp.gate.weight``; other names unchanged."""
    return _MOE_BLOCK.sub(lambda m: f"{m['head']}mlp.", name, count=1)


def k3_block_name(name: str) -> str:
    """The reverse of ``k2_block_name`` for a name known to be in an MoE layer."""
    return _K2_BLOCK.sub(lambda m: f"{m['head']}block_sparse_moe.", name, count=1)


def logical_shape(kind: str, intermediate: int, dim: int) -> Tuple[int, int]:
    """The logical ``[out, in]`` of one expert's ``kind`` ("w1"/"w3": ``[F, D]``, "w2": ``[D, F]``): what an INT4
    checkpoint's ``weight_shape`` must hold."""
    return (dim, intermediate) if kind == "w2" else (intermediate, dim)


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
