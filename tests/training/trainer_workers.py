"""Rank-side code of the trainer tests, run by moe_plugin.testing.launch.run_distributed.

Each scenario builds the product's ``Trainer`` from a recipe dict, optionally forces the routing (an expert that
gets no token, or every token on EP rank 0's experts, through the selection bias, which is a buffer and so the
same on every rank), runs its steps and returns what the parent compares with one process
(tests/tolerances.py): the losses, the gradient norms, the full adapter gradients of every step and the adapter
before the first step and after each, plus the ZeRO-3 partition sizes and gathered expert weights of this rank.
Nothing here asserts.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


def _force_routing(trainer, mode: str) -> None:
    if mode == "free":
        return
    for layer in trainer.backend.moe_layers(trainer.engine.module):
        bias = layer.router.e_score_correction_bias
        experts = bias.numel()
        if mode == "empty_expert":
            bias[0] = -1e4  # expert 0 is never chosen
        elif mode == "one_ep_rank":
            bias[: experts // 2] = 1e4  # every token picks among EP rank 0's experts


def _full_grads(trainer) -> dict:
    """The reduced gradient of every adapter, full shape, under Hugging Face PEFT names (collective)."""
    from deepspeed.utils import safe_get_full_grad
    from torch.distributed.tensor import DTensor

    module = trainer.engine.module
    saved = {}
    for name, p in module.named_parameters():
        if ".lora_" in name:
            g = safe_get_full_grad(p) if hasattr(p, "ds_id") else p.grad
            g = g.full_tensor() if isinstance(g, DTensor) else g  # FSDP2's shard of the reduced gradient
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            saved[name] = (g if g is not None else torch.zeros(shape)).clone()
    return _state_with(trainer, module, saved)


def steps_with_gradients(trainer) -> dict:
    """Run the recipe's steps, keeping each step's reduced adapter gradients and the adapter around each step:
    ``losses``, ``step_grads``, ``adapters`` (one more than the steps) and, as before, ``grads`` (the first
    step's) and ``adapter`` (the final one); per step also ``router_calls`` (this rank's forward calls of each
    MoE layer's router), ``loads`` (the step's expert loads summed over ranks, what the metrics log) and
    ``logged`` (the step's logged balance term and per-rank load)."""
    adapters = [_adapter(trainer)]
    losses, step_grads, router_calls, loads, logged = [], [], [], [], []
    calls, handles = _count_router_calls(trainer)
    try:
        while trainer.step < trainer.recipe.schedule.steps:
            grads = {}
            calls[:] = [0] * len(calls)
            losses.append(trainer.train_step(on_gradients=lambda grads=grads: grads.update(_full_grads(trainer))))
            step_grads.append(grads)
            router_calls.append(list(calls))
            loads.append(None if trainer.last_loads is None else trainer.last_loads.clone())
            adapters.append(_adapter(trainer))
            metrics = trainer.moe_metrics.collect()  # collective: the step's MoE metrics, as the loop logs them
            logged.append(
                {
                    k: v
                    for k, v in metrics.items()
                    if k.endswith(("aux_loss", "rank_load_max_over_mean", "a2a_exposed_s"))
                }
            )
    finally:
        for handle in handles:
            handle.remove()
    return {
        "losses": losses,
        "step_grads": step_grads,
        "grads": step_grads[0],
        "adapters": adapters,
        "adapter": adapters[-1],
        "router_calls": router_calls,
        "loads": loads,
        "logged": logged,
    }


def _count_router_calls(trainer):
    """A list with one forward-call counter per MoE layer's router (a backward recompute would call it again),
    and the hook handles."""
    layers = trainer.backend.moe_layers(trainer.engine.module)
    calls = [0] * len(layers)

    def counter(i):
        return lambda *_: calls.__setitem__(i, calls[i] + 1)

    return calls, [layer.router.register_forward_pre_hook(counter(i)) for i, layer in enumerate(layers)]


def _adapter(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.backend.adapter_state(trainer.engine.module).items()}


def _state_with(trainer, module, tensors: dict) -> dict:
    """The backend's adapter naming (and, on megatron, the expert all-gather over EP) applied to ``tensors``
    in place of the adapter values."""
    from moe_plugin.megatron.lora import adapter_state_to_hf

    if trainer.backend.name != "megatron":
        from peft import get_peft_model_state_dict

        from moe_plugin.parallel.hf_expert_parallel import whole_experts

        return dict(get_peft_model_state_dict(module, state_dict=whole_experts(module, dict(tensors))))
    from moe_plugin.parallel.zero3_gather import gathered

    # FSDP2's shards registered whole for the moment (ZeRO-3's partitioned parameters take .data as they are)
    sharded = [p for n, p in module.named_parameters() if n in tensors] if trainer.layout.sharding == "fsdp2" else []
    with gathered(sharded):
        params = dict(module.named_parameters())
        backup = {n: params[n].data for n in tensors}
        try:
            for n, t in tensors.items():
                params[n].data = t
            state = adapter_state_to_hf(module, trainer.model_config)
        finally:
            for n, t in backup.items():
                params[n].data = t
    return {"base_model.model." + k.replace(".default.", "."): v for k, v in state.items()}


def _partitions(trainer) -> dict:
    out = {}
    for name, p in trainer.engine.module.named_parameters():
        if hasattr(p, "ds_tensor"):
            out[name] = (
                int(p.ds_tensor.numel()),
                int(p.ds_numel),
                getattr(p, "allreduce", True) is False,
                bool(p.requires_grad),
            )
    return out


def _gathered_experts(trainer) -> dict:
    """This rank's expert stacks of every MoE layer (gathered within their ZeRO group) and their global range."""
    from moe_plugin.parallel.zero3_gather import gathered

    module = trainer.engine.module
    out = {}
    for i, layer in enumerate(module.decoder.layers):
        if not layer.is_moe_layer:
            continue
        experts = layer.mlp.experts
        while hasattr(experts, "base_layer"):
            experts = experts.base_layer
        with gathered([experts.w1]):
            out[i] = (experts.first_expert, experts.w1.detach().clone())
    return out


def run_scenarios(scenarios: list) -> dict:
    """``[{"name", "recipe", "routing", "steps_then"?: int}]`` -> ``{name: result}``."""
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    results = {}
    for scenario in scenarios:
        recipe = recipe_from_dict(copy.deepcopy(scenario["recipe"]))
        if scenario.get("plant") == "adapter_after_sharding":
            results[scenario["name"]] = _adapter_after_sharding(recipe)
            continue
        with Trainer(recipe) as trainer:
            _force_routing(trainer, scenario.get("routing", "free"))
            result = steps_with_gradients(trainer)
            result["grad_norms"] = list(trainer.result.grad_norms)
            result["engine"] = trainer.engine.describe()
            if scenario.get("inspect"):
                result["partitions"] = _partitions(trainer)
                result["experts"] = _gathered_experts(trainer)
        results[scenario["name"]] = result
        dist.barrier()
    return results


def _adapter_after_sharding(recipe) -> dict:
    """The planted bug of transformers #48792: an adapter attached after the engine sharded the model (a plain
    tensor each rank would train on its own); what the next step says."""
    from moe_plugin.training.loop import Trainer

    with Trainer(recipe) as trainer:
        layer = next(m for n, m in trainer.engine.module.named_modules() if n.endswith("layers.0"))
        layer.register_parameter("lora_planted", torch.nn.Parameter(torch.zeros(4)))
        try:
            trainer.train_step()
        except ValueError as e:
            return {"error": str(e)}
    return {"error": None}


def run_recipes(recipes: list) -> list:
    """Run each recipe dict with the product's ``train`` (as the launcher would); the TrainResults."""
    from moe_plugin.training.loop import train
    from moe_plugin.recipe.schema import recipe_from_dict

    return [train(recipe_from_dict(copy.deepcopy(r))) for r in recipes]


def run_stopped_then_resumed(recipe_dict: dict, stop_after: int) -> dict:
    """The recipe run ``stop_after`` steps and checkpointed, the process "stopped" (its Trainer closed without
    finishing), then ``train`` on the same recipe and output_dir again: it resumes from that checkpoint."""
    from moe_plugin.training.loop import Trainer, train
    from moe_plugin.recipe.schema import recipe_from_dict

    with Trainer(recipe_from_dict(copy.deepcopy(recipe_dict))) as trainer:
        for _ in range(stop_after):
            trainer.train_step()
        trainer.save()
        before = list(trainer.result.losses)
    return {"before": before, "after": vars(train(recipe_from_dict(copy.deepcopy(recipe_dict))))}


def run_all(scenarios: list, recipes: list, resume: dict = None) -> dict:
    """All kinds in one launch (each launch costs tens of seconds of start-up)."""
    out = {"scenarios": run_scenarios(scenarios), "recipes": [vars(r) for r in run_recipes(recipes)]}
    if resume is not None:
        out["resume"] = run_stopped_then_resumed(**resume)
    return out
