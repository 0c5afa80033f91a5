"""A checkpoint resumes at another layout (docs/training.md, "Resume anywhere"): written at EP 2 x ZeRO-3 on 4
processes after step 2, resumed on 2 processes at EP 1 and on 1 process; and written on 1 process, resumed on 4
at EP 2. Each resumed run's losses equal the uninterrupted one-process run's (the layouts equal one process to
fp32 rounding), its final adapter agrees within the Adam bound, and it says in one line what changed."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from safetensors.torch import load_file

from moe_plugin.testing.launch import run_distributed
from tests.tolerances import check_final_adapters
from tests.training.test_trainer import LR, _recipe

WORKER = "tests/training/resume_anywhere_workers.py:run"
STEPS = 4


def _at(tmp, name: str, world: int, ep: int, steps: int = STEPS) -> dict:
    recipe = _recipe(tmp / name, world, ep, steps=steps, warmup_steps=1)
    recipe["checkpoint"]["every"] = 2
    return recipe


def _moved(recipe: dict, tmp, name: str, world: int, ep: int) -> dict:
    """``recipe``'s output_dir copied to ``name``, and the recipe for it at ``world`` processes, EP ``ep``."""
    shutil.copytree(recipe["output_dir"], tmp / name)
    return _at(tmp, name, world, ep)


def _adapter(recipe: dict) -> dict:
    return load_file(f"{recipe['output_dir']}/adapter/adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    whole, written1 = _at(tmp, "whole-w1", 1, 1), _at(tmp, "written-w1", 1, 1)
    one = run_distributed(WORKER, world_size=1, timeout_s=900, calls=[
        {"kind": "train", "recipe": whole}, {"kind": "stop", "recipe": written1, "steps": 2}])[0]
    written4 = _at(tmp, "written-w4", 4, 2)
    from_one = _moved(written1, tmp, "from-w1-on-w4", 4, 2)
    four = run_distributed(WORKER, world_size=4, timeout_s=1200, calls=[
        {"kind": "stop", "recipe": written4, "steps": 2}, {"kind": "train", "recipe": from_one}])[0]
    on_two = _moved(written4, tmp, "from-w4-on-w2", 2, 1)
    two = run_distributed(WORKER, world_size=2, timeout_s=900, calls=[{"kind": "train", "recipe": on_two}])[0]
    on_one = _moved(written4, tmp, "from-w4-on-w1", 1, 1)
    one_b = run_distributed(WORKER, world_size=1, timeout_s=900, calls=[{"kind": "train", "recipe": on_one}])[0]
    resumed = {"4 processes EP 2 -> 2 processes EP 1": (two[0], on_two, "4 processes EP 2 on 2 processes EP 1"),
               "4 processes EP 2 -> 1 process": (one_b[0], on_one, "4 processes EP 2 on 1 process EP 1"),
               "1 process -> 4 processes EP 2": (four[1], from_one, "1 process EP 1 on 4 processes EP 2")}
    return {"whole": (one[0], whole), "written4": four[0], "resumed": resumed}


@pytest.mark.parametrize("which", ["4 processes EP 2 -> 2 processes EP 1", "4 processes EP 2 -> 1 process",
                                   "1 process -> 4 processes EP 2"])
def test_a_checkpoint_resumes_at_another_layout(runs, which):
    whole, whole_recipe = runs["whole"]
    got, recipe, change = runs["resumed"][which]
    assert whole["resumed_from"] is None and got["resumed_from"] == 2
    assert len(got["losses"]) == len(whole["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(whole["losses"], got["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), (which, step, a, b)
    assert f"resuming step 2 written at {change}" in got["printed"], got["printed"][-2000:]
    failures = check_final_adapters(_adapter(whole_recipe), _adapter(recipe), steps=STEPS, lr=LR)
    assert not failures, failures[:8]


def test_the_layout_free_state_names_every_adapter_with_its_moments_whole(runs):
    """What the checkpoint holds: every trainable tensor, expert adapters over all experts, with its moments."""
    _, whole_recipe = runs["whole"]
    tmp_one = whole_recipe["output_dir"].replace("whole-w1", "written-w1")
    tmp_four = whole_recipe["output_dir"].replace("whole-w1", "written-w4")
    one = load_file(f"{tmp_one}/checkpoints/step-00000002/trainable.safetensors")
    four = load_file(f"{tmp_four}/checkpoints/step-00000002/trainable.safetensors")
    assert sorted(one) == sorted(four) and any(":exp_avg_sq" in k for k in one)
    for name in one:
        assert one[name].shape == four[name].shape, name  # whole at EP 2 too: the expert adapters all-gathered
    with open(f"{tmp_four}/checkpoints/step-00000002/trainable.json") as f:
        meta = json.load(f)
    assert meta["layout"] == {"world": 4, "expert": 2, "data": 4, "global_batch": 4} and meta["adam_step"] == 2


def test_a_resume_that_changes_the_global_batch_is_refused_naming_the_field(runs, tmp_path):
    """Refused in the claim, before the model is built: the checkpoint's global batch is 4 rows."""
    _, whole_recipe = runs["whole"]
    recipe = copy.deepcopy(_at(tmp_path, "x", 1, 1))
    shutil.copytree(whole_recipe["output_dir"].replace("whole-w1", "written-w1"), recipe["output_dir"])
    recipe["schedule"]["micro_batch_size"] = 2
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import train

    with pytest.raises(ValueError, match=r"output_dir: schedule\.micro_batch_size x schedule\."
                                         r"gradient_accumulation_steps x 1 processes is 2 rows a step, but "
                                         r"checkpoint step 2 was written with 4 \(1 processes\)"):
        train(recipe_from_dict(recipe))
