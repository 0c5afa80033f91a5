"""Expert parallelism applied to a model from outside it: ``apply_expert_parallel(model, layout)``, the one
place for the megatron model, the recipe's Hugging Face backend and ``moe_plugin.hf_trainer.MoETrainer``.

The model code stays single-device, and both faces run the one MoE forward (``layers.moe.LatentMoEMixin``);
expert parallelism is two things given to each MoE layer, the same on both faces: its experts are this rank's
(``ParallelLayout.experts_held``, the one rule) and its ``dispatch`` slot holds the expert-parallel all-to-all
(``megatron.expert_dispatch.ExpertParallelDispatch``, with the recipe's ``moe_overlap_chunks``).

* **megatron** (``megatron.specs.build_gpt_model`` under a started layout): megatron-core already built each
  MoE layer with this rank's ``E / EP`` experts from its parallel state; applying checks that they are the
  layout's and sets the dispatcher's chunks.
* **Hugging Face** (``MoEPluginForCausalLM`` or the image model): every ``StableLatentMoE``
  (``model.layers.{i}.block_sparse_moe``) keeps its router, latent projections, norm and shared experts (their
  loaded, possibly ZeRO-3 partitioned, weights are kept) and gets a ``StackedExperts`` of this rank's experts,
  tagged for ZeRO-3 within the expert-data-parallel group (``parallel.layout``); the parameter names do not
  change (``...block_sparse_moe.experts.w1`` is ``[E / EP, F, L]`` on each rank). A layout whose groups were not
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
from ..layers.stacked_experts import StackedExperts
from ..megatron.expert_tags import tag_expert_parameter
from ..megatron.latent_moe import LatentMoELayer
from ..megatron.expert_dispatch import ExpertParallelDispatch, dispatch_for
from .layout import ParallelLayout

__all__ = ["apply_expert_parallel", "expert_parallel_size"]

_WEIGHTS = ("w1", "w2", "w3")


def apply_expert_parallel(
    model: nn.Module, layout: ParallelLayout, checkpoint: Optional[str] = None, overlap_chunks: int = 1
) -> nn.Module:
    """Give ``model`` the expert parallelism of ``layout`` in place (module docstring); returns it.

    Collective: every rank calls it with the same arguments, after ``layout.start()`` and before the adapters
    are added. ``checkpoint``: where a Hugging Face model's ZeRO-3 partitioned experts are read again from
    (default: ``model.config._name_or_path``). ``overlap_chunks``: the dispatcher's chunks (the recipe's
    ``parallel.moe_overlap_chunks``; 1 = no overlap). The torch RNG state is left as it was.
    """
    require(
        layout.started or layout.expert == 1,
        "layout",
        f"expert parallelism {layout.expert} needs the layout's groups: call layout.start() first",
    )
    built = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoELayer)]
    if any(isinstance(m, StableLatentMoE) for m in model.modules()):
        if layout.started:  # the face asked for the expert groups (the recipe's hf backend does at EP > 1)
            _parallelize_hf_layers(model, layout, checkpoint, overlap_chunks)
        return model
    for name, layer in built:  # megatron built them from its parallel state: check it was this layout's
        first, last = layout.experts_held(layer.moe.num_experts)
        require(
            list(layer.local_expert_indices) == list(range(first, last)),
            f"{name}.experts",
            f"hold experts {list(layer.local_expert_indices)} of {layer.moe.num_experts}, but the layout's "
            f"expert parallelism {layout.expert} gives this rank [{first}, {last}): build the model after "
            "layout.start()",
        )
        layer.dispatch = dispatch_for(layout.expert_group, overlap_chunks)
    return model


def expert_parallel_size(model: nn.Module) -> int:
    """The expert-parallel size of ``model``'s MoE layers (1 if their dispatch stays on this device)."""
    for m in model.modules():
        if isinstance(getattr(m, "dispatch", None), ExpertParallelDispatch):
            return m.dispatch.size
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


def _parallelize_hf_layers(
    model: nn.Module, layout: ParallelLayout, checkpoint: Optional[str], overlap_chunks: int
) -> None:
    """Every ``StableLatentMoE`` of a Hugging Face model gets this rank's experts and the expert-parallel
    dispatch (module docstring)."""
    refuse_peft_model(model)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, StableLatentMoE)]
    require(bool(layers), "model", "has no StableLatentMoE layer to parallelize")
    model_config = model.config.to_model_config()
    index = None  # the checkpoint's index and shard headers, read at the first partitioned layer only
    for name, layer in layers:
        moe = layer.moe_config
        require(
            moe.expert_format == "dense",
            f"{name}.experts",
            f"are {moe.expert_format!r}: expert parallelism "
            "of the Hugging Face model takes dense experts (the megatron backend also takes packed ones)",
        )
        require(
            moe.num_experts % layout.expert == 0,
            "ep_size",
            f"must divide the number of experts ({moe.num_experts}) of {name}, got {layout.expert}",
        )
        first, last = layout.experts_held(moe.num_experts)
        experts = layer.experts
        with torch.random.fork_rng(devices=[]):  # the new experts' draws are overwritten below
            mine = StackedExperts(
                last - first,
                moe.expert_dim,
                moe.expert_intermediate_size,
                moe.activation,
                moe.situ_beta,
                moe.situ_linear_beta,
                dtype=experts.w1.dtype,
                device=experts.w1.device,
                first_expert=first,
            )
        for p in mine.parameters():
            tag_expert_parameter(p, layout.expert, layout.expert_data_group)
        ours = {f"{name}.experts.{w}": getattr(mine, w) for w in _WEIGHTS}
        if is_zero3_param(experts.w1):
            path = _checkpoint_of(model, checkpoint)
            index = _checkpoint_index(path) if index is None else index
            _load_local_experts(ours, first, last, path, model_config, index)
            # partitioned as zero.Init does, within the group the tags name (the expert-data-parallel group)
            partition_like(experts.w1, mine.parameters())
        else:
            with torch.no_grad():
                for w in _WEIGHTS:
                    getattr(mine, w).copy_(getattr(experts, w)[first:last])
        layer.experts = mine
        layer.dispatch = dispatch_for(layout.expert_group, overlap_chunks)
