"""Expert parallelism applied to a model from outside it: ``apply_expert_parallel(model, layout)``, the one
place for the megatron model, the recipe's Hugging Face backend and ``moe_plugin.hf_trainer.MoETrainer``.

The model code stays single-device. What applying does depends on the face:

* **megatron** (``megatron.specs.build_gpt_model`` under a started layout): megatron-core already built each
  MoE layer with this rank's ``E / EP`` experts from its parallel state; applying checks that they are the
  layout's.
* **Hugging Face** (``MoEPluginForCausalLM`` or the image model): every ``StableLatentMoE``
  (``model.layers.{i}.block_sparse_moe``) becomes the megatron path's own layer, an ``ExpertParallelMoE``
  (``moe_plugin.megatron.latent_moe.LatentMoELayer`` with megatron-core's all-to-all token dispatcher over the
  layout's expert-parallel group), holding only this rank's contiguous experts (``MegatronStackedExperts``,
  tagged for ZeRO-3 within the expert-data-parallel group, ``parallel.layout``). The router, the latent
  projections, the norm and the shared experts are the Hugging Face layer's own modules, moved over (so their
  loaded, possibly ZeRO-3 partitioned, weights are kept); the parameter names do not change
  (``...block_sparse_moe.experts.w1`` is ``[E / EP, F, L]`` on each rank). A layout whose groups were not
  started (the recipe's Hugging Face backend without expert parallelism) leaves the model as it is.

Where the local experts' values come from (Hugging Face face):

* experts held whole (one process, or a model built without ``deepspeed.zero.Init``): this rank's rows of them;
* experts ZeRO-3 partitioned over all ranks (built under ``zero.Init``): read again, only this rank's rows, from
  the checkpoint (``moe_plugin.weights``, the loader of the recipe trainer's backends), then partitioned within
  the expert-data-parallel group. No rank gathers a whole expert stack.

After the adapters are added, ``ParallelLayout.tag_expert_parameters`` tags the expert adapters too.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..compat.deepspeed import is_zero3_param, partition_like
from ..config import require
from ..layers.moe import StableLatentMoE
from ..megatron.latent_moe import LatentMoELayer
from .layout import ParallelLayout

__all__ = ["apply_expert_parallel", "expert_parallel_size", "ExpertParallelMoE"]

_WEIGHTS = ("w1", "w2", "w3")


def apply_expert_parallel(model: nn.Module, layout: ParallelLayout, checkpoint: Optional[str] = None) -> nn.Module:
    """Give ``model`` the expert parallelism of ``layout`` in place (module docstring); returns it.

    Collective: every rank calls it with the same arguments, after ``layout.start()`` and before the adapters
    are added. ``checkpoint``: where a Hugging Face model's ZeRO-3 partitioned experts are read again from
    (default: ``model.config._name_or_path``). The torch RNG state is left as it was.
    """
    require(
        layout.started or layout.expert == 1,
        "layout",
        f"expert parallelism {layout.expert} needs the layout's groups: call layout.start() first",
    )
    built = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoELayer)]
    if any(isinstance(m, StableLatentMoE) for m in model.modules()):
        if layout.started:  # the face asked for the expert groups (the recipe's hf backend does at EP > 1)
            _parallelize_hf_layers(model, layout, checkpoint)
        return model
    for name, layer in built:  # megatron built them from its parallel state: check it was this layout's
        require(
            layer.num_local_experts * layout.expert == layer.moe.num_experts,
            f"{name}.experts",
            f"hold {layer.num_local_experts} of {layer.moe.num_experts} experts, but the layout's expert "
            f"parallelism is {layout.expert}: build the model after layout.start()",
        )
    return model


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
    """The expert-parallel size ``apply_expert_parallel`` gave a Hugging Face ``model`` (1 if it was not
    parallelized)."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            return int(m.token_dispatcher.ep_size)
    return 1


def _checkpoint_of(model: nn.Module, checkpoint: Optional[str]) -> str:
    path = checkpoint or getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    found = bool(path) and os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))
    require(
        found,
        "checkpoint",
        f"the experts are ZeRO-3 partitioned over all ranks, so this rank's experts are "
        f"read again from the checkpoint, but {path!r} is not a directory of safetensors; pass "
        "checkpoint=<the directory given to from_pretrained>",
    )
    return path


def _checkpoint_index(path: str) -> Tuple[dict, dict]:
    """The checkpoint's weight map and every shard's stored tensors (its header), read once per model."""
    from ..fileio import safetensors_weight_map
    from ..weights.plan import stored_tensors

    weight_map = safetensors_weight_map(path)
    return weight_map, stored_tensors(weight_map)


@torch.no_grad()
def _load_local_experts(
    named: Dict[str, torch.Tensor], first: int, last: int, path: str, model_config, index: Tuple[dict, dict]
) -> None:
    """Rows ``[first, last)`` of the stacked expert tensors ``named`` (Hugging Face names -> this rank's whole
    ``[E_local, ...]`` tensors) from checkpoint ``path``, through the recipe trainer's loader (any layout);
    ``index``: ``_checkpoint_index(path)``."""
    from safetensors import safe_open

    from ..weights.loader import LoadStats, run_reads
    from ..weights.plan import Target, plan_reads

    weight_map, stored = index
    targets = {n: Target(tuple(t.shape), (first, last)) for n, t in named.items()}
    # strict=False: every other checkpoint tensor is the rest of the model, already loaded
    plan = plan_reads(targets, weight_map, names="hf", config=model_config, strict=False, stored=stored, source=path)
    run_reads(plan, named, targets, lambda f: safe_open(f, framework="pt"), LoadStats())


def refuse_peft_model(model: nn.Module) -> None:
    """Expert parallelism comes before ``get_peft_model``: the expert adapters are made for this rank's experts."""
    require(
        not hasattr(model, "peft_config"),
        "model",
        "already has peft adapters; apply expert parallelism (parallelize_experts) "
        "before get_peft_model, so that the expert adapters are made for this rank's experts",
    )


def _parallelize_hf_layers(model: nn.Module, layout: ParallelLayout, checkpoint: Optional[str]) -> None:
    """Every ``StableLatentMoE`` of a Hugging Face model becomes an ``ExpertParallelMoE`` holding this rank's
    experts (module docstring)."""
    refuse_peft_model(model)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, StableLatentMoE)]
    require(bool(layers), "model", "has no StableLatentMoE layer to parallelize")
    from ..megatron.specs import transformer_config

    model_config = model.config.to_model_config()
    ep_size, ep_rank = layout.expert, layout.ep_rank
    index = None  # the checkpoint's index and shard headers, read at the first partitioned layer only
    for name, old in layers:
        moe = old.moe_config
        require(
            moe.expert_format == "dense",
            f"{name}.experts",
            f"are {moe.expert_format!r}: expert parallelism "
            "of the Hugging Face model takes dense experts (the megatron backend also takes packed ones)",
        )
        require(
            moe.num_experts % ep_size == 0,
            "ep_size",
            f"must divide the number of experts ({moe.num_experts}) of {name}, got {ep_size}",
        )
        experts = old.experts
        tc = transformer_config(model_config, use_cpu_initialization=True, params_dtype=experts.w1.dtype)
        with torch.random.fork_rng(devices=[]):  # the new layer's draws are overwritten below
            new = ExpertParallelMoE(tc, moe, layer_number=_layer_number(name))
        for child in (
            "gate",
            "routed_expert_down_proj",
            "routed_expert_norm",
            "routed_expert_up_proj",
            "shared_experts",
        ):
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
