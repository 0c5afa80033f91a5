"""Rank-side code of the packed-experts trainer tests (run by run_distributed; nothing here asserts).

Each scenario builds the product's ``Trainer`` from a recipe dict over a K3-format checkpoint (packed, or its
dequantised fp32 twin), takes the logits of one fixed batch (the same tokens on every rank, so every layout
must give the same logits), runs one training step capturing the full adapter gradients
(``trainer_workers._full_grads``), and returns those with the loss, the resident bytes and dtypes of the
packed expert tensors after the engine was built, and, for packed runs, this rank's packed bytes gathered; and
the step's router calls per MoE layer and expert loads (the activation-checkpointing runs compare them).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.training.trainer_workers import _count_router_calls, _full_grads


def _packed_modules(module):
    return [m for m in module.modules() if getattr(m, "is_packed", False)]


def _logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, ids.numel()], dtype=torch.int32)
    if trainer.backend.name == "hf":
        with torch.no_grad():
            return trainer.engine.module(input_ids=ids, cu_seqlens=cu.long()).logits.detach().float().clone()
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=ids.numel(), max_seqlen_kv=ids.numel()
    )
    module = trainer.engine.module
    with torch.no_grad():
        return module(ids, None, None, packed_seq_params=params).detach().float().clone()


def _resident(module) -> dict:
    """Per packed tensor: (bytes resident on this rank, full bytes, dtype name)."""
    out = {}
    for m in _packed_modules(module):
        for name, p in m.named_parameters(recurse=False):
            local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
            full = getattr(p, "ds_numel", p.numel())
            out[f"{m.first_expert}:{id(m)}:{name}"] = (
                local.numel() * local.element_size(),
                full * p.element_size(),
                str(p.dtype),
            )
    return out


def _gathered_packed(trainer) -> list:
    from moe_plugin.parallel.zero3_gather import gathered

    out = []
    for m in _packed_modules(trainer.engine.module):
        params = [p for _, p in m.named_parameters(recurse=False)]
        with gathered(params):
            out.append((m.first_expert, {n: p.detach().clone() for n, p in m.named_parameters(recurse=False)}))
    return out


def run_packed(scenarios: list) -> dict:
    """``[{"name", "recipe", "ids": [T] token ids}]`` -> ``{name: result}``."""
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    results = {}
    for scenario in scenarios:
        recipe = recipe_from_dict(copy.deepcopy(scenario["recipe"]))
        with Trainer(recipe) as trainer:
            module = trainer.engine.module
            result = {
                "logits": _logits(trainer, torch.tensor(scenario["ids"]).view(1, -1)),
                "resident": _resident(module),
                "packed": _gathered_packed(trainer),
            }
            grads = {}
            calls, hooks = _count_router_calls(trainer)  # after the logits' forward: the step's calls only
            result["loss"] = trainer.train_step(on_gradients=lambda grads=grads: grads.update(_full_grads(trainer)))
            for hook in hooks:
                hook.remove()
            result.update(grads=grads, router_calls=calls, loads=trainer.last_loads.clone())
        results[scenario["name"]] = result
        dist.barrier()
    return results
