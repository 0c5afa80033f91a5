"""``lora.targets_by_layer_kind``: which LoRA targets matched in which decoder layer kinds. The counts are checked
against what peft itself adapted (the modules and parameters it wrapped, put in their layers by the config's
``layer_types``); the MLA projections the report offers are the MLA projection families of the published
release (docs/k3-formats.md: ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``g_proj``,
``o_proj``), and ``add_lora`` leaves the line on the model it returns (the trainer prints it at start)."""

import re

import pytest

from moe_plugin.lora import REPORT_ATTRIBUTE, add_lora, lora_config, targets_by_layer_kind
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration, preset_config

RELEASE_MLA_PROJECTIONS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"}
KIND = {"linear_attention": "KDA", "full_attention": "MLA"}


def _peft_counts(model, config, targets):
    """{target: {kind: layers where peft adapted it}} from the adapted model's own lora_A modules."""
    kinds = [KIND[t] for t in config.layer_types]
    found = {t: {} for t in targets}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        layer = re.search(r"layers\.(\d+)\.", name)
        if layer is None:
            continue
        path = name.replace(".base_layer", "")
        for target in targets:
            hit = path.endswith("." + target) or (
                "." in target
                and getattr(module, "parameter_name", None) == target.split(".")[-1]
                and path.endswith("." + target.split(".")[0])
            )
            if hit:
                found[target].setdefault(kinds[int(layer.group(1))], set()).add(int(layer.group(1)))
    return {t: {k: len(v) for k, v in f.items()} for t, f in found.items()}


def _report_counts(line, targets):
    counts = {}
    for phrase in line.removeprefix("LoRA targets by layer kind: ").split(" | "):
        names, _, rest = phrase.partition(" matched in ")
        for part in rest.split("; "):
            n, _, tail = part.partition(" of ")
            kind = tail.split(" ")[1]
            for target in names.split(", "):
                counts.setdefault(target, {})[kind] = int(n)
    return {t: {k: n for k, n in counts[t].items() if n} for t in targets}


@pytest.mark.parametrize("image", [False, True])
def test_the_report_counts_what_peft_adapted_by_layer_kind(image):
    config = preset_config("tiny", **({} if image else {"vision_config": None, "image_token_id": None}))
    model = (MoEPluginForConditionalGeneration if image else MoEPluginForCausalLM)(config)
    modules, params = ["q_proj", "k_proj", "gate", "o_proj"], ["experts.w1"]
    lora = lora_config(4, 8, modules, params)
    line = targets_by_layer_kind(model, lora)
    adapted = add_lora(model, lora, wrap=True)
    assert getattr(adapted, REPORT_ATTRIBUTE) == line
    assert _report_counts(line, modules + params) == _peft_counts(adapted, config, modules + params)
    # q_proj and k_proj miss the MLA layer in full, and the line says what MLA has instead
    mla = re.search(r"k_proj, q_proj matched in 3 of 3 KDA layers; 0 of 1 MLA layers \(MLA has ([^)]*)\)", line)
    assert mla, line
    assert set(mla.group(1).split(", ")) == RELEASE_MLA_PROJECTIONS
    assert "o_proj matched in 3 of 3 KDA layers; 1 of 1 MLA layers" in line


def test_targets_that_match_every_layer_offer_nothing():
    config = preset_config("tiny", vision_config=None, image_token_id=None)
    line = targets_by_layer_kind(MoEPluginForCausalLM(config), lora_config(4, 8, ["o_proj", "g_proj"]))
    assert line == "LoRA targets by layer kind: g_proj, o_proj matched in 3 of 3 KDA layers; 1 of 1 MLA layers"
