"""The shipped DeepSpeed configs, merged with a recipe as the trainer merges them, parse with DeepSpeed's own
config class and say what their names say; they hold nothing that the recipe fills."""

import glob

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from moe_plugin.training.ds_config import deepspeed_config
from moe_plugin.training.recipe import recipe_from_dict

CONFIGS = sorted(glob.glob("ds_configs/*.json"))
RECIPE_FILLS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                "train_batch_size")


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS)
def test_config_parses_once_merged(path, tmp_path):
    import json

    with open(path) as f:
        raw = json.load(f)
    assert not set(RECIPE_FILLS) & set(raw), "the recipe is the one source of these values"
    recipe = recipe_from_dict({"output_dir": str(tmp_path / "run"), "deepspeed": path, "model": {"preset": "tiny"},
                               "schedule": {"micro_batch_size": 3, "gradient_accumulation_steps": 2}})
    merged = deepspeed_config(recipe, world_size=1)  # DeepSpeedConfig checks the batch against this process
    config = DeepSpeedConfig(merged)
    assert config.train_micro_batch_size_per_gpu == 3 and config.gradient_accumulation_steps == 2
    assert config.train_batch_size == 3 * 2
    if "zero3" in path:
        assert config.zero_optimization_stage == 3
    assert not config.bfloat16_config.enabled and not config.float16_config.enabled  # CPU trains in fp32
