"""The layout-free part of a checkpoint: every trainable tensor with its AdamW moments and step, and the
learning-rate schedule, whole and under global names, so that a run resumes at another world size or
expert-parallel size (docs/training.md, "Resume anywhere").

Files (rank 0 writes them; every rank takes part in the gathers):

* ``trainable.safetensors``: for every trainable parameter ``N`` (the model's own name; expert tensors stacked
  over all ``E`` experts in global order, the layout of one process): ``N`` (fp32 value), ``N:exp_avg`` and
  ``N:exp_avg_sq`` (AdamW's moments, fp32); and the buffers training changes (full training moves each router's
  ``e_score_correction_bias``), under their names. Whole tensors rather than torch.distributed.checkpoint's slices with
  offsets: for LoRA the state is small (the planner's counts put the seed layout's adapters and moments at a few
  GB), one process can read it with no knowledge of the writer (``moe-plugin export --step``), and resharding is
  slicing the expert dimension and re-partitioning, both already this project's own code.
* ``trainable.json``: the format, the AdamW step, the scheduler's state, those buffers' names, the layout that
  wrote it (``world``, ``expert``, ``context``, ``data``, the global batch in rows) and the engine
  (``sharding``: ``zero3`` or ``fsdp2``, ``training/engines``). It is the whole checkpoint of an FSDP2 run, and
  what a run resumes from under the other engine.

Every tensor is read and written through the engine (``Engine.whole_fp32``/``set_whole``): DeepSpeed's fp32
partitions and optimizer state, FSDP2's ``DTensor`` shards.

The data position (rows of the epoch consumed, a global count), the losses and the RNG are the trainer's state
files (``trainer_state.write_trainer_state``); rank 0's are read at another layout. Nothing here is pickled.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..compat.deepspeed import adam_states, stepped_tensors
from ..config import require
from ..expert_adapters import adapter_factor, slice_experts
from ..fileio import read_json
from ..parallel.grad_reduce import is_expert_parameter

__all__ = [
    "TENSORS",
    "META",
    "FORMAT",
    "gather_trainable",
    "layout_free_state",
    "write_trainable",
    "read_trainable_meta",
    "read_trainable",
    "restore_trainable",
    "follow_schedule",
]

TENSORS, META, FORMAT = "trainable.safetensors", "trainable.json", 1
MOMENTS = ("exp_avg", "exp_avg_sq")


def _trainable(module: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in module.named_parameters() if p.requires_grad)


def _whole_experts(name: str, p: nn.Parameter, value: torch.Tensor, ep: int, r: int) -> torch.Tensor:
    """``value`` of an expert parameter, all-gathered over the expert-parallel group (collective at EP > 1)."""
    if ep == 1 or not is_expert_parameter(p):
        return value
    from ..megatron.expert_gather import all_gather_expert

    return all_gather_expert(name, value, r)


def gather_trainable(engine, layout, r: int, buffers=()) -> Dict[str, torch.Tensor]:
    """Every trainable tensor of ``engine``'s model and its moments, whole (module docstring; each through the
    engine's ``whole_fp32``), and the named ``buffers`` that training changes (full training moves the routers'
    selection bias). Collective."""
    module = engine.module
    named_buffers = dict(module.named_buffers())
    out = {name: named_buffers[name].detach().float().cpu().clone() for name in buffers}
    for name, p in _trainable(module):
        for key, value in zip(("",) + tuple(":" + k for k in MOMENTS), engine.whole_fp32(p)):
            out[name + key] = _whole_experts(name, p, value, layout.expert, r)
    return out


def layout_free_state(engine, layout, r: int, global_batch: int, buffers=()) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """What ``write_trainable`` writes for ``engine`` now: the tensors (``gather_trainable``, collective; with the
    named ``buffers`` training changes) and the metadata (the AdamW step, the scheduler, the buffers' names, the
    layout and the global batch in rows)."""
    tensors = gather_trainable(engine, layout, r, buffers)
    steps = [s["step"] for s in adam_states(engine.optimizer).values() if "step" in s]
    adam_step = int(steps[0]) if steps else engine.optimizer_steps
    meta = {
        "adam_step": adam_step,
        "scheduler": engine.lr_scheduler.state_dict(),
        "buffers": list(buffers),
        "layout": {
            "world": layout.world,
            "expert": layout.expert,
            "context": layout.context,
            "data": layout.data,
            "global_batch": global_batch,
        },
        "sharding": engine.name,
    }
    return tensors, meta


def write_trainable(directory: str, tensors: Dict[str, torch.Tensor], meta: Dict) -> None:
    """Rank 0: the two files of the module docstring into ``directory`` (a checkpoint being staged)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, TENSORS))
    with open(os.path.join(directory, META), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **meta}, f)


def read_trainable_meta(directory: str) -> Dict:
    """``trainable.json`` of a checkpoint, checked; ValueError naming the file when it is not one."""
    path = os.path.join(directory, META)
    fix = f"the checkpoint is damaged: remove {directory} to resume from an earlier one"
    meta = read_json(path, fix)
    layout = meta.get("layout") if isinstance(meta, dict) else None
    require(
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and isinstance(meta.get("adam_step"), int)
        and isinstance(meta.get("scheduler"), dict)
        and isinstance(layout, dict)
        and all(isinstance(layout.get(k), int) for k in ("world", "expert", "data", "global_batch")),
        path,
        f"not a layout-free state (format {FORMAT}: adam_step, scheduler, layout); {fix}",
    )
    return meta


def read_trainable(directory: str) -> Dict[str, torch.Tensor]:
    """``trainable.safetensors`` of a checkpoint; ValueError naming the file when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(directory, TENSORS)
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError) as err:
        raise ValueError(
            f"{path}: not a readable safetensors file ({err}); the checkpoint is damaged: remove "
            f"{directory} to resume from an earlier one"
        ) from None


def _local(name: str, p: nn.Parameter, value: torch.Tensor, layout, r: int) -> torch.Tensor:
    """This rank's experts of a whole expert tensor (the rest as given)."""
    if layout.expert == 1 or not is_expert_parameter(p):
        return value
    factor = adapter_factor(name)
    if factor is None:  # a base expert stack [E, ...]
        first, last = layout.experts_held(value.shape[0])
        return value[first:last]
    experts = value.shape[0 if factor == "A" else 1] // r
    first, last = layout.experts_held(experts)
    return slice_experts(value, factor, first, last, experts)


def _start_adam_states(optimizer) -> None:
    """AdamW's state of every tensor it steps, as its first step creates it (step 0, zero moments), where it does
    not exist yet: a fresh engine's optimizer has none, and DeepSpeed writes moments into existing state."""
    states = adam_states(optimizer)
    for t in stepped_tensors(optimizer):
        if not states.get(t):
            states[t] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}


@torch.no_grad()
def restore_trainable(engine, tensors: Dict[str, torch.Tensor], meta: Dict, layout, r: int) -> None:
    """Write ``read_trainable``'s tensors into this rank's parameters, partitions and AdamW state of ``engine``
    (its ``set_whole``), resharded to ``layout``, and restore the step and the schedule. ValueError naming what
    does not fit (another model or adapter)."""
    module, optimizer, scheduler = engine.module, engine.optimizer, engine.lr_scheduler
    _start_adam_states(optimizer)
    named_buffers, buffers = dict(module.named_buffers()), list(meta.get("buffers", []))
    for name in buffers:
        require(
            name in named_buffers,
            "checkpoint",
            f"holds the buffer {name}, which this model does not have; resume with the same model section",
        )
        named_buffers[name].copy_(tensors[name])
    names = {n for n, _ in _trainable(module)}
    saved = {k for k in tensors if ":" not in k} - set(buffers)
    require(
        saved == names,
        "checkpoint",
        f"holds the trainable tensors of another model or adapter "
        f"({len(saved ^ names)} names differ, e.g. {sorted(saved ^ names)[:2]}); resume with the same "
        "model and lora sections",
    )
    for name, p in _trainable(module):
        full = [_local(name, p, tensors[name + key], layout, r) for key in ("", ":exp_avg", ":exp_avg_sq")]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        require(
            tuple(full[0].shape) == shape,
            name,
            f"is {list(full[0].shape)} in the checkpoint but "
            f"{list(shape)} in this run; resume with the same model and lora sections",
        )
        engine.set_whole(p, full[0], (full[1], full[2]), meta["adam_step"])
    for state in adam_states(optimizer).values():  # the flat partitions of ZeRO, and every plain-AdamW state
        if "step" in state:
            step = state["step"]
            state["step"] = (
                torch.full_like(step, float(meta["adam_step"])) if torch.is_tensor(step) else meta["adam_step"]
            )
    scheduler.load_state_dict(dict(meta["scheduler"]))
    follow_schedule(optimizer, scheduler)
    dist.barrier()


def follow_schedule(optimizer, scheduler) -> None:
    """Set each parameter group's learning rate to the schedule's value at its restored step, computed as
    ``LambdaLR`` computes it (so bitwise the saved rate when the schedule is unchanged). A run resumed with more
    ``schedule.steps`` thus continues on the schedule of the new length: a constant one as if it had been one
    longer run, a cosine decay from the new curve's value at that step."""
    lrs = [base * lam(scheduler.last_epoch) for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
