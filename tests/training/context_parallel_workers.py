"""Rank-side code of test_context_parallel_trainer.py, run by run_distributed: each recipe builds the product's
``Trainer`` and trains (``trainer_workers.steps_with_gradients``: every step's loss, gradient norm, reduced adapter
gradients and the adapter around each step), and records this rank's layout and peak tensor memory. Nothing
here asserts."""

from __future__ import annotations

import copy

import torch.distributed as dist

from tests.training.trainer_workers import steps_with_gradients


def run_recipes(recipes: list) -> list:
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import Trainer

    results = []
    for recipe_dict in recipes:
        with Trainer(recipe_from_dict(copy.deepcopy(recipe_dict))) as trainer:
            layout = trainer.layout
            result = {
                "layout": {"context": layout.context, "expert": layout.expert, "data": layout.data},
                "context_rank": layout.context_rank,
                "dp_rank": layout.dp_rank,
            }
            result.update(steps_with_gradients(trainer), grad_norms=list(trainer.result.grad_norms))
        results.append(result)
        dist.barrier()
    from moe_plugin.testing.expert_dispatch import overlap_parity

    results.append({"overlap": overlap_parity(chunk_counts=(1, 2, 4))})  # EP = the 4 ranks: 4 experts a rank
    return results
