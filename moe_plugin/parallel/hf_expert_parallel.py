"""Expert parallelism for the Hugging Face model, applied from outside it (docs/hf-trainer.md section 3).

``parallelize_experts(model, ep_size)`` turns every ``StableLatentMoE`` (``model.layers.{i}.block_sparse_moe``)
of a single-device ``MoEPluginForCausalLM`` into the megatron path's own layer: a ``LatentMoELayer``
(``moe_plugin.megatron.latent_moe``) with megatron-core's all-to-all token dispatcher over megatron's
expert-parallel group, holding only this rank's ``E / EP`` contiguous experts (``MegatronStackedExperts``,
tagged for ZeRO-3 within the expert-data-parallel group, docs/zero3-ep.md). The router, the latent
projections, the norm and the shared experts are the Hugging Face layer's own modules, moved over (so their
loaded, possibly ZeRO-3 partitioned, weights are kept); the model code stays single-device and the parameter
names do not change (``...block_sparse_moe.experts.w1`` is ``[E / EP, F, L]`` on each rank).

Where the local experts' values come from:

* experts held whole (one process, or a model built without ``deepspeed.zero.Init``): this rank's rows of them;
* experts ZeRO-3 partitioned over all ranks (``from_pretrained`` under the Trainer's ``deepspeed=`` config,
  which wraps it in ``zero.Init``): read again, only this rank's rows, from the checkpoint
  (``moe_plugin.weights``, the loader of the recipe trainer's backends), then partitioned within the
  expert-data-parallel group. No rank gathers a whole expert stack.

After ``get_peft_model``, ``prepare_expert_adapters(model, seed)`` marks and tags the expert adapters (peft
``target_parameters`` on ``experts.w1/w2/w3``) and draws each expert's ``lora_A`` by its global index, so EP=n
starts as EP=1. ``adapter_state(model)`` is the whole adapter (ZeRO-3 gathered, expert adapters all-gathered
over the expert-parallel group): what ``moe_plugin.hf_trainer.MoETrainer`` saves.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..compat.deepspeed import is_zero3_param, partition_like
from ..config import require
from ..layers.moe import StableLatentMoE
from ..megatron.latent_moe import LatentMoELayer
from .zero3_ep import create_deepspeed_expert_groups, tag_expert_parameters

__all__ = ["parallelize_experts", "expert_parallel_size", "prepare_expert_adapters", "adapter_state",
           "ExpertParallelMoE"]

_WEIGHTS = ("w1", "w2", "w3")


class ExpertParallelMoE(LatentMoELayer):
    """``LatentMoELayer`` with ``StableLatentMoE``'s calling convention: ``forward(hidden_states [B, T, hidden],
    padding_mask [B, T] bool, True = padding) -> (y [B, T, hidden], load [E])``, load this call's detached
    token copies per global expert of this rank's tokens (zeros when none was recorded)."""

    def _record_load(self, load: torch.Tensor) -> None:
        self._call_load = load
        super()._record_load(load)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        self._call_load = None
        # megatron's layers are sequence-first
        y, _ = super().forward(hidden_states.transpose(0, 1), padding_mask=padding_mask)
        load = self._call_load
        if load is None:
            load = torch.zeros(self.moe.num_experts, device=hidden_states.device)
        return y.transpose(0, 1).contiguous(), load


def expert_parallel_size(model: nn.Module) -> int:
    """The expert-parallel size ``parallelize_experts`` gave ``model`` (1 if it was not parallelized)."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            return int(m.token_dispatcher.ep_size)
    return 1


def _prepare_groups(ep_size: int, device: Optional[str]) -> None:
    from .distributed import initialize_megatron, prepare_device, prepared_device

    require(dist.is_available() and dist.is_initialized(), "torch.distributed",
            "must be started before parallelize_experts (create the TrainingArguments first, or call "
            "moe_plugin.parallel.distributed.init_distributed)")
    world = dist.get_world_size()
    require(isinstance(ep_size, int) and not isinstance(ep_size, bool) and ep_size >= 1 and world % ep_size == 0,
            "ep_size", f"must be a positive integer dividing the world size {world}, got {ep_size!r}")
    if device is not None:
        prepare_device(device)
    require(prepared_device() is not None, "device",
            "is needed: pass device=\"cpu\" (gloo, applies the CPU stand-ins megatron-core needs) or \"cuda\"")
    from megatron.core import parallel_state

    if not (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_expert_model_parallel_world_size() == ep_size):
        initialize_megatron(expert_model_parallel_size=ep_size, seed=None)  # seed=None: the RNG is the user's
    create_deepspeed_expert_groups(ep_size)


def _checkpoint_of(model: nn.Module, checkpoint: Optional[str]) -> str:
    path = checkpoint or getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    found = bool(path) and os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))
    require(found, "checkpoint", f"the experts are ZeRO-3 partitioned over all ranks, so this rank's experts are "
            f"read again from the checkpoint, but {path!r} is not a directory of safetensors; pass "
            "checkpoint=<the directory given to from_pretrained>")
    return path


def _checkpoint_index(path: str) -> Tuple[dict, dict]:
    """The checkpoint's weight map and every shard's stored tensors (its header), read once per model."""
    from ..fileio import safetensors_weight_map
    from ..weights.plan import stored_tensors

    weight_map = safetensors_weight_map(path)
    return weight_map, stored_tensors(weight_map)


@torch.no_grad()
def _load_local_experts(named: Dict[str, torch.Tensor], first: int, last: int, path: str, model_config,
                        index: Tuple[dict, dict]) -> None:
    """Rows ``[first, last)`` of the stacked expert tensors ``named`` (Hugging Face names -> this rank's whole
    ``[E_local, ...]`` tensors) from checkpoint ``path``, through the recipe trainer's loader (any layout);
    ``index``: ``_checkpoint_index(path)``."""
    from safetensors import safe_open

    from ..weights.loader import LoadStats, run_reads
    from ..weights.plan import Target, plan_reads

    weight_map, stored = index
    targets = {n: Target(tuple(t.shape), (first, last)) for n, t in named.items()}
    # strict=False: every other checkpoint tensor is the rest of the model, already loaded
    plan = plan_reads(targets, weight_map, names="hf", config=model_config, strict=False, stored=stored,
                      source=path)
    run_reads(plan, named, targets, lambda f: safe_open(f, framework="pt"), LoadStats())


def parallelize_experts(model: nn.Module, ep_size: int, device: Optional[str] = None,
                        checkpoint: Optional[str] = None) -> nn.Module:
    """Give ``model``'s MoE layers expert parallelism of size ``ep_size`` in place (module docstring); returns it.

    Collective: every rank calls it with the same arguments, after torch.distributed is up (the Trainer's
    ``TrainingArguments`` start it) and before ``get_peft_model``. Starts megatron-core's parallel state
    (expert-parallel groups of ``ep_size`` consecutive ranks) and DeepSpeed's expert groups (checked equal).
    device: "cpu" or "cuda" when the process was not prepared yet (``parallel.distributed.prepare_device``).
    checkpoint: where ZeRO-3 partitioned experts are read again from (default: ``model.config._name_or_path``).
    The torch RNG state is left as it was.
    """
    require(not hasattr(model, "peft_config"), "model", "already has peft adapters; call parallelize_experts "
            "before get_peft_model, so that the expert adapters are made for this rank's experts")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, StableLatentMoE)]
    require(bool(layers), "model", "has no StableLatentMoE layer to parallelize")
    _prepare_groups(ep_size, device)
    from megatron.core import parallel_state

    from ..megatron.specs import transformer_config

    model_config = model.config.to_model_config()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    index = None  # the checkpoint's index and shard headers, read at the first partitioned layer only
    for name, old in layers:
        moe = old.moe_config
        require(moe.expert_format == "dense", f"{name}.experts", f"are {moe.expert_format!r}: expert parallelism "
                "of the Hugging Face model takes dense experts (the megatron backend also takes packed ones)")
        require(moe.num_experts % ep_size == 0, "ep_size",
                f"must divide the number of experts ({moe.num_experts}) of {name}, got {ep_size}")
        experts = old.experts
        tc = transformer_config(model_config, use_cpu_initialization=True, params_dtype=experts.w1.dtype)
        with torch.random.fork_rng(devices=[]):  # the new layer's draws are overwritten below
            new = ExpertParallelMoE(tc, moe, layer_number=_layer_number(name))
        for child in ("gate", "routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj",
                      "shared_experts"):
            if child in old._modules or child in new._modules:
                setattr(new, child, old._modules.get(child))
        local = new.num_local_experts
        first, last = ep_rank * local, (ep_rank + 1) * local
        ours = {f"{name}.experts.{w}": getattr(new.experts, w) for w in _WEIGHTS}
        if is_zero3_param(experts.w1):
            path = _checkpoint_of(model, checkpoint)
            index = _checkpoint_index(path) if index is None else index
            _load_local_experts(ours, first, last, path, model_config, index)
            # partitioned as zero.Init does, within the group the tags name (the expert-data-parallel group)
            partition_like(experts.w1, new.experts.parameters())
        else:
            for w in _WEIGHTS:
                getattr(new.experts, w).data.copy_(getattr(experts, w).data[first:last])
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new.train(old.training))
    return model


def _layer_number(name: str) -> Optional[int]:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b) + 1  # megatron counts layers from 1
    return None


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
        tag_expert_parameters(model)
    return drawn


@torch.no_grad()
def adapter_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The whole adapter of peft ``model`` under ``model.state_dict()``'s names (``...lora_A.default.weight``):
    ZeRO-3 partitions gathered, expert adapters all-gathered over the expert-parallel group into the full ``E``
    stacking. Collective: every rank calls it."""
    from ..expert_adapters import adapter_factor
    from ..megatron.expert_gather import all_gather_expert_adapter
    from .zero3_gather import gathered

    ep = expert_parallel_size(model)
    named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    out = {}
    with gathered([p for _, p in named]):
        for n, p in named:
            value = p.detach().clone()
            if ep > 1 and getattr(p, "allreduce", True) is False:
                factor = adapter_factor(n)
                require(factor is not None, "model", f"{n} carries the expert mark but is not an expert adapter "
                        "(experts...lora_A/lora_B); only prepare_expert_adapters should mark parameters")
                value = all_gather_expert_adapter(value, factor, _lora_rank(model, n))
            out[n] = value
    return out


def _lora_rank(model: nn.Module, name: str) -> int:
    adapter = name.split(".lora_")[1].split(".")[1]
    return int(model.peft_config[adapter].r)
