"""Merged exports, streamed: base tensors read one at a time, deltas added, written to safetensors shards.

``base_tensors(base_path, config)`` yields the base model's tensors under Hugging Face names, one at a time,
whatever the base's layout (``weights.plan`` reads a K3 checkpoint's per-expert tensors into one stacked
``[E, out, in]`` tensor, unpads ``A_log``, ...). ``write_merged`` adds each target's delta (fp32 arithmetic,
then the base dtype) and hands the tensor to a ``ShardWriter`` in the output's naming (Hugging Face stacked, or
K3 per-expert through ``models.k3_format``'s rules). The writer flushes a shard when it is full and before it
would take expert tensors of a second layer, so at most one layer's experts are ever held (at K3 size one
layer's experts are ~59 GB in BF16, against 5.6 TB for the model).

Packed (MXFP4) bases: the loaders refuse them until the packed-base work provides a codec. The hook is
``PACKED_CODEC``: an object with ``dequantise(name, handle) -> Tensor`` (a BF16 expert stack from the packed
tensors) and ``requantise(name, tensor) -> (Dict[str, Tensor], changed: int)`` (the packed tensors of a merged
stack and how many values the round trip changed). Without ``requantise=True`` a packed base's experts are
written in BF16; with it, the codec's packed tensors, and the export reports the changed values.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from safetensors.torch import save_file

from ..config import require
from ..fileio import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, safetensors_weight_map
from ..weights.names import (is_stacked_expert, k3_expert_name, quantised_tensors, strip_text_prefix,
                             tensor_to_k3)
from .deltas import dense_delta, expert_deltas
from .targets import Target

__all__ = ["PACKED_CODEC", "check_packed_base", "ShardWriter", "base_tensors", "write_merged", "expert_layer_of", "delta_for"]

PACKED_CODEC = None  # set by the packed-base work (issue 11); see the module docstring


def expert_layer_of(name: str) -> Optional[int]:
    """The layer index of a stacked expert tensor ``model.layers.{i}.block_sparse_moe.experts.w[123]``."""
    if not is_stacked_expert(strip_text_prefix(name)):
        return None
    return int(strip_text_prefix(name).split(".")[2])


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
        if self.pending and (self.pending_bytes + nbytes > self.max_bytes
                             or (expert_layer is not None and self.pending_layers - {expert_layer})):
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
        save_file({n: t.contiguous() for n, t in self.pending}, os.path.join(self.directory, f".shard-{number:05d}"),
                  metadata={"format": "pt"})
        self.files.append([n for n, _ in self.pending])
        self.pending, self.pending_bytes, self.pending_layers = [], 0, set()

    def close(self) -> List[str]:
        """Flush, name the shards ``model-0000i-of-0000N.safetensors`` (one: ``model.safetensors``), write the
        index; returns the file names."""
        self.flush()
        count = len(self.files)
        names = [SAFETENSORS_SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                         for i in range(1, count + 1)]
        weight_map = {}
        for i, (file, tensors) in enumerate(zip(names, self.files), start=1):
            os.rename(os.path.join(self.directory, f".shard-{i:05d}"), os.path.join(self.directory, file))
            weight_map.update((n, file) for n in tensors)
        if count > 1:
            with open(os.path.join(self.directory, SAFETENSORS_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2,
                          sort_keys=True)
            names.append(SAFETENSORS_INDEX)
        return names


def check_packed_base(base_path: str, requantise: bool) -> bool:
    from ..weights.plan import stored_tensors

    stored = stored_tensors(safetensors_weight_map(base_path))
    packed = quantised_tensors({n: s.dtype for n, s in stored.items()})
    if not packed:
        require(not requantise, "requantise", "the base's experts are not packed: there is nothing to requantise "
                "to; leave --requantise out")
        return False
    require(PACKED_CODEC is not None, "base", f"{base_path} stores {len(packed)} packed (MXFP4) expert tensors, "
            "e.g. " f"{packed[:3]}; merging needs the MXFP4 codec of the packed-base support "
            "(moe_plugin.export.merge.PACKED_CODEC), which is not installed yet: dequantise the experts to BF16 first")
    require(not requantise or hasattr(PACKED_CODEC, "requantise"), "requantise", "the installed MXFP4 codec cannot "
            "requantise; leave --requantise out to write BF16 experts")
    return True


def base_tensors(base_path: str, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base checkpoint's tensors under the text model's Hugging Face names, one at a time, in state-dict
    order (experts stacked ``[E, out, in]``), each a new tensor in the checkpoint's dtype."""
    from ..models.k3_format import expected_shapes
    from ..weights.loader import LoadStats, _apply, _open_safetensors
    from ..weights.plan import Target as ReadTarget, plan_reads, stored_tensors

    config = hf_config.to_model_config()
    shapes = expected_shapes(hf_config)
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # stored once, as the embedding
    targets = {n: ReadTarget(s, (0, s[0]) if is_stacked_expert(n) and len(s) == 3 else None) for n, s in shapes.items()}
    plan = plan_reads(targets, safetensors_weight_map(base_path), names="hf", config=config, strict=True,
                      source=base_path)
    stored = stored_tensors(safetensors_weight_map(base_path))
    handles: Dict[str, object] = {}
    try:
        for name, reads in plan.reads.items():
            if not reads:
                continue
            first = reads[0].name
            tensor = torch.empty(targets[name].shape, dtype=getattr(torch, stored[first].dtype))
            for read in reads:
                if read.file not in handles:
                    handles[read.file] = _open_safetensors(read.file).__enter__()
                _apply(handles[read.file], read, tensor, targets[name], LoadStats())
            yield name, tensor
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def delta_for(target: Target, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The target's delta from its adapter tensors: ``[out, in]``, or ``[E, out, in]`` for stacked experts."""
    a, b = state[target.key_a], state[target.key_b]
    if target.experts:
        return expert_deltas(a, b, target.experts, target.scaling)
    return dense_delta(a, b, target.scaling)


def _merged(tensor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    require(tuple(delta.shape) == tuple(tensor.shape), "adapter", f"a delta of shape {list(delta.shape)} does not "
            f"fit its base tensor {list(tensor.shape)}")
    return (tensor.float() + delta).to(tensor.dtype)


def write_merged(base_path: str, hf_config, targets: Mapping[str, Target], state: Mapping[str, torch.Tensor],
                 directory: str, layout: str, max_bytes: int, requantise: bool = False,
                 on_tensor: Optional[Callable[[str, torch.Tensor], None]] = None) -> Dict[str, object]:
    """Write base + deltas into ``directory`` in ``layout`` ("hf" or "k3"), streaming; returns what was written
    (files, merged target names, peak expert layers held, values a requantisation changed)."""
    require(layout in ("hf", "k3"), "layout", f"must be 'hf' or 'k3', got {layout!r}")
    packed = check_packed_base(base_path, requantise)
    writer = ShardWriter(directory, max_bytes)
    merged, changed = [], 0
    for name, tensor in base_tensors(base_path, hf_config):
        target = targets.get(name)
        if target is not None:
            tensor = _merged(tensor, delta_for(target, state))
            merged.append(name)
        layer = expert_layer_of(name)
        if on_tensor is not None:
            on_tensor(name, tensor)
        if layout == "hf":
            writer.add(name, tensor, layer)
        elif layer is not None:
            for e in range(tensor.shape[0]):
                writer.add(k3_expert_name(name, e), tensor[e].clone(), layer)
        else:
            writer.add(name, tensor_to_k3(name, tensor).contiguous().clone(), None)
        del tensor
    files = writer.close()
    return {"files": files, "merged": merged, "peak_expert_layers": writer.peak_expert_layers,
            "requantised_changed_values": changed if packed and requantise else None}
