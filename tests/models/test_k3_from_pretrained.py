"""``from_pretrained`` and the Auto classes on a base in K3's published layout (the tiny release of
``moe_plugin.testing.k3_release``: the published config.json shrunk, bf16 with the fp32 families, MXFP4
per-expert experts, the vision tower, the K3-style tokenizer), and eval.answers' loading of such a base
(``training.metrics.answer_eval.load_adapted``). Reference values: the stored tensors, read with safetensors."""

import os

import pytest
import torch

import moe_plugin  # noqa: F401  (registers the Auto classes)
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
from moe_plugin.testing.k3_release import write_k3_release
from tests.models.k3_fixtures import read_dir

TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "k3_tokenizer")
EMBED = "language_model.model.embed_tokens.weight"
Q_PROJ = "language_model.model.layers.0.self_attn.q_proj.weight"
CONV = "language_model.model.layers.0.self_attn.q_conv1d.weight"
DT_BIAS = "language_model.model.layers.0.self_attn.dt_bias"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_release") / "base"
    write_k3_release(path, tokenizer_dir=TOKENIZER)
    return str(path), read_dir(path)


def _vision(stored):
    return {n: t for n, t in stored.items() if n.startswith(("vision_tower.", "mm_projector."))}


def test_the_auto_classes_load_the_release_in_its_dtype(release):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path, stored = release
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        model = auto.from_pretrained(path)
        assert isinstance(model, MoEPluginForConditionalGeneration), auto
        state = model.state_dict()
        # dtype "auto" is the config's bfloat16; the fp32 families by the precision rule (docs/precision.md)
        assert state[EMBED].dtype == torch.bfloat16 and torch.equal(state[EMBED], stored[EMBED])
        assert state[DT_BIAS].dtype == torch.float32 and torch.equal(state[DT_BIAS], stored[DT_BIAS])
        assert state[CONV].dtype == torch.bfloat16
        assert torch.equal(state[CONV].flatten(), stored[CONV].to(torch.bfloat16).flatten())
        assert not model.training


def test_from_pretrained_of_each_class_reads_the_stored_tensors(release):
    path, stored = release
    model = MoEPluginForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    for name, value in {**_vision(stored), EMBED: stored[EMBED], Q_PROJ: stored[Q_PROJ]}.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value.float()), name
    text = MoEPluginForCausalLM.from_pretrained(path, torch_dtype="float32")
    text_state = text.state_dict()
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in text_state)
    assert torch.equal(text_state["model.embed_tokens.weight"], stored[EMBED].float())
    assert torch.equal(text_state["model.layers.0.self_attn.q_proj.weight"], stored[Q_PROJ].float())


def test_an_unknown_keyword_is_refused_by_name(release):
    path, _ = release
    with pytest.raises(ValueError, match=r"^quantization_config: not an option of from_pretrained"):
        MoEPluginForCausalLM.from_pretrained(path, quantization_config={})
    with pytest.raises(ValueError, match=r"^device_map: a K3-layout checkpoint loads on the CPU"):
        MoEPluginForCausalLM.from_pretrained(path, device_map="auto")


def test_eval_answers_loads_an_adapter_over_the_release(release, tmp_path):
    """eval.answers' loader (plain peft over the base's from_pretrained) on the K3-layout base: the adapter's
    deltas are there, and the base without them is the stored base."""
    from peft import get_peft_model

    from moe_plugin.lora import lora_config
    from moe_plugin.training.metrics.answer_eval import load_adapted

    path, stored = release
    model = get_peft_model(
        MoEPluginForCausalLM.from_pretrained(path, dtype=torch.float32), lora_config(2, 4, ["q_proj"], [])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "adapter")
    loaded = load_adapted(path, str(tmp_path / "adapter"), images=False)
    q = loaded.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert torch.equal(q.base_layer.weight, stored[Q_PROJ].to(q.base_layer.weight.dtype))
    want = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").get_delta_weight("default")
    assert torch.allclose(q.get_delta_weight("default").float(), want.float(), rtol=1e-2, atol=1e-3)


def test_a_release_base_saved_by_save_pretrained_reloads(release, tmp_path):
    """save_pretrained keeps the release's config.json over this project's stacked tensors: from_pretrained
    tells the layouts apart by the tensors and reloads it as it was saved."""
    path, _ = release
    model = MoEPluginForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    again = MoEPluginForConditionalGeneration.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    want, got = model.state_dict(), again.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
