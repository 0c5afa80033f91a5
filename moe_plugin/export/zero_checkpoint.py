"""The adapters of a checkpoint (``output_dir/checkpoints/step-N``), on one process: its layout-free
``trainable.safetensors`` (``moe_plugin.training.trainable_state``), or, in a checkpoint of an earlier version that
has none, DeepSpeed's engine files (``step-N/engine``), parsed as below.

What the trainer's ``engine.save_checkpoint(exclude_frozen_parameters=True)`` leaves (DeepSpeed 0.19.8):

* without ZeRO-3: ``mp_rank_00_model_states.pt``, whose ``module`` holds every trainable tensor whole;
* with ZeRO-3, per rank ``r``: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``param_shapes``: per
  optimizer sub-group, the ordered ``{name: full shape}`` of its parameters; ``module`` holds only empty
  placeholders) and ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (``bf16_`` in front in a bf16 run;
  ``fp32_flat_groups``: per sub-group, this rank's fp32 partition, the concatenation over the sub-group's
  parameters of ``ceil(numel / partition_count)`` elements each; ``ds_zero_partition_groups``: per sub-group
  its ``partition_ranks`` and this rank's place in them, written only when an expert sub-group exists, so a
  run whose adapters are all dense has every sub-group partitioned over the whole world). A parameter is the
  concatenation of its slices over ``partition_ranks``, cut to ``numel``.

Nothing here unpickles arbitrary objects: every file is read with ``torch.load(weights_only=True)``, allowing
only the project's allow-list of DeepSpeed classes (``deepspeed_safe_globals``).

DeepSpeed's ``zero_to_fp32`` assumes one partition group of the whole world; with expert parallelism the expert
sub-group is partitioned within an expert-data-parallel group (docs/zero3-ep.md) and each such group holds
other experts, so this module stitches them itself: expert adapters of EP rank ``k`` (megatron's layout,
tensor/pipeline parallel 1: rank ``g`` is EP rank ``g % EP``) hold experts ``[k*E/EP, (k+1)*E/EP)``; the full
stacking is ``lora_A`` rows and ``lora_B`` ``view(out, r, E_local)`` columns concatenated in EP-rank order
(``moe_plugin.expert_adapters.stitch_experts``).
"""

from __future__ import annotations

import glob
import math
import os
import pickle
import re
import zipfile
from typing import Dict, List, Tuple

import torch

from ..config import ModelConfig, require

__all__ = ["adapter_from_checkpoint", "zero3_parameters", "deepspeed_safe_globals", "load_engine_file"]

_ZERO_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_PLAIN_MODEL = "mp_rank_00_model_states.pt"
_EXPERT_FAMILY = "autoep_expert"


def deepspeed_safe_globals() -> list:
    """The project's one allow-list of DeepSpeed classes for engine files (``compat.deepspeed``, which
    resume uses too). Of it, the trainer's checkpoints (ZeRO-3 with and without expert adapters, 1 and 2
    processes, fp32 and bf16) hold only ``LossScaler`` and ``ZeroStageEnum`` in their optimizer states, as
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` reports; the model states hold tensors only."""
    from ..compat.deepspeed import deepspeed_safe_globals as allowed

    return allowed()


def _reason(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:  # torch's weights-only refusal is a paragraph that advises weights_only=False: not that
        if "Unsupported global" in line or "Unsupported operand" in line:
            return f"{type(err).__name__}: {line.rstrip('.')}"
    return f"{type(err).__name__}: {lines[0] if lines else 'no detail'}"[:300]


def load_engine_file(path: str) -> dict:
    """One DeepSpeed engine file, read without running any code it may carry (weights-only unpickling).
    ValueError naming the file when it is damaged, truncated, or holds anything but a DeepSpeed checkpoint."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            value = torch.load(path, map_location="cpu", weights_only=True)
    except (
        pickle.UnpicklingError,
        EOFError,
        RuntimeError,
        zipfile.BadZipFile,
        OSError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
    ) as err:
        raise ValueError(
            f"{path}: damaged or not a DeepSpeed checkpoint of this run ({_reason(err)}); restore the "
            "checkpoint, or export another --step (or the final adapter)"
        ) from None
    require(
        isinstance(value, dict),
        path,
        f"holds a {type(value).__name__}, not a DeepSpeed checkpoint's "
        "dictionary; restore the checkpoint, or export another --step (or the final adapter)",
    )
    return value


def _entry(values: dict, key: str, path: str):
    require(
        key in values,
        path,
        f"has no {key!r}: damaged or not a DeepSpeed ZeRO checkpoint of this run; restore "
        "the checkpoint, or export another --step (or the final adapter)",
    )
    return values[key]


def _partition_groups(optim: dict, world: int, rank: int, path: str) -> list:
    """Each sub-group's partitioning. DeepSpeed records it only when an expert sub-group exists; otherwise
    every sub-group is partitioned over all ``world`` ranks (checked against its ``partition_count``)."""
    if "ds_zero_partition_groups" in optim:
        return optim["ds_zero_partition_groups"]
    flats = _entry(optim, "fp32_flat_groups", path)
    counts = _entry(optim, "partition_count", path)
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts] * len(flats)
    require(
        all(int(c) == world for c in counts),
        path,
        f"its sub-groups are partitioned over {counts} ranks, but "
        f"the checkpoint holds {world} ranks' files; restore the missing files or export another --step",
    )
    return [
        {
            "sub_group": i,
            "partition_count": world,
            "partition_rank": rank,
            "partition_ranks": list(range(world)),
            "families": [],
        }
        for i in range(len(flats))
    ]


def zero3_parameters(engine_dir: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, List[torch.Tensor]]]:
    """Rebuild the trainable parameters of a ZeRO-3 checkpoint: ``(dense, experts)``, dense ``{name: tensor}``
    (partitioned over every rank) and experts ``{name: [the EP ranks' local tensors, in EP-rank order]}``."""
    optim_files = {}
    for f in glob.glob(os.path.join(engine_dir, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")):
        if m := re.fullmatch(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", os.path.basename(f)):
            optim_files.setdefault(int(m.group(1)), []).append(f)
    ranks = sorted(optim_files)
    require(
        ranks == list(range(len(ranks))) and ranks,
        "checkpoint",
        f"{engine_dir} does not hold the optimizer states of ranks 0..N-1 (found ranks {ranks})",
    )
    twice = sorted(r for r, files in optim_files.items() if len(files) > 1)
    require(
        not twice,
        "checkpoint",
        f"{engine_dir} holds two optimizer files (fp32 and bf16) for ranks {twice}; "
        "restore the checkpoint as the run saved it",
    )
    slices: Dict[Tuple[str, Tuple[int, ...]], Dict[int, torch.Tensor]] = {}  # (name, partition ranks) -> pieces
    shapes: Dict[str, torch.Size] = {}
    expert_groups: Dict[str, set] = {}
    for rank in ranks:
        model_file, optim_file = os.path.join(engine_dir, _ZERO_MODEL.format(rank)), optim_files[rank][0]
        require(
            os.path.isfile(model_file), "checkpoint", f"{model_file} is missing; restore it or export another --step"
        )
        shapes_of = _entry(load_engine_file(model_file), "param_shapes", model_file)
        optim = _entry(load_engine_file(optim_file), "optimizer_state_dict", optim_file)
        flats, groups = (
            _entry(optim, "fp32_flat_groups", optim_file),
            _partition_groups(optim, len(ranks), rank, optim_file),
        )
        require(
            len(flats) == len(groups) == len(shapes_of),
            "checkpoint",
            f"rank {rank}: {len(flats)} flat groups, "
            f"{len(groups)} partition groups and {len(shapes_of)} shape groups do not line up",
        )
        for flat, group, names in zip(flats, groups, shapes_of):
            count, members = int(group["partition_count"]), tuple(group["partition_ranks"])
            sizes = [math.ceil(math.prod(s) / count) for s in names.values()]
            require(
                sum(sizes) == flat.numel(),
                "checkpoint",
                f"rank {rank} sub-group {group['sub_group']}: "
                f"partitions of {sum(sizes)} elements expected, the flat group holds {flat.numel()}",
            )
            offset = 0
            for (name, shape), size in zip(names.items(), sizes):
                slices.setdefault((name, members), {})[int(group["partition_rank"])] = flat[offset : offset + size]
                offset += size
                shapes[name] = shape
                if _EXPERT_FAMILY in group.get("families", ()):
                    expert_groups.setdefault(name, set()).add(members)
    dense, experts = {}, {}
    for (name, members), pieces in slices.items():
        require(
            sorted(pieces) == list(range(len(members))),
            "checkpoint",
            f"{name}: partitions {sorted(pieces)} of {len(members)} found",
        )
        full = torch.cat([pieces[i] for i in range(len(members))])[: math.prod(shapes[name])].view(shapes[name])
        if name in expert_groups:
            experts.setdefault(name, []).append((min(members), full))
        else:
            dense[name] = full.clone()
    ep_size = len(ranks) // max((len(m) for ms in expert_groups.values() for m in ms), default=len(ranks))
    out_experts = {}
    for name, parts in experts.items():
        parts.sort(key=lambda p: p[0])  # EP rank k's group starts at global rank k (megatron's order)
        require(
            [p[0] for p in parts] == list(range(ep_size)),
            "checkpoint",
            f"{name}: expert-data-parallel groups starting at ranks {[p[0] for p in parts]}, expected 0..{ep_size - 1}",
        )
        out_experts[name] = [t.clone() for _, t in parts]
    return dense, out_experts


def _image_names(run_dir: str, vision: bool) -> bool:
    """Whether a megatron checkpoint's keys take the image model's names. megatron names the text model alike
    in its text and image models, so: as the run's final adapter names them if it finished, else the image
    model's over a base with a vision tower (the face the main job trains and the base's ``architectures``
    loads)."""
    from ..fileio import read_safetensors_header
    from .targets import is_image_adapter

    final = os.path.join(run_dir, "adapter", "adapter_model.safetensors")
    if os.path.isfile(final):
        return is_image_adapter(read_safetensors_header(final))
    return vision


def _peft_key(name: str, config: ModelConfig, backend: str, image: bool = False) -> str:
    """The PEFT key of a checkpoint tensor (the Hugging Face backend's names are peft's own already)."""
    from ..weights.names import TEXT_PREFIX, VISION_PREFIXES, megatron_to_hf_name

    name = name.replace(".default.", ".")
    if backend != "megatron":
        return name
    if name.startswith(VISION_PREFIXES):
        return "base_model.model." + name
    return "base_model.model." + (TEXT_PREFIX if image else "") + megatron_to_hf_name(name, config)


def adapter_from_checkpoint(
    run_dir: str, step: int, config: ModelConfig, backend: str, r: int, vision: bool = False
) -> Dict[str, torch.Tensor]:
    """The adapter tensors of checkpoint ``step`` of the run under PEFT keys, experts stacked over all E (fp32
    master weights under ZeRO-3): from the layout-free ``trainable.safetensors`` (``training.trainable_state``),
    or, for a checkpoint of an earlier version, from DeepSpeed's per-rank files; vision: whether the base
    checkpoint has a vision tower (``_image_names``). ValueError naming the available steps if ``step`` has no
    complete checkpoint."""
    from ..expert_adapters import adapter_factor, stitch_experts
    from ..training.checkpoint import step_name

    root = os.path.join(run_dir, "checkpoints")
    path = os.path.join(root, step_name(step))
    if not os.path.isfile(os.path.join(path, "COMPLETE")):
        found = sorted(
            int(d.split("-")[1])
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if re.fullmatch(r"step-\d+", d) and os.path.isfile(os.path.join(root, d, "COMPLETE"))
        )
        require(
            False,
            "step",
            f"the run has no complete checkpoint at step {step}; complete checkpoints: {found} "
            "(leave --step out to export the final adapter)",
        )
    engine = os.path.join(path, "engine")
    image = backend == "megatron" and _image_names(run_dir, vision)
    from ..training.trainable_state import TENSORS, read_trainable

    if os.path.isfile(os.path.join(path, TENSORS)):  # the layout-free state: whole tensors, whoever wrote them
        return {
            _peft_key(n, config, backend, image): t.float().clone()
            for n, t in read_trainable(path).items()
            if ":" not in n and ".lora_" in n
        }
    # a checkpoint of an earlier version: DeepSpeed's per-rank files
    if os.path.isfile(os.path.join(engine, _PLAIN_MODEL)):
        plain = os.path.join(engine, _PLAIN_MODEL)
        module = _entry(load_engine_file(plain), "module", plain)
        return {
            _peft_key(n, config, backend, image): t.detach().float().clone() for n, t in module.items() if ".lora_" in n
        }
    dense, experts = zero3_parameters(engine)
    out = {_peft_key(n, config, backend, image): t for n, t in dense.items() if ".lora_" in n}
    for name, parts in experts.items():
        factor = adapter_factor(name)
        require(
            factor is not None,
            "checkpoint",
            f"{name} sits in the expert sub-group but is not an expert "
            "adapter; restore the checkpoint as the run saved it",
        )
        out[_peft_key(name, config, backend, image)] = stitch_experts(parts, factor, r)
    return out
