"""Rank-side code of test_attn_res_trainer.py, run by moe_plugin.testing.launch.run_distributed.

Each recipe runs through the product's ``Trainer`` (Hugging Face backend); returned: every step's loss and
gradient norm, the indexer term the backend reported, the reduced full adapter gradients of every step, the
adapter before the first step and after each (what tests/tolerances.py checks), and the ZeRO-3 partition
sizes of the Attention Residual weights. Nothing here asserts.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from tests.training.trainer_workers import steps_with_gradients


def run(recipes: list) -> dict:
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    results = {}
    for name, recipe_dict in recipes:
        with Trainer(recipe_from_dict(copy.deepcopy(recipe_dict))) as trainer:
            module, loss_fn, kls = trainer.engine.module, trainer.backend.loss, []

            def recording_loss(engine, micro, num_items, loss_fn=loss_fn, kls=kls):
                loss, metrics = loss_fn(engine, micro, num_items)
                kls.append(float(metrics["indexer_kl"]) if "indexer_kl" in metrics else None)
                return loss, metrics

            trainer.backend.loss = recording_loss
            results[name] = {
                **steps_with_gradients(trainer),
                "grad_norms": list(trainer.result.grad_norms),
                "indexer_kl": kls,
                "attn_res_partitions": {
                    n: (int(p.ds_tensor.numel()), int(p.ds_numel))
                    for n, p in module.named_parameters()
                    if ("_res_proj" in n or "_res_norm" in n) and hasattr(p, "ds_tensor")
                },
                "attn_res_count": sum(1 for n, _ in module.named_parameters() if "_res_proj" in n or "_res_norm" in n),
            }
        dist.barrier()
    return results
