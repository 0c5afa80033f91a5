"""Rank-side code of tests/export/test_k3_release_chat_runs.py, run by run_distributed on one process: each
recipe (a path, as a user passes it) runs through the product's ``Trainer`` as ``moe-plugin train`` runs it;
before it trains, the rows of its first micro-batch are taken from a copy of its data stream, so the test can
compare what the trainer packs with ``moe-plugin data --dump``. Nothing here asserts."""

from __future__ import annotations

import copy

import torch.distributed as dist


def train_recipes(paths: list) -> list:
    """``[{"input_ids", "labels": [rows, seq_len] int lists of the first micro-batch, "losses"}]`` a recipe."""
    from moe_plugin.recipe.schema import load_recipe
    from moe_plugin.training.loop import Trainer

    results = []
    for path in paths:
        recipe = load_recipe(path)
        with Trainer(recipe) as trainer:
            micro = copy.deepcopy(trainer.stream).next_step(trainer.layout.dp_rank)[0][0]
            seq = recipe.data.seq_len
            rows = {k: getattr(micro, k).reshape(-1, seq).tolist() for k in ("input_ids", "labels")}
            losses = list(trainer.run().losses)
        results.append({**rows, "losses": losses})
        dist.barrier()
    return results
