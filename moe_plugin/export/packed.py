"""Merged exports over a packed base (MXFP4 or INT4 routed experts, docs/k3-formats.md): decode, requantise,
and the names the packed tensors are written under (docs/exports.md "Packed bases").

A packed base streams its experts as a layer keeps them (``base_stream.base_tensors``): ``...experts.w1`` holds the
codes ``[E, out, packed_cols]`` and ``...experts.w1_scale`` the scales (INT4: the bf16 scale's uint8 bytes).
``decoded`` turns that stream into the dense one (``...experts.w1`` ``[E, out, in]`` fp32, decoded exactly),
so a merge adds the deltas exactly as over a dense base. The merged experts are then written either dense, in
the base's own floating dtype (``float_dtype``: BF16 for the published release, fp32 for the tests' tiny
bases), or packed again in the base's format (``requantise``), which is lossy: ``changed`` counts the expert
values whose decoded value differs from the base's (a delta smaller than half a quantisation step is lost).

The encoders' rules the requantised self-check (``export/requantised.py``) brackets the written codes with
(``group_scales``, ``round_to_grid``) live beside the encoders, in ``ops.quant``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..ops.quant import decode, encode
from ..weights.packed import stack_of
from ..weights.packed_tensors import per_expert_tensors
from .base_stream import base_tensors

__all__ = [
    "PackedStack",
    "packed_stacks",
    "dense_config",
    "decoded",
    "requantise",
    "packed_output_tensors",
    "float_dtype",
    "dense_stream",
    "dense_base_model",
]


@dataclass(frozen=True)
class PackedStack:
    """One packed expert stack of the model: ``name`` (``...experts.w1``), its format, logical ``[E, out, in]``."""

    name: str
    format: str
    shape: Tuple[int, int, int]

    @property
    def in_features(self) -> int:
        return self.shape[2]


def packed_stacks(hf_config) -> Dict[str, PackedStack]:
    """``{"model.layers.1.block_sparse_moe.experts.w1": PackedStack}`` of ``MoEPluginForCausalLM(hf_config)``
    (built on the meta device); empty for dense experts."""
    from ..models import MoEPluginForCausalLM

    if getattr(hf_config, "expert_format", "dense") == "dense":
        return {}
    with torch.device("meta"):
        model = MoEPluginForCausalLM(hf_config)
    out = {}
    for prefix, module in model.named_modules():
        if getattr(module, "is_packed", False):
            for kind, shape in module.logical_shapes.items():
                out[f"{prefix}.{kind}"] = PackedStack(f"{prefix}.{kind}", module.expert_format, tuple(shape))
    return out


def dense_config(hf_config):
    """The same model with dense (floating) experts: the config a dense merged export carries."""
    config = copy.deepcopy(hf_config)
    config.expert_format = "dense"
    return config


def float_dtype(stored: Mapping[str, object]) -> torch.dtype:
    """The base's floating dtype: the one holding most of its unquantised values. ``stored``: ``{name: Stored}``
    (``weights.plan.stored_tensors``); packed scales (INT4's are bf16) are not weights and are left out."""
    counts: Dict[str, int] = {}
    for name, entry in stored.items():
        if entry.dtype in ("float32", "bfloat16", "float16", "float64") and not name.endswith("scale"):
            counts[entry.dtype] = counts.get(entry.dtype, 0) + math.prod(entry.shape)
    return getattr(torch, max(counts, key=counts.get)) if counts else torch.bfloat16


def decoded(
    stream: Iterable[Tuple[str, torch.Tensor]], stacks: Dict[str, PackedStack], keep_packed: bool = False
) -> Iterator[Tuple[str, torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]]:
    """``(name, tensor, packed)`` of a packed base's stream: each packed stack once, under its dense name, as
    ``[E, out, in]`` fp32 (decoded exactly) with ``packed = (codes, scales)`` when ``keep_packed``; every other
    tensor as it comes (``packed`` None). A stack's codes wait for its scales (one stack held at a time)."""
    pending: Dict[str, Dict[bool, torch.Tensor]] = {}
    for name, tensor in stream:
        found = stack_of(name)
        stack = found and stacks.get(f"{found[0]}.{found[1]}")
        if not stack:
            yield name, tensor, None
            continue
        parts = pending.setdefault(stack.name, {})
        parts[found[2]] = tensor
        if len(parts) < 2:
            continue
        codes, scales = pending.pop(stack.name)[False], parts[True]
        value = decode(stack.format, codes, scales, stack.in_features, torch.float32)
        yield stack.name, value, (codes, scales) if keep_packed else None
    if pending:
        raise ValueError(f"base: packed expert stacks without their scales (or codes): {sorted(pending)}")


def requantise(stack: PackedStack, merged: torch.Tensor, base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """merged ``[E, out, in]`` fp32 -> (codes, scales as a layer keeps them, the number of values whose decoded
    requantised value differs from the decoded ``base``)."""
    codes, scales = encode(stack.format, merged, scale_bits=True)
    changed = int((decode(stack.format, codes, scales, stack.in_features, torch.float32) != base).sum())
    return codes, scales, changed


def packed_output_tensors(
    stack: PackedStack, codes: torch.Tensor, scales: torch.Tensor, layout: str
) -> List[Tuple[str, torch.Tensor]]:
    """The tensors a requantised stack is written as: "hf" the layer's own ``...experts.w1`` / ``w1_scale``;
    "k3" per expert ``...experts.{e}.w1.weight_packed`` / ``.weight_scale`` (INT4: the bf16 scale as published,
    and ``.weight_shape`` ``[out, in]`` int32): the release layout, by the writer the tests'
    ``testing.packed_checkpoints`` uses too (``weights.packed_tensors``)."""
    if layout == "hf":
        return [(stack.name, codes), (stack.name + "_scale", scales)]
    return per_expert_tensors(stack.name, stack.format, codes, scales, stack.shape)


def dense_stream(base_path: str, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """``base_stream.base_tensors`` with every packed stack decoded (fp32 ``[E, out, in]``): a dense base's
    stream as is."""
    stacks = packed_stacks(hf_config)
    return ((n, t) for n, t, _ in decoded(base_tensors(base_path, hf_config), stacks))


def dense_base_model(source):
    """``source``'s base as a model with dense fp32 experts (a packed base's decoded exactly), eval mode: the
    text model, or for targets on the image model (``targets.on_image_model``) the image+text model with the
    base's vision tower."""
    from ..models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
    from ..weights.names import TEXT_PREFIX, VISION_PREFIXES
    from .targets import on_image_model

    image = on_image_model(source.targets)
    model = (MoEPluginForConditionalGeneration if image else MoEPluginForCausalLM)(dense_config(source.hf_config))
    model = model.float()
    state = {
        (n if n.startswith(VISION_PREFIXES) else TEXT_PREFIX + n) if image else n: t.float()
        for n, t in dense_stream(source.base_path, source.hf_config)
        if image or not n.startswith(VISION_PREFIXES)
    }
    model.load_state_dict(state, strict=not source.hf_config.tie_word_embeddings)
    return model.eval()
