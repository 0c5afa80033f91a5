"""Merged exports, streamed: base tensors read one at a time, deltas added, written to safetensors shards.

``base_stream.base_tensors(base_path, config)`` yields the base model's tensors under Hugging Face names, one at
a time, whatever the base's layout (``weights.plan`` reads a K3 checkpoint's per-expert tensors into one stacked
``[E, out, in]`` tensor, unpads ``A_log``, ...). ``write_merged`` adds each target's delta (fp32 arithmetic,
then the base dtype) and hands the tensor to a ``ShardWriter`` in the output's naming (Hugging Face stacked, or
K3 per-expert through ``models.k3_format``'s rules). The writer flushes a shard when it is full and before it
would take expert tensors of a second layer, so at most one layer's experts are ever held (at K3 size one
layer's experts are ~59 GB in BF16, against 5.6 TB for the model).

Packed bases (MXFP4 / INT4 routed experts): ``base_tensors`` streams the experts as a layer keeps them (codes
and scales), ``export.packed.decoded`` turns them into exact fp32 stacks, and the merged experts are written
dense in the base's floating dtype (BF16 for the release; fp32 for the tests' tiny bases) or, with
``requantise=True``, packed again in the base's format, with the count of values that changed from the base.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from safetensors.torch import save_file

from ..config import require
from ..fileio import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, safetensors_weight_map
from ..precision import FP32_TENSORS
from ..weights.names import (
    TEXT_PREFIX,
    VISION_PREFIXES,
    has_vision,
    is_stacked_expert,
    k3_expert_name,
    quantised_tensors,
    strip_text_prefix,
    tensor_to_k3,
)
from ..weights.packed import stack_of
from .base_stream import base_tensors
from .deltas import dense_delta, expert_deltas
from .packed import decoded, float_dtype, packed_output_tensors, packed_stacks, requantise as requantise_stack
from .targets import Target

__all__ = ["check_packed_base", "has_vision", "ShardWriter", "write_merged", "expert_layer_of", "delta_for"]


def expert_layer_of(name: str) -> Optional[int]:
    """The layer index of a routed-expert tensor: stacked ``model.layers.{i}.block_sparse_moe.experts.w[123]``
    (and a packed stack's ``..._scale``), or K3's per-expert ``...experts.{e}.w1.weight_packed``."""
    plain = strip_text_prefix(name)
    if not (is_stacked_expert(plain) or stack_of(plain) or ".block_sparse_moe.experts." in plain):
        return None
    return int(plain.split(".")[2])


class ShardWriter:
    """Writes tensors into numbered safetensors shards of at most ``max_bytes`` (a larger tensor gets its own)
    and, at ``close()``, the index. A shard is flushed before it would hold expert tensors of two layers."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: List[Tuple[str, torch.Tensor]] = []
        self.pending_bytes, self.pending_layers = 0, set()
        self.files: List[List[str]] = []
        self.total = 0
        self.peak_expert_layers = 0  # the most MoE layers whose experts were held at once (tests read it)

    def add(self, name: str, tensor: torch.Tensor, expert_layer: Optional[int] = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and (
            self.pending_bytes + nbytes > self.max_bytes
            or (expert_layer is not None and self.pending_layers - {expert_layer})
        ):
            self.flush()
        self.pending.append((name, tensor))
        self.pending_bytes += nbytes
        self.total += nbytes
        if expert_layer is not None:
            self.pending_layers.add(expert_layer)
        self.peak_expert_layers = max(self.peak_expert_layers, len(self.pending_layers))

    def flush(self) -> None:
        if not self.pending:
            return
        number = len(self.files) + 1
        save_file(
            {n: t.contiguous() for n, t in self.pending},
            os.path.join(self.directory, f".shard-{number:05d}"),
            metadata={"format": "pt"},
        )
        self.files.append([n for n, _ in self.pending])
        self.pending, self.pending_bytes, self.pending_layers = [], 0, set()

    def close(self) -> List[str]:
        """Flush, name the shards ``model-0000i-of-0000N.safetensors`` (one: ``model.safetensors``), write the
        index; returns the file names."""
        self.flush()
        count = len(self.files)
        names = (
            [SAFETENSORS_SINGLE]
            if count == 1
            else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        weight_map = {}
        for i, (file, tensors) in enumerate(zip(names, self.files), start=1):
            os.rename(os.path.join(self.directory, f".shard-{i:05d}"), os.path.join(self.directory, file))
            weight_map.update((n, file) for n in tensors)
        if count > 1:
            with open(os.path.join(self.directory, SAFETENSORS_INDEX), "w") as f:
                json.dump(
                    {"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2, sort_keys=True
                )
            names.append(SAFETENSORS_INDEX)
        return names


def check_packed_base(base_path: str, requantise: bool) -> bool:
    """Whether the base at ``base_path`` stores packed experts; ValueError (``requantise``) when requantising is
    asked of a base that has nothing packed."""
    from ..weights.plan import stored_tensors

    stored = stored_tensors(safetensors_weight_map(base_path))
    packed = quantised_tensors({n: s.dtype for n, s in stored.items()})
    require(
        bool(packed) or not requantise,
        "requantise",
        "the base's experts are not packed: there is nothing to requantise to; leave --requantise out",
    )
    return bool(packed)


def delta_for(target: Target, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The target's delta from its adapter tensors: ``[out, in]``, or ``[E, out, in]`` for stacked experts."""
    a, b = state[target.key_a], state[target.key_b]
    if target.experts:
        return expert_deltas(a, b, target.experts, target.scaling)
    return dense_delta(a, b, target.scaling)


def _merged(name: str, tensor: torch.Tensor, delta: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """base + delta in fp32, written back in the base's dtype, except a tensor the model holds in fp32
    (``precision.FP32_TENSORS``: the router), which stays fp32: rounding a merged router to bf16 would move
    near-tied expert choices, and fp32 is a stored dtype the loader accepts for it (``precision.STORED_FP32``)."""
    require(
        tuple(delta.shape) == tuple(tensor.shape),
        "adapter",
        f"a delta of shape {list(delta.shape)} does not fit its base tensor {list(tensor.shape)}",
    )
    if in_place and tensor.dtype == torch.float32:  # no second copy of an expert stack
        return tensor.add_(delta)
    keep = any(re.search(pattern, name) for pattern in FP32_TENSORS)
    return (tensor.float() + delta).to(torch.float32 if keep else tensor.dtype)


def _write(writer: ShardWriter, name: str, tensor: torch.Tensor, layout: str, prefix: str) -> None:
    layer = expert_layer_of(name)
    if name.startswith(VISION_PREFIXES):
        writer.add(name, tensor, None)  # as stored: both layouts name them alike
    elif layout == "hf":
        writer.add(prefix + name, tensor, layer)
    elif layer is not None:
        for e in range(tensor.shape[0]):
            writer.add(prefix + k3_expert_name(name, e), tensor[e].clone(), layer)
    else:
        writer.add(prefix + name, tensor_to_k3(name, tensor).contiguous().clone(), None)


def write_merged(
    base_path: str,
    hf_config,
    targets: Mapping[str, Target],
    state: Mapping[str, torch.Tensor],
    directory: str,
    layout: str,
    max_bytes: int,
    requantise: bool = False,
    on_tensor: Optional[Callable[[str, torch.Tensor], None]] = None,
) -> Dict[str, object]:
    """Write base + deltas into ``directory`` in ``layout`` ("hf" or "k3"), streaming; returns what was written
    (files, merged target names, peak expert layers held; over a packed base the experts' dtype, or with
    ``requantise`` their format, the values that changed from the base and the values requantised).
    on_tensor(name, tensor): sees every merged tensor before it is written (dense experts ``[E, out, in]``)."""
    from ..weights.plan import stored_tensors

    require(layout in ("hf", "k3"), "layout", f"must be 'hf' or 'k3', got {layout!r}")
    packed = check_packed_base(base_path, requantise)
    stacks = packed_stacks(hf_config) if packed else {}
    dtype = float_dtype(stored_tensors(safetensors_weight_map(base_path)))
    writer = ShardWriter(directory, max_bytes)
    prefix = TEXT_PREFIX if has_vision(base_path) else ""  # an image+text checkpoint keeps its text under it
    merged, changed, requantised = [], 0, 0
    streamed = {t.stream_name: t for t in targets.values()}  # an image run's targets carry language_model.
    for name, tensor, codes in decoded(base_tensors(base_path, hf_config), stacks, keep_packed=requantise):
        target = streamed.get(name)
        base = tensor
        if target is not None:  # a requantised stack's changed values are counted against the base
            tensor = _merged(name, tensor, delta_for(target, state), in_place=not (requantise and name in stacks))
            merged.append(name)
        if on_tensor is not None:
            on_tensor(name, tensor)
        if name in stacks and requantise:
            stack = stacks[name]
            if target is None:  # not adapted: the stored bytes, not a re-encoding of them
                new_codes, new_scales = codes
            else:
                new_codes, new_scales, n = requantise_stack(stack, tensor, base)
                changed, requantised = changed + n, requantised + tensor.numel()
            for out_name, value in packed_output_tensors(stack, new_codes, new_scales, layout):
                writer.add(prefix + out_name, value, expert_layer_of(name))
            continue
        if name in stacks:
            tensor = tensor.to(dtype)
        _write(writer, name, tensor, layout, prefix)
        del tensor, base, codes
    files = writer.close()
    return {
        "files": files,
        "merged": merged,
        "peak_expert_layers": writer.peak_expert_layers,
        "expert_format": (next(iter(stacks.values())).format if requantise else str(dtype).replace("torch.", ""))
        if packed
        else None,
        "requantised_changed_values": changed if packed and requantise else None,
        "requantised_values": requantised if packed and requantise else None,
        "float_dtype": str(dtype).replace("torch.", ""),
    }
