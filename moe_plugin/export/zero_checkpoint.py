"""The adapters of a DeepSpeed engine checkpoint (``output_dir/checkpoints/step-N/engine``), on one process.

What the trainer's ``engine.save_checkpoint(exclude_frozen_parameters=True)`` leaves (DeepSpeed 0.19.8):

* without ZeRO-3: ``mp_rank_00_model_states.pt``, whose ``module`` holds every trainable tensor whole;
* with ZeRO-3, per rank ``r``: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``param_shapes``: per
  optimizer sub-group, the ordered ``{name: full shape}`` of its parameters; ``module`` holds only empty
  placeholders) and ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (``fp32_flat_groups``: per sub-group, this
  rank's fp32 partition, the concatenation over the sub-group's parameters of ``ceil(numel / partition_count)``
  elements each; ``ds_zero_partition_groups``: per sub-group its ``partition_ranks`` and this rank's place
  in them). A parameter is the concatenation of its slices over ``partition_ranks``, cut to ``numel``.

DeepSpeed's ``zero_to_fp32`` assumes one partition group of the whole world; with expert parallelism the expert
sub-group is partitioned within an expert-data-parallel group (docs/zero3-ep.md) and each such group holds
other experts, so this module stitches them itself: expert adapters of EP rank ``k`` (megatron's layout,
tensor/pipeline parallel 1: rank ``g`` is EP rank ``g % EP``) hold experts ``[k*E/EP, (k+1)*E/EP)``; the full
stacking is ``lora_A`` rows and ``lora_B`` ``view(out, r, E_local)`` columns concatenated in EP-rank order.
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Dict, List, Tuple

import torch

from ..config import ModelConfig, require

__all__ = ["adapter_from_checkpoint", "zero3_parameters", "stitch_expert_adapter"]

_ZERO_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_ZERO_OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
_PLAIN_MODEL = "mp_rank_00_model_states.pt"
_EXPERT_FAMILY = "autoep_expert"
_EXPERT_ADAPTER = re.compile(r"(?:^|\.)experts\.(?:base_layer\.)*lora_([AB])\.")


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def zero3_parameters(engine_dir: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, List[torch.Tensor]]]:
    """Rebuild the trainable parameters of a ZeRO-3 checkpoint: ``(dense, experts)``, dense ``{name: tensor}``
    (partitioned over every rank) and experts ``{name: [the EP ranks' local tensors, in EP-rank order]}``."""
    ranks = sorted(int(m.group(1)) for f in glob.glob(os.path.join(engine_dir, "zero_pp_rank_*_mp_rank_00_optim_states.pt"))
                   if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))))
    require(ranks == list(range(len(ranks))) and ranks, "checkpoint", f"{engine_dir} does not hold the optimizer "
            f"states of ranks 0..N-1 (found ranks {ranks})")
    slices: Dict[Tuple[str, Tuple[int, ...]], Dict[int, torch.Tensor]] = {}  # (name, partition ranks) -> pieces
    shapes: Dict[str, torch.Size] = {}
    expert_groups: Dict[str, set] = {}
    for rank in ranks:
        shapes_of = _load(os.path.join(engine_dir, _ZERO_MODEL.format(rank)))["param_shapes"]
        optim = _load(os.path.join(engine_dir, _ZERO_OPTIM.format(rank)))["optimizer_state_dict"]
        flats, groups = optim["fp32_flat_groups"], optim["ds_zero_partition_groups"]
        require(len(flats) == len(groups) == len(shapes_of), "checkpoint", f"rank {rank}: {len(flats)} flat groups, "
                f"{len(groups)} partition groups and {len(shapes_of)} shape groups do not line up")
        for flat, group, names in zip(flats, groups, shapes_of):
            count, members = int(group["partition_count"]), tuple(group["partition_ranks"])
            sizes = [math.ceil(math.prod(s) / count) for s in names.values()]
            require(sum(sizes) == flat.numel(), "checkpoint", f"rank {rank} sub-group {group['sub_group']}: "
                    f"partitions of {sum(sizes)} elements expected, the flat group holds {flat.numel()}")
            offset = 0
            for (name, shape), size in zip(names.items(), sizes):
                slices.setdefault((name, members), {})[int(group["partition_rank"])] = flat[offset:offset + size]
                offset += size
                shapes[name] = shape
                if _EXPERT_FAMILY in group.get("families", ()):
                    expert_groups.setdefault(name, set()).add(members)
    dense, experts = {}, {}
    for (name, members), pieces in slices.items():
        require(sorted(pieces) == list(range(len(members))), "checkpoint", f"{name}: partitions {sorted(pieces)} "
                f"of {len(members)} found")
        full = torch.cat([pieces[i] for i in range(len(members))])[: math.prod(shapes[name])].view(shapes[name])
        if name in expert_groups:
            experts.setdefault(name, []).append((min(members), full))
        else:
            dense[name] = full.clone()
    ep_size = len(ranks) // max((len(m) for ms in expert_groups.values() for m in ms), default=len(ranks))
    out_experts = {}
    for name, parts in experts.items():
        parts.sort(key=lambda p: p[0])  # EP rank k's group starts at global rank k (megatron's order)
        require([p[0] for p in parts] == list(range(ep_size)), "checkpoint", f"{name}: expert-data-parallel groups "
                f"starting at ranks {[p[0] for p in parts]}, expected 0..{ep_size - 1}")
        out_experts[name] = [t.clone() for _, t in parts]
    return dense, out_experts


def stitch_expert_adapter(name: str, parts: List[torch.Tensor], r: int) -> torch.Tensor:
    """The full ``E`` stacking of an expert adapter of LoRA rank ``r`` from the EP ranks' local ones
    (``lora_A [r*E_local, in]`` rows, ``lora_B [out, r*E_local]`` expert-minor columns), in EP-rank order."""
    kind = _EXPERT_ADAPTER.search(name)
    require(kind is not None, "name", f"{name!r} is not an expert adapter")
    if kind.group(1) == "A":
        return torch.cat(parts)
    out = parts[0].shape[0]
    return torch.cat([p.reshape(out, r, -1) for p in parts], dim=2).reshape(out, -1)


def _peft_key(name: str, config: ModelConfig, backend: str) -> str:
    from ..weights.names import megatron_to_hf_name

    name = name.replace(".default.", ".")
    if backend == "megatron":
        return "base_model.model." + megatron_to_hf_name(name, config)
    return name


def adapter_from_checkpoint(run_dir: str, step: int, config: ModelConfig, backend: str, r: int
                            ) -> Dict[str, torch.Tensor]:
    """The adapter tensors of checkpoint ``step`` of the run under PEFT keys, experts stacked over all E (fp32
    master weights under ZeRO-3). ValueError naming the available steps if ``step`` has no complete checkpoint."""
    from ..training.checkpoint import step_name

    root = os.path.join(run_dir, "checkpoints")
    path = os.path.join(root, step_name(step))
    if not os.path.isfile(os.path.join(path, "COMPLETE")):
        found = sorted(int(d.split("-")[1]) for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if re.fullmatch(r"step-\d+", d) and os.path.isfile(os.path.join(root, d, "COMPLETE")))
        require(False, "step", f"the run has no complete checkpoint at step {step}; complete checkpoints: {found} "
                "(leave --step out to export the final adapter)")
    engine = os.path.join(path, "engine")
    if os.path.isfile(os.path.join(engine, _PLAIN_MODEL)):
        module = _load(os.path.join(engine, _PLAIN_MODEL))["module"]
        return {_peft_key(n, config, backend): t.detach().float().clone() for n, t in module.items() if ".lora_" in n}
    dense, experts = zero3_parameters(engine)
    out = {_peft_key(n, config, backend): t for n, t in dense.items() if ".lora_" in n}
    for name, parts in experts.items():
        out[_peft_key(name, config, backend)] = stitch_expert_adapter(name, parts, r)
    return out
