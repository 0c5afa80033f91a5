"""The shipped DeepSpeed configs parse with DeepSpeed's own config class and say what their names say."""

import glob

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

CONFIGS = sorted(glob.glob("ds_configs/*.json"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS)
def test_config_parses(path):
    config = DeepSpeedConfig(path)
    if "zero3" in path:
        assert config.zero_optimization_stage == 3
    assert not config.bfloat16_config.enabled and not config.float16_config.enabled  # CPU trains in fp32
