"""The DeepSpeed config merge (moe_plugin/training/ds_config.py): the recipe's numbers filled into the recipe's
DeepSpeed JSON or the default, each conflict and refusal asserted on its message."""

import json

import pytest

from moe_plugin.recipe.schema import recipe_from_dict
from moe_plugin.training.ds_config import ZERO3_SETTINGS, deepspeed_config
from tests.recipes import smallest


def _ds_recipe(tmp_path, ds=None, **sections):
    values = smallest(**sections)
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        values["deepspeed"] = str(tmp_path / "ds.json")
    return recipe_from_dict(values)


def test_deepspeed_config_missing(tmp_path):
    recipe = recipe_from_dict(smallest(deepspeed=str(tmp_path / "nope.json")))
    with pytest.raises(ValueError, match=f"^deepspeed: the DeepSpeed config '{tmp_path}/nope.json' does not exist"):
        deepspeed_config(recipe, 1)


def test_deepspeed_config_invalid_json_names_the_file(tmp_path):
    (tmp_path / "ds.json").write_text('{\n  "zero_optimization": {\n}')
    recipe = recipe_from_dict(smallest(deepspeed=str(tmp_path / "ds.json")))
    with pytest.raises(ValueError, match=f"^{tmp_path}/ds.json, line 3 column 2: not valid JSON"):
        deepspeed_config(recipe, 1)


@pytest.mark.parametrize("ep, world", [(1, 2), (2, 4)])
def test_zero3_is_required_where_the_layout_needs_it(tmp_path, ep, world):
    recipe = _ds_recipe(tmp_path, {"zero_optimization": {"stage": 2}}, parallel={"expert_parallel_size": ep})
    with pytest.raises(
        ValueError,
        match=r"ds\.json: zero_optimization\.stage is 2, but .*; set \"zero_optimization\": "
        r"\{\"stage\": 3",
    ):
        deepspeed_config(recipe, world)


def test_no_zero3_needed_for_one_process_or_the_hf_backend(tmp_path):
    assert deepspeed_config(_ds_recipe(tmp_path, {"zero_optimization": {"stage": 0}}), 1)["zero_optimization"] == {
        "stage": 0
    }
    hf = _ds_recipe(tmp_path, {"zero_optimization": {"stage": 2}}, parallel={"backend": "hf"})
    assert deepspeed_config(hf, 2)["zero_optimization"]["stage"] == 2


def test_a_micro_batch_conflict_names_both_places(tmp_path):
    recipe = _ds_recipe(
        tmp_path,
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
        schedule={"micro_batch_size": 4},
    )
    with pytest.raises(ValueError) as caught:
        deepspeed_config(recipe, 2)
    assert str(caught.value) == (
        f"schedule.micro_batch_size (4) and {tmp_path}/ds.json: "
        "train_micro_batch_size_per_gpu (1) disagree; remove it from the DeepSpeed config "
        "(the recipe fills it) or make them equal"
    )


def test_a_precision_conflict_is_not_hidden_by_true_equal_to_one(tmp_path):
    recipe = _ds_recipe(tmp_path, {"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"^schedule\.precision \('fp32'\) and .*: bf16\.enabled \(true\) disagree"):
        deepspeed_config(recipe, 1)


def test_auto_and_absent_values_are_filled_from_the_recipe(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
    }
    recipe = _ds_recipe(
        tmp_path,
        ds,
        parallel={"expert_parallel_size": 2},
        schedule={"micro_batch_size": 3, "gradient_accumulation_steps": 5, "clip_grad_norm": 0.5, "precision": "bf16"},
    )
    merged = deepspeed_config(recipe, 4)
    assert merged["train_micro_batch_size_per_gpu"] == 3 and merged["gradient_accumulation_steps"] == 5
    assert merged["train_batch_size"] == 3 * 5 * 4  # global batch: every rank of the world is data-parallel
    assert merged["gradient_clipping"] == 0.5 and merged["bf16"] == {"enabled": True}
    assert merged["fp16"] == {"enabled": False}
    assert merged["zero_optimization"]["stage3_param_persistence_threshold"] == 100
    no_clip = _ds_recipe(tmp_path, {}, schedule={"clip_grad_norm": None})
    assert deepspeed_config(no_clip, 1)["gradient_clipping"] == 0.0


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_are_refused(tmp_path, section):
    recipe = _ds_recipe(tmp_path, {section: {"type": "AdamW", "params": {}}})
    with pytest.raises(
        ValueError, match=f"ds.json: {section}: the trainer passes its own torch AdamW .*remove the '{section}' section"
    ):
        deepspeed_config(recipe, 1)


def test_fp16_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ds\.json: fp16\.enabled: fp16 needs loss scaling"):
        deepspeed_config(_ds_recipe(tmp_path, {"fp16": {"enabled": True}}), 1)


def test_the_default_config(tmp_path):
    assert deepspeed_config(recipe_from_dict(smallest()), 1)["zero_optimization"] == {"stage": 0}
    with open("ds_configs/zero3_lora.json") as f:
        shipped = json.load(f)["zero_optimization"]
    assert ZERO3_SETTINGS == shipped
    assert deepspeed_config(recipe_from_dict(smallest()), 2)["zero_optimization"] == shipped
    ep2 = recipe_from_dict(smallest(parallel={"expert_parallel_size": 2}))
    assert deepspeed_config(ep2, 2)["zero_optimization"] == shipped


def test_a_relative_deepspeed_path_resolves_against_base_dir(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    recipe = recipe_from_dict(smallest(deepspeed="ds.json"))
    assert deepspeed_config(recipe, 2, base_dir=str(tmp_path))["zero_optimization"] == {"stage": 3}
