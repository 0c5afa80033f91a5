"""Rank-side code of the image+text trainer tests (test_multimodal_trainer.py), run by run_distributed.

Each run builds the product's ``Trainer`` from a recipe dict (image+text SFT data, a base checkpoint with a
vision tower), computes the logits of this rank's first micro-batch, then trains
(``trainer_workers.steps_with_gradients``): every step's loss, gradient norm and reduced adapter gradients (full
shape, Hugging Face PEFT names), the adapter before the first step and after each (what tests/tolerances.py
checks), and whether this rank's first micro-batch held images. Nothing here asserts.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.training.trainer_workers import steps_with_gradients


def _logits(trainer, micro) -> torch.Tensor:
    module, device = trainer.engine.module, trainer.device
    images = micro.image_inputs(device)
    with torch.no_grad():
        if trainer.backend.name == "hf":
            return module(input_ids=micro.input_ids, cu_seqlens=micro.cu_seqlens, **images).logits.float()
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = micro.cu_seqlens
        longest = int((cu[1:] - cu[:-1]).max())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        return module(micro.input_ids, None, None, packed_seq_params=params, **images).float()


def run_recipes(recipes: list) -> list:
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    results = []
    for recipe_dict in recipes:
        recipe = recipe_from_dict(copy.deepcopy(recipe_dict))
        with Trainer(recipe) as trainer:
            micro = copy.deepcopy(trainer.stream).next_step(trainer.layout.dp_rank)[0][0]
            result = {
                "model": type(trainer.engine.module).__name__,
                "has_images": micro.pixel_patches is not None,
                "input_ids": micro.input_ids,
                "logits": _logits(trainer, micro),
            }
            if hasattr(trainer.engine.module, "get_base_model"):
                result["model"] = type(trainer.engine.module.get_base_model()).__name__
            result.update(steps_with_gradients(trainer), grad_norms=list(trainer.result.grad_norms))
        results.append(result)
        dist.barrier()
    return results
