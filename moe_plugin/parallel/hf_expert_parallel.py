"""Expert parallelism for the Hugging Face Trainer (docs/hf-trainer.md section 3): the user's side of
``parallel.expert_parallel.apply_expert_parallel``.

``parallelize_experts(model, ep_size)`` builds the ``ParallelLayout`` of the Trainer's processes with that
expert-parallel size, starts its groups (unless this process started that layout already) and applies it to the
single-device model (``apply_expert_parallel``: each ``StableLatentMoE`` keeps this rank's ``E / EP`` experts
and dispatches over the expert-parallel group). After ``get_peft_model``, ``prepare_expert_adapters(model, seed)`` draws
each expert's ``lora_A`` by its global index, so EP=n starts as EP=1, and marks and tags the expert adapters.
``adapter_state(model)`` is the whole adapter (ZeRO-3 gathered, expert adapters all-gathered over the
expert-parallel group): what ``moe_plugin.hf_trainer.MoETrainer`` saves, and what the recipe trainer's
Hugging Face backend writes.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import require
from .expert_parallel import apply_expert_parallel, expert_parallel_size, refuse_peft_model
from .layout import ParallelLayout, started_layout

__all__ = [
    "parallelize_experts",
    "expert_parallel_size",
    "prepare_expert_adapters",
    "adapter_state",
    "whole_experts",
]


def parallelize_experts(
    model: nn.Module, ep_size: int, device: Optional[str] = None, checkpoint: Optional[str] = None
) -> nn.Module:
    """Give ``model``'s MoE layers expert parallelism of size ``ep_size`` in place; returns it.

    Collective: every rank calls it with the same arguments, after torch.distributed is up (the Trainer's
    ``TrainingArguments`` start it) and before ``get_peft_model``. Starts megatron-core's parallel state
    (expert-parallel groups of ``ep_size`` consecutive ranks) and DeepSpeed's expert groups, checked equal
    (``ParallelLayout.start``). device: "cpu" or "cuda" when the process was not prepared yet
    (``parallel.distributed.prepare_device``). checkpoint: where ZeRO-3 partitioned experts are read again from
    (default: ``model.config._name_or_path``). The torch RNG state is left as it was.
    """
    from .distributed import prepare_device, prepared_device

    refuse_peft_model(model)  # before any group starts
    require(
        dist.is_available() and dist.is_initialized(),
        "torch.distributed",
        "must be started before parallelize_experts (create the TrainingArguments first, or call "
        "moe_plugin.parallel.distributed.init_distributed)",
    )
    world = dist.get_world_size()
    require(
        isinstance(ep_size, int) and not isinstance(ep_size, bool) and ep_size >= 1 and world % ep_size == 0,
        "ep_size",
        f"must be a positive integer dividing the world size {world}, got {ep_size!r}",
    )
    if device is not None:
        prepare_device(device)
    require(
        prepared_device() is not None,
        "device",
        'is needed: pass device="cpu" (gloo, applies the CPU stand-ins megatron-core needs) or "cuda"',
    )
    layout = started_layout()
    if layout is None or layout != ParallelLayout(world=world, expert=ep_size):
        layout = ParallelLayout(world=world, expert=ep_size).start(seed=None)  # seed=None: the RNG is the user's
    return apply_expert_parallel(model, layout, checkpoint)


def prepare_expert_adapters(model: nn.Module, seed: int) -> int:
    """After ``get_peft_model``: draw every routed-expert ``lora_A`` block by (seed, layer, weight, global expert)
    (``lora.init_expert_adapters``, the recipe trainer's draw), so EP=n starts as EP=1, and
    on an expert-parallel model mark and tag the expert adapters as expert parameters (docs/zero3-ep.md).
    Call it with the same seed on every rank and in the one-process run compared with; returns the blocks drawn."""
    from ..lora import init_expert_adapters, mark_expert_adapters
    from ..precision import apply_precision

    drawn = init_expert_adapters(model, seed)
    apply_precision(model)  # the base is frozen now: its fp32 tensors become fp32 buffers (docs/precision.md)
    if expert_parallel_size(model) > 1:
        mark_expert_adapters(model)
        started_layout().tag_expert_parameters(model, zero3=True)
    return drawn


@torch.no_grad()
def adapter_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The whole adapter of peft ``model`` under ``model.state_dict()``'s names (``...lora_A.default.weight``):
    ZeRO-3 partitions gathered, expert adapters all-gathered over the expert-parallel group into the full ``E``
    stacking. Collective: every rank calls it."""
    from .zero3_gather import gathered

    named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    with gathered([p for _, p in named]):
        return whole_experts(model, {n: p.detach().clone() for n, p in named})


@torch.no_grad()
def whole_experts(model: nn.Module, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``tensors`` (adapter names of ``model`` -> this rank's whole values, e.g. gathered adapters or their
    gradients) with every expert adapter all-gathered over the expert-parallel group into the full ``E``
    stacking; the rest as given. Collective at EP > 1."""
    from ..expert_adapters import adapter_factor
    from ..megatron.expert_gather import all_gather_expert

    ep, params = expert_parallel_size(model), dict(model.named_parameters())
    out = {}
    for n, value in tensors.items():
        if ep > 1 and getattr(params[n], "allreduce", True) is False:
            require(
                adapter_factor(n) is not None,
                "model",
                f"{n} carries the expert mark but is not an expert adapter "
                "(experts...lora_A/lora_B); only prepare_expert_adapters should mark parameters",
            )
            value = all_gather_expert(n, value, _lora_rank(model, n))
        out[n] = value
    return out


def _lora_rank(model: nn.Module, name: str) -> int:
    adapter = name.split(".lora_")[1].split(".")[1]
    return int(model.peft_config[adapter].r)
