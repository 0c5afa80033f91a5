"""The Auto classes pick the model class by the config's ``architectures``; a config without one (every config
built in code, ``preset_config``) gets the text model under AutoModelForCausalLM."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration

TEXT, IMAGE = MoEPluginForCausalLM, MoEPluginForConditionalGeneration


def _same_weights(a, b):
    theirs = b.state_dict()
    assert a.state_dict().keys() == theirs.keys()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_from_config_of_a_preset_builds_the_text_model():
    config = moe_plugin.preset_config("tiny")
    assert config.architectures is None
    assert type(AutoModelForCausalLM.from_config(config)) is TEXT
    assert type(AutoModelForImageTextToText.from_config(config)) is IMAGE


@pytest.mark.parametrize("cls", [TEXT, IMAGE], ids=["text", "image"])
def test_from_config_follows_architectures(cls):
    config = moe_plugin.preset_config("tiny")
    config.architectures = [cls.__name__]
    assert type(AutoModelForCausalLM.from_config(config)) is cls


@pytest.mark.parametrize("cls", [TEXT, IMAGE], ids=["text", "image"])
def test_from_pretrained_builds_the_saved_class(cls, tmp_path):
    torch.manual_seed(0)
    model = cls(moe_plugin.preset_config("tiny")).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is cls
    _same_weights(loaded, model)
    if cls is IMAGE:
        image = AutoModelForImageTextToText.from_pretrained(tmp_path)
        assert type(image) is IMAGE
        _same_weights(image, model)


def test_from_pretrained_without_architectures_builds_the_text_model(tmp_path):
    torch.manual_seed(0)
    model = TEXT(moe_plugin.preset_config("tiny")).eval()
    model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    del config["architectures"]
    config_path.write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is TEXT
    _same_weights(loaded, model)
