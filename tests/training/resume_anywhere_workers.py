"""Rank-side code of test_resume_anywhere.py: runs stopped after a checkpoint, and resumed, through the product's
``Trainer``/``train``."""

import contextlib
import copy
import io

import torch.distributed as dist


def stop_after(recipe_dict: dict, steps: int, saves=None) -> dict:
    """Run ``steps`` steps of the recipe, checkpoint (after each step of ``saves``, default the last), and
    "stop" (close the Trainer without finishing)."""
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import Trainer

    with Trainer(recipe_from_dict(copy.deepcopy(recipe_dict))) as trainer:
        for step in range(1, steps + 1):
            trainer.train_step()
            if step in (saves or [steps]):
                trainer.save()
        return {"losses": list(trainer.result.losses)}


def train_capturing(recipe_dict: dict) -> dict:
    """``train`` the recipe (a resume when its output_dir holds a checkpoint); its result and what it printed."""
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = vars(train(recipe_from_dict(copy.deepcopy(recipe_dict))))
    return {
        "losses": result["losses"],
        "resumed_from": result["resumed_from"],
        "printed": out.getvalue() + err.getvalue(),
    }


def run(calls: list) -> list:
    """``[{"kind": "stop"|"train", "recipe", "steps"?}]`` in order, on every rank; each one's result."""
    results = []
    for call in calls:
        if call["kind"] == "stop":
            results.append(stop_after(call["recipe"], call["steps"], call.get("saves")))
        else:
            results.append(train_capturing(call["recipe"]))
        dist.barrier()
    return results
