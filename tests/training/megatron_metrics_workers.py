"""Rank-side code of test_megatron_metrics.py, run by moe_plugin.testing.launch.run_distributed.

One recipe through the product's ``Trainer``; returned: the run's "model:" line, what the loop logged at each
step, and the indexer KL of each training micro-batch as the backend's loss reported it. Nothing here asserts.
"""

from __future__ import annotations

import torch


def run(recipe: dict) -> dict:
    from moe_plugin.training.metrics.logger import Logger, MultiLogger
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    logged, kls = {}, []

    class Recording(Logger):
        def log(self, step, metrics):
            logged.setdefault(step, {}).update({k: v for k, v in metrics.items() if isinstance(v, float)})

    with Trainer(recipe_from_dict(recipe)) as trainer:
        loss_fn = trainer.backend.loss

        def recording_loss(engine, micro, num_items):
            loss, metrics = loss_fn(engine, micro, num_items)
            if torch.is_grad_enabled():  # a training micro-batch (evaluation runs without gradients)
                kls.append(float(metrics["indexer_kl"]) if "indexer_kl" in metrics else None)
            return loss, metrics

        trainer.backend.loss = recording_loss
        trainer.logger = MultiLogger([trainer.logger, Recording()])
        trainer.run()
        return {"describe": trainer.describe(), "logged": logged, "kls": kls}
