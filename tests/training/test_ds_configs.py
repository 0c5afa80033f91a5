"""The shipped DeepSpeed configs, merged with a recipe as the trainer merges them, parse with DeepSpeed's own
config class and say what their names say; they hold nothing that the recipe fills."""

import glob

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from moe_plugin.training.ds_config import deepspeed_config
from moe_plugin.recipe.schema import recipe_from_dict

CONFIGS = sorted(glob.glob("ds_configs/*.json"))
RECIPE_FILLS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS)
def test_config_parses_once_merged(path, tmp_path):
    import json

    with open(path) as f:
        raw = json.load(f)
    assert not set(RECIPE_FILLS) & set(raw), "the recipe is the one source of these values"
    # a config may pin the global batch (train_batch_size = micro x accumulation x world: the layout it is for);
    # DeepSpeedConfig checks the batch against this one process, so give the one process all of it
    micro, accumulation = (raw["train_batch_size"], 1) if "train_batch_size" in raw else (3, 2)
    recipe = recipe_from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "deepspeed": path,
            "model": {"preset": "tiny"},
            "schedule": {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation},
        }
    )
    merged = deepspeed_config(recipe, world_size=1)
    config = DeepSpeedConfig(merged)
    assert config.train_micro_batch_size_per_gpu == micro and config.gradient_accumulation_steps == accumulation
    assert config.train_batch_size == micro * accumulation
    if "zero3" in path:
        assert config.zero_optimization_stage == 3
    assert not config.bfloat16_config.enabled and not config.float16_config.enabled  # CPU trains in fp32


def test_zero_stage_is_read_in_one_place():
    from moe_plugin.training.ds_config import zero_stage

    assert zero_stage(None) == 0 and zero_stage({}) == 0 and zero_stage({"zero_optimization": None}) == 0
    assert zero_stage({"zero_optimization": {"stage": 3}}) == 3
    assert zero_stage({"zero_optimization": {"stage": "2"}}) == 2
