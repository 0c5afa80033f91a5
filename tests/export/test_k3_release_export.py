"""Exports of a run over an image+text base in K3's published form (tests/export/k3_image_base.py: bf16 with the
release's fp32 families, the release's config.json keys, the K3-style remote-code tokenizer whose module imports
``encoding_k3.py``, generation_config.json, preprocessor_config.json).

The run is made cheaply, as tests/export/test_multimodal_export.py does: a text adapter put on the base's
language model with peft, lora_B random, and the run's recipe. Every format exports and passes its self-check;
merged-k3 writes the base's own config.json and its fp32 families in fp32 and reloads; the peft export loads with
plain peft's ``AutoPeftModelForCausalLM``; every export carries the tokenizer's files, which load with
``AutoTokenizer(trust_remote_code=True)`` and give the base tokenizer's ids."""

from __future__ import annotations

import json
import os

import pytest
import torch

import moe_plugin

from moe_plugin.export import export_run
from tests.export.k3_image_base import RELEASE_FP32, write_release_base
from tests.models.k3_fixtures import read_dir

FORMATS = ("peft", "per-expert", "merged-hf", "merged-k3")
TOKENIZER_FILES = ("tokenization_kimi.py", "encoding_k3.py", "tokenizer_config.json", "tiktoken.model")
BESIDE = ("generation_config.json", "preprocessor_config.json")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from peft import get_peft_model

    from moe_plugin.lora import lora_config
    from moe_plugin.models import load_k3_checkpoint
    from moe_plugin.training.run_dir import MARKER

    tmp = tmp_path_factory.mktemp("k3_release_export")
    base = tmp / "base"
    base.mkdir()
    write_release_base(base)
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj"], "target_parameters": ["experts.w1"]}
    torch.manual_seed(1)
    text = get_peft_model(
        load_k3_checkpoint(base, ignore_vision=True).float(),
        lora_config(4, 8, lora["target_modules"], lora["target_parameters"]),
    )
    with torch.no_grad():
        for name, p in text.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    text.save_pretrained(tmp / "run" / "adapter")
    recipe = {
        "output_dir": str(tmp / "run"),
        "model": {"from_pretrained": str(base)},
        "lora": lora,
        "parallel": {"backend": "hf"},
    }
    (tmp / "run" / MARKER).write_text(json.dumps(recipe))
    exports = {to: str(tmp / to) for to in FORMATS}
    for to, out in exports.items():
        export_run(str(tmp / "run"), to, out)  # raises unless the export's self-check passed
    return {"base": str(base), "exports": exports}


def test_merged_k3_keeps_the_base_config_and_its_fp32_families(job):
    """The base's own config.json (every key: architectures, auto_map, media_placeholder_token_id, the vision
    keys); every tensor in the dtype the base stores it in, the fp32 families and the tower unchanged; it reloads."""
    from moe_plugin.models import MoEPluginForConditionalGeneration, load_k3_checkpoint

    out = job["exports"]["merged-k3"]
    with open(os.path.join(job["base"], "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(g) == json.load(f)
    base, merged = read_dir(job["base"]), read_dir(out)
    assert sorted(merged) == sorted(base)
    for name, value in base.items():
        assert merged[name].dtype == value.dtype, name
        if name.endswith(RELEASE_FP32) or name.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(merged[name], value), name
    assert sum(t.dtype == torch.float32 for t in merged.values()) > 0
    load_k3_checkpoint(out, model_cls=MoEPluginForConditionalGeneration)


def test_the_merged_hf_export_reloads_with_the_auto_class(job):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["exports"]["merged-hf"])
    assert isinstance(model, moe_plugin.MoEPluginForConditionalGeneration)


def test_the_peft_export_loads_with_plain_peft_on_the_auto_class(job):
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file

    out = job["exports"]["peft"]
    keys = list(load_file(os.path.join(out, "adapter_model.safetensors")))
    assert keys and all(k.startswith("base_model.model.language_model.model.layers.") for k in keys), keys[:3]
    # trust_remote_code: the export carries the base's remote-code tokenizer, which peft's loader reads too; the
    # model classes stay this project's (registered classes win over the config's auto_map)
    model = AutoPeftModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    # every saved tensor sits under a module name plain peft gave the Auto-loaded base
    as_loaded = {k.replace(".default", "") for k in loaded}
    assert set(saved) <= as_loaded, sorted(set(saved) - as_loaded)[:3]


@pytest.mark.parametrize("to", FORMATS)
def test_every_export_carries_the_tokenizer_and_its_files(job, to):
    from transformers import AutoTokenizer

    out = job["exports"][to]
    for name in TOKENIZER_FILES + BESIDE:
        assert os.path.isfile(os.path.join(out, name)), (to, name)
    text = "The sky is blue, 2 + 3 = 5."
    ids = AutoTokenizer.from_pretrained(out, trust_remote_code=True).encode(text)
    assert ids == AutoTokenizer.from_pretrained(job["base"], trust_remote_code=True).encode(text)


def test_the_runs_adapter_copies_every_tokenizer_file(job, tmp_path):
    """What the trainer copies beside its adapter (``ResolvedModel.save_tokenizer``): the base's tokenizer
    module with its relative import, generation_config.json and preprocessor_config.json."""
    from moe_plugin.recipe.resolved_model import copy_tokenizer_files

    names = copy_tokenizer_files(job["base"], str(tmp_path))
    assert set(TOKENIZER_FILES + BESIDE) <= set(names), names
