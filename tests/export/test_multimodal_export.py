"""Merged exports of a text adapter over an image+text base (vision tower + projector, K3's published multimodal
layout): the vision tensors pass through bit for bit, the export reloads as ``MoEPluginForConditionalGeneration``,
and on an image+text batch it gives the logits of the base image+text model carrying the run's adapter (plain
peft on the conditional-generation model, the adapter's keys moved under ``language_model.``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin.export import export_run
from moe_plugin.weights.names import VISION_PREFIXES
from tests.export.saved_files import directory_tensors


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory as the trainer leaves it, over an image+text K3 base; the adapter is put on the text
    model with peft directly (the trainer's text runs do not load an image+text base yet), lora_B random."""
    from peft import get_peft_model

    from moe_plugin.lora import lora_config
    from moe_plugin.models import (
        MoEPluginForConditionalGeneration,
        load_k3_checkpoint,
        preset_config,
        save_k3_checkpoint,
    )
    from moe_plugin.training.run_dir import MARKER

    tmp = tmp_path_factory.mktemp("vl")
    torch.manual_seed(2)
    save_k3_checkpoint(MoEPluginForConditionalGeneration(preset_config("tiny", attn_res=False)), tmp / "base")
    lora = {
        "r": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "k_proj", "gate"],
        "target_parameters": ["experts.w1", "experts.w2", "experts.w3"],
    }
    text = get_peft_model(
        load_k3_checkpoint(tmp / "base", ignore_vision=True).float(),
        lora_config(4, 8, lora["target_modules"], lora["target_parameters"]),
    )
    with torch.no_grad():
        for name, p in text.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    text.save_pretrained(tmp / "run" / "adapter")
    recipe = {
        "output_dir": str(tmp / "run"),
        "model": {"from_pretrained": str(tmp / "base"), "overrides": {}},
        "lora": lora,
        "parallel": {"backend": "megatron", "expert_parallel_size": 1},
    }
    (tmp / "run" / MARKER).write_text(json.dumps(recipe))
    exports = {to: str(tmp / to) for to in ("merged-hf", "merged-k3")}
    for to, out in exports.items():
        export_run(str(tmp / "run"), to, out, max_shard_size="20KB")
    return {"base": str(tmp / "base"), "run": str(tmp / "run"), "exports": exports}


def _inputs(image_token_id: int):
    g = torch.Generator().manual_seed(7)
    ids = torch.cat(
        [
            torch.randint(0, 256, (1, 5), generator=g),
            torch.full((1, 6), image_token_id),
            torch.randint(0, 256, (1, 9), generator=g),
        ],
        dim=1,
    )
    return {
        "input_ids": ids,
        "pixel_patches": torch.randn(24, 3 * 14 * 14, generator=g),
        "grid_hw": torch.tensor([[4, 6]]),
    }


def _rel(a, b):
    return float((a - b).abs().max()) / float(b.abs().max())


def _adapted_image_text_model(run):
    """The base image+text model with the run's adapter put on by plain peft."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from moe_plugin.models import MoEPluginForConditionalGeneration, load_k3_checkpoint

    model = load_k3_checkpoint(run["base"], model_cls=MoEPluginForConditionalGeneration).float()
    adapter = os.path.join(run["run"], "adapter")
    peft_model = get_peft_model(model, LoraConfig.from_pretrained(adapter))
    state = {
        k.replace("base_model.model.", "base_model.model.language_model.", 1): v
        for k, v in load_file(os.path.join(adapter, "adapter_model.safetensors")).items()
    }
    result = set_peft_model_state_dict(peft_model, state)
    assert not [k for k in result.missing_keys if ".lora_" in k] and not result.unexpected_keys
    return peft_model.eval()


@pytest.mark.parametrize("to", ["merged-hf", "merged-k3"])
def test_merged_exports_keep_the_vision_tensors_and_reload_as_the_image_text_model(run, to):
    from moe_plugin.models import MoEPluginForConditionalGeneration, load_k3_checkpoint

    directory = run["exports"][to]
    base, written = directory_tensors(run["base"]), directory_tensors(directory)
    vision = sorted(n for n in base if n.startswith(VISION_PREFIXES))
    assert vision and sorted(n for n in written if n.startswith(VISION_PREFIXES)) == vision
    assert all(torch.equal(written[n], base[n]) for n in vision)
    assert all(n.startswith(("language_model.",) + VISION_PREFIXES) for n in written)
    if to == "merged-hf":
        model = MoEPluginForConditionalGeneration.from_pretrained(directory)
    else:
        assert "vision_config" in json.load(open(os.path.join(directory, "config.json")))
        model = load_k3_checkpoint(directory, model_cls=MoEPluginForConditionalGeneration)
    inputs = _inputs(model.config.image_token_id)
    reference = _adapted_image_text_model(run)
    with torch.no_grad():
        want = reference(**inputs).logits.float()
        got = model.float().eval()(**inputs).logits.float()
        plain = load_k3_checkpoint(run["base"], model_cls=MoEPluginForConditionalGeneration).float()(**inputs).logits
    assert _rel(plain.float(), want) > 1e-3  # the adapter changes the image+text logits
    assert _rel(got, want) <= 1e-5
    manifest = json.load(open(os.path.join(directory, "moe_plugin_export.json")))
    assert manifest["check"]["logits_max_rel_diff"] <= 1e-5
