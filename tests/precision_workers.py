"""Rank-side code of tests/test_precision.py, run by moe_plugin.testing.launch.run_distributed.

Each scenario builds the product's ``Trainer`` from a recipe dict and reports, right after the engine is
built and again after its steps, every base tensor under its Hugging Face name (gathered whole from the
ZeRO-3 partitions and, on megatron, over the expert-parallel ranks) with its dtype, plus which of the
policy's fp32 tensors are buffers and the step losses. Nothing here asserts.
"""

from __future__ import annotations

import copy

import torch.distributed as dist


def _snapshot(trainer) -> dict:
    from moe_plugin.precision import fp32_tensors

    module = trainer.engine.module
    state = trainer.backend.full_state(module)
    buffers = dict(module.named_buffers())
    listed = {name: (name in buffers, str(getattr(owner, attr).dtype)) for name, owner, attr in fp32_tensors(module)}
    return {
        "state": {k: v.detach().clone() for k, v in state.items()},
        "dtypes": {k: str(v.dtype) for k, v in state.items()},
        "listed": listed,
    }


def run_scenarios(scenarios: list) -> dict:
    """``[{"name", "recipe"}]`` -> ``{name: {"built", "trained", "losses"}}``."""
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    results = {}
    for scenario in scenarios:
        recipe = recipe_from_dict(copy.deepcopy(scenario["recipe"]))
        with Trainer(recipe) as trainer:
            built = _snapshot(trainer)
            losses = [trainer.train_step() for _ in range(recipe.schedule.steps)]
            results[scenario["name"]] = {"built": built, "trained": _snapshot(trainer), "losses": losses}
        dist.barrier()
    return results
