"""Stream a safetensors checkpoint (Hugging Face or K3 layout) into a model, tensor by tensor, on this rank.

``load_state(model, path, names="hf" | "megatron", config=...)`` plans every read first (``weights.plan``: one
ValueError for every missing, unknown and misshapen tensor, and ``weights.checks``: one for every tensor
stored in a dtype the model must not convert from, before anything is written), then opens each
shard once and reads one tensor at a time (an expert stack one expert row at a time: ``get_slice`` rows of a
stacked tensor, or one K3 per-expert tensor), writing it into the model at once and dropping it before the
next read. So beyond the model a rank holds at most one checkpoint tensor, or one expert row, at a time, and
it reads only its own experts. Each value is checked as it is read: NaN or inf (a packed expert: its scales)
raises a ValueError naming the tensor and its file. A damaged shard is named by ``fileio.read_safetensors_header``.

DeepSpeed ZeRO-3: a parameter built under ``deepspeed.zero.Init`` keeps an empty placeholder in ``.data``; its
values are ``param.ds_tensor``, rank ``i`` of ``param.ds_process_group`` holding elements ``[i*n, (i+1)*n)``
of the flattened tensor padded to a multiple of the group size (``n = ds_tensor.numel()``; DeepSpeed's
``Init._partition_param``). Such a parameter is checked against ``ds_shape``, only the rows covering this
rank's partition are read, and only the partition is written (padding zeroed), with no collective. Buffers are
never partitioned and are copied whole. docs/zero3-ep.md has what ZeRO-3 does to a built model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

from ..compat import deepspeed as zero3
from ..config import ModelConfig, require
from ..fileio import read_safetensors_header, safetensors_weight_map
from .checks import check_dtypes, check_finite, check_packed_scale, config_dtype
from .names import (
    NAMINGS,
    base_name,
    expert_layer,
    is_expert_tensor,
    is_stacked_expert,
    strip_text_prefix,
    tensor_from_k3,
)
from .packed import is_packed_expert_stack
from .plan import Plan, detect_layout, plan_reads, stored_tensors
from .reads import Read, Stored, Target

__all__ = [
    "LoadStats",
    "load_state",
    "run_reads",
    "state_from_tensors",
    "model_tensors",
    "model_targets",
    "expert_ranges",
    "is_partitioned",
    "partition_range",
    "zero_padding",
    "write_flat",
]

_EXTRA_STATE = "_extra_state"
_CHECKED_SHARDS: set = set()  # (real path, size, mtime) of shards whose header read_safetensors_header passed


@dataclass
class LoadStats:
    """What a load read: checkpoint tensors (a stacked expert tensor counts once), elements, and of those the
    routed-expert elements; the layout; the checkpoint tensors dropped (``ignored``: vision, MTP) or skipped
    (``unknown``, strict=False); the targets left as they were (``fresh``: no DSA indexer in a K3 checkpoint);
    ``precision``: the line saying which tensors stored in fp32 under a lower config dtype were kept in fp32
    and which cast to the model's dtype (``precision.STORED_FP32``), empty when none were."""

    tensors: int = 0
    elements: int = 0
    expert_elements: int = 0
    ignored: List[str] = field(default_factory=list)
    unknown: List[str] = field(default_factory=list)
    fresh: List[str] = field(default_factory=list)
    layout: str = ""
    precision: str = ""


def expert_ranges(model: nn.Module) -> Dict[int, Tuple[int, int]]:
    """``{layer index: (first, last + 1)}`` of the experts each MoE layer of megatron ``model`` holds here."""
    ranges = {}
    for i, layer in enumerate(model.decoder.layers):
        local = getattr(layer.mlp, "local_expert_indices", None)
        if local is None:
            continue
        first, count = local[0], len(local)
        require(
            list(local) == list(range(first, first + count)),
            f"decoder.layers.{i}.mlp.local_expert_indices",
            f"must be contiguous, got {local}",
        )
        ranges[i] = (first, first + count)
    return ranges


def model_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The base model's parameters and buffers under their pre-LoRA names (adapter tensors and megatron's
    ``_extra_state`` left out), as the objects themselves (so ZeRO-3's ``ds_*`` attributes are there)."""
    return {
        base_name(k): v
        for k, v in model.state_dict(keep_vars=True).items()
        if not k.endswith(_EXTRA_STATE) and ".lora_" not in k
    }


def is_partitioned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ZeRO-3 partitioned parameter (its values live in ``ds_tensor``)."""
    return zero3.is_zero3_partitioned(tensor)


def partition_range(param: torch.Tensor) -> Tuple[int, int]:
    """The real (not padding) elements ``[lo, hi)`` of the flattened ZeRO-3 ``param`` this rank holds."""
    n = zero3.local_partition(param).numel()
    lo = dist.get_rank(group=zero3.partition_group(param)) * n
    return lo, max(lo, min(lo + n, zero3.full_numel(param)))


def model_targets(tensors: Mapping[str, torch.Tensor], model: nn.Module, names: str) -> Dict[str, Target]:
    """``Target`` of each of ``model_tensors(model)``: full shape (``ds_shape`` when partitioned), expert rows
    (megatron: this rank's ``expert_ranges``; "hf": every expert), ZeRO-3 partition range."""
    ranges = expert_ranges(model) if names == "megatron" and any(map(is_expert_tensor, tensors)) else {}
    out = {}
    for name, tensor in tensors.items():
        shape = zero3.full_shape(tensor) if is_partitioned(tensor) else tuple(tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        packed = is_packed_expert_stack(name, dtype)
        experts = None
        if names == "megatron" and (is_expert_tensor(name) or packed):
            layer = expert_layer(name.removesuffix("_scale"))
            require(layer in ranges, f"{name}", f"layer {layer}'s MoE has no local_expert_indices to place its rows")
            experts = ranges[layer]
        elif names == "hf" and (is_stacked_expert(strip_text_prefix(name)) or packed) and len(shape) == 3:
            experts = (0, shape[0])
        out[name] = Target(
            shape, experts, partition_range(tensor) if is_partitioned(tensor) else None, dtype if packed else None
        )
    return out


@torch.no_grad()
def zero_padding(param: torch.Tensor) -> None:
    """Zero the entries of this rank's ZeRO-3 partition that lie past the tensor's end (DeepSpeed pads the
    flattened tensor to a multiple of the group size)."""
    lo, hi = partition_range(param)
    zero3.local_partition(param).view(-1)[hi - lo :].zero_()


@torch.no_grad()
def write_flat(tensor: torch.Tensor, offset: int, value: torch.Tensor) -> None:
    """Write ``value`` flattened at element ``offset`` of flattened ``tensor`` (converting dtype).

    A ZeRO-3 partitioned parameter gets only the part inside this rank's partition, in ``ds_tensor`` (and in
    ``.data`` too while the parameter is gathered, so leaving a ``GatheredParameters`` keeps it)."""
    flat = value.reshape(-1)
    start, stop = offset, offset + flat.numel()
    if is_partitioned(tensor):
        part = zero3.local_partition(tensor).view(-1)
        lo = dist.get_rank(group=zero3.partition_group(tensor)) * part.numel()
        numel = zero3.full_numel(tensor)
        a, b = max(start, lo), min(stop, lo + part.numel(), numel)
        if a < b:
            part[a - lo : b - lo].copy_(flat[a - start : b - start])
        if tensor.data.numel() == numel:
            tensor.data.view(-1)[start:stop].copy_(flat)
        return
    require(
        tensor.is_contiguous(),
        "model",
        "tensors are written in place through a flat view and must be "
        f"contiguous; got one of shape {list(tensor.shape)} with strides {list(tensor.stride())}",
    )
    tensor.data.view(-1)[start:stop].copy_(flat)


def _open_safetensors(file: str) -> ContextManager[Any]:
    # a damaged shard named, not safetensors' own error; checked once per file version (some callers open a
    # shard once per tensor, and a K3 shard's header is large)
    stat = os.stat(file)
    version = (os.path.realpath(file), stat.st_size, stat.st_mtime_ns)
    if version not in _CHECKED_SHARDS:
        read_safetensors_header(file)
        _CHECKED_SHARDS.add(version)
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:  # e.g. a header past safetensors' own size limit
        raise ValueError(
            f"path: {file}: damaged safetensors file: safetensors cannot open it "
            f"({type(err).__name__}: {err}); re-download or re-save it"
        ) from None


def _fetch(handle: Any, read: Read) -> torch.Tensor:
    try:
        if read.rows is None:
            return handle.get_tensor(read.name)
        return handle.get_slice(read.name)[read.rows[0] : read.rows[1]]
    except SafetensorError as err:  # I/O, or a file changed since its header was checked
        raise ValueError(
            f"path: {read.file}: damaged safetensors file: tensor {read.name} cannot be read "
            f"({type(err).__name__}: {err}); re-download or re-save it"
        ) from None


def run_reads(
    plan: Plan,
    tensors: Mapping[str, torch.Tensor],
    targets: Mapping[str, Target],
    open_file: Callable[[str], ContextManager[Any]],
    stats: LoadStats,
    expert_format: Optional[str] = None,
) -> None:
    """Carry out ``plan`` (``moe_plugin.weights.plan.plan_reads``) into ``tensors`` (target name -> this rank's
    tensor, as ``targets`` describes it), file by file through ``open_file`` (a safetensors handle's context).
    Every value is checked as it is read (``weights.checks``): a NaN or inf raises a ValueError naming the
    tensor and its file; packed scales by ``expert_format`` (the model's ``MoEConfig.expert_format``)."""
    read_names = set()
    for file, reads in plan.by_file().items():
        with open_file(file) as handle:
            for read in reads:
                # one tensor at a time: the value is dropped when this iteration's call returns
                stats.elements += _apply(handle, read, tensors[read.target], targets[read.target], stats, expert_format)
                read_names.add(read.name)
    stats.tensors = len(read_names)


def _packed_value(
    read: Read, value: torch.Tensor, tensor: torch.Tensor, expert_format: Optional[str] = None
) -> torch.Tensor:
    """A packed expert tensor's stored bits, reinterpreted (never converted) as the target's dtype; a scale
    checked by what it decodes to (``checks.check_packed_scale``)."""
    if read.target.endswith("_scale"):
        check_packed_scale(read.name, read.file, value, expert_format)
    if read.bitcast is not None:
        value = value.view(getattr(torch, read.bitcast))
    require(
        value.dtype == tensor.dtype,
        read.name,
        f"holds {value.dtype}, the packed target {read.target} {tensor.dtype}: packed bytes are never converted",
    )
    return value


def _apply(
    handle: Any, read: Read, tensor: torch.Tensor, target: Target, stats: LoadStats, expert_format: Optional[str] = None
) -> int:
    value = _fetch(handle, read)
    numel = value.numel()
    if read.expert:
        stats.expert_elements += numel
    if read.convert:
        value = tensor_from_k3(read.name, value, target.shape)
    if target.dtype is not None:
        value = _packed_value(read, value, tensor, expert_format)
    else:
        check_finite(read.name, read.file, value)
    write_flat(tensor, read.offset, value)
    return numel


@torch.no_grad()
def load_state(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    names: str,
    config: ModelConfig,
    strict: bool = True,
    layout: Optional[str] = None,
    ignore_vision: bool = False,
    ignore_mtp: bool = False,
    open_file: Optional[Callable[[str], ContextManager[Any]]] = None,
) -> LoadStats:
    """Copy the checkpoint directory ``path`` (``model.safetensors`` or an index with shards) into ``model``.

    names: the model's naming, "hf" (this project's Hugging Face classes; peft's ``base_layer.`` segments
    are seen through) or "megatron" (``GPTModel``, this rank's experts). config: the text model's
    ``ModelConfig``. layout: "hf" or "k3"; default: detected (``plan.detect_layout``: config.json's
    model_type, else the tensor names). strict: checkpoint tensors the model lacks raise (missing and
    misshapen ones always do), all in one ValueError before anything is written. ignore_vision /
    ignore_mtp: drop vision or multi-token-prediction tensors the model lacks. open_file: how a shard is
    opened (default ``safetensors.safe_open(file, framework="pt")``); a wrapper can observe the reads.
    """
    require(names in NAMINGS, "names", f"must be one of {NAMINGS}, got {names!r}")
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    path = os.fspath(path)
    weight_map = safetensors_weight_map(path)
    stored = stored_tensors(weight_map)
    layout = layout or detect_layout(path, stored)
    tensors = model_tensors(model)
    targets = model_targets(tensors, model, names)
    plan = plan_reads(
        targets,
        weight_map,
        names=names,
        config=config,
        layout=layout,
        strict=strict,
        ignore_vision=ignore_vision,
        ignore_mtp=ignore_mtp,
        stored=stored,
        source=path,
    )
    note = check_dtypes(_unpacked_reads(plan, stored, tensors, targets), config_dtype(path), path)
    for name in plan.reads:
        if is_partitioned(tensors[name]):
            zero_padding(tensors[name])
    stats = LoadStats(ignored=plan.ignored, unknown=plan.unknown, fresh=plan.fresh, layout=layout)
    stats.precision = note or ""
    run_reads(plan, tensors, targets, open_file or _open_safetensors, stats, config.moe.expert_format)
    return stats


def _unpacked_reads(
    plan: Plan, stored: Mapping[str, Stored], tensors: Mapping[str, torch.Tensor], targets: Mapping[str, Target]
) -> List[Tuple[str, str, str, torch.dtype]]:
    """(stored name, file, stored dtype, model dtype) of each read into a target that is not packed (packed
    targets take their bits unconverted and ``plan_reads`` checks their dtypes)."""
    return [
        (r.name, r.file, stored[r.name].dtype, tensors[r.target].dtype)
        for target, reads in plan.reads.items()
        if targets[target].dtype is None
        for r in reads
    ]


class _InMemory:
    """The two reads ``_fetch`` makes, over a dict of tensors (``get_slice`` rows are views)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def state_from_tensors(
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, Tuple[int, ...]],
    *,
    config: ModelConfig,
    layout: str = "k3",
    strict: bool = True,
    ignore_vision: bool = False,
    ignore_mtp: bool = False,
) -> Dict[str, torch.Tensor]:
    """In-memory checkpoint tensors -> a state dict for a Hugging Face-named model with ``shapes``.

    The same plan as ``load_state`` (and the same one ValueError, under the field ``tensors``); the values
    are new tensors in the checkpoint's dtypes (stacked experts ``[E, ...]``, A_log unpadded). Targets the
    plan leaves fresh (a K3 checkpoint without the DSA indexer) are not in the result."""
    stored = {n: Stored("", tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}
    targets = {
        n: Target(tuple(s), (0, s[0]) if is_stacked_expert(strip_text_prefix(n)) and len(s) == 3 else None)
        for n, s in shapes.items()
    }
    plan = plan_reads(
        targets,
        {n: "" for n in tensors},
        names="hf",
        config=config,
        layout=layout,
        strict=strict,
        ignore_vision=ignore_vision,
        ignore_mtp=ignore_mtp,
        stored=stored,
        field_name="tensors",
    )
    out = {
        name: torch.empty(targets[name].shape, dtype=tensors[reads[0].name].dtype)
        for name, reads in plan.reads.items()
        if reads
    }
    run_reads(plan, out, targets, lambda file: _InMemory(tensors), LoadStats(), config.moe.expert_format)
    return out
