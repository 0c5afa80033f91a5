"""A LoRA run of the product's trainer over the tiny Kimi K3 release (``moe_plugin.testing.k3_release``: the
published config.json shrunk with every key, bf16 with the fp32 families, MXFP4 per-expert experts, the vision
tower, the K3-style remote-code tokenizer), end to end as a new K3 user meets it, for a text run and an image
run:

- the trainer prints which LoRA targets matched in which layer kinds (q_proj/k_proj miss the MLA layer, and
  the line names MLA's projections);
- the run's ``adapter/`` carries every file the tokenizer needs (its module and the module it imports,
  generation_config.json, preprocessor_config.json);
- every export format succeeds and self-checks; merged-k3 writes the base's config.json (every key, only the
  packed experts' quantization_config dropped, as they are merged dense) and keeps the fp32 families fp32;
  each export reloads with plain transformers / peft (Auto classes), and its tokenizer gives the base's ids."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from moe_plugin.testing.k3_release import write_k3_release
from tests.models.k3_fixtures import read_dir
from tests.training.launchers import REPO, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOKENIZER = os.path.join(REPO, "tests", "fixtures", "k3_tokenizer")
RECORDS = [("What is 2 plus 3?", "5"), ("Which colour is the sky on a clear day?", "blue")]
FORMATS = ("peft", "per-expert", "merged-hf", "merged-k3")
TOKENIZER_FILES = ("tokenization_kimi.py", "encoding_k3.py", "tokenizer_config.json", "tiktoken.model")
BESIDE = ("generation_config.json", "preprocessor_config.json")
FP32_FAMILIES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def _records(tmp, kind: str):
    """The run's data: two text conversations, or two pictures of a colour asked about (the image model)."""
    if kind == "text":
        return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in RECORDS]
    from PIL import Image

    records = []
    for i, colour in enumerate(("red", "blue")):
        Image.new("RGB", (56, 56), colour).save(tmp / f"{i}.png")
        question = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "What color is it?"}]
        records.append([{"role": "user", "content": question}, {"role": "assistant", "content": colour}])
    return records


@pytest.fixture(scope="module", params=["text", "image"])
def job(request, tmp_path_factory):
    """A text run (the text model over the image base) or an image run (the image+text model), and its exports."""
    from moe_plugin.cli import main

    tmp = tmp_path_factory.mktemp(f"k3_release_{request.param}_run")
    base = tmp / "base"
    write_k3_release(base, tokenizer_dir=TOKENIZER)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _records(tmp, request.param)))
    recipe = {
        "output_dir": str(tmp / "run"),
        "seed": 3,
        "model": {"from_pretrained": str(base), "trust_remote_code": True},
        "lora": {
            "r": 4,
            "alpha": 8,
            "target_modules": ["q_proj", "k_proj"],
            "target_parameters": ["experts.w1", "experts.w2", "experts.w3"],
        },
        "data": {"kind": "sft", "path": str(data), "seq_len": 192, "pack": False, "eval_fraction": 0.0},
        "parallel": {"backend": "hf"},
        "schedule": {"steps": 2, "micro_batch_size": 2, "lr": 1e-2, "decay": "constant"},
        "logging": {"every": 1, "progress_bar": False},
    }
    (tmp / "recipe.json").write_text(json.dumps(recipe))
    printed = launch(
        [sys.executable, "-m", "moe_plugin.train", "--recipe", str(tmp / "recipe.json")],
        env_extra={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    exports = {to: str(tmp / to) for to in FORMATS}
    for to, out in exports.items():
        assert main(["export", "--run", str(tmp / "run"), "--to", to, out]) == 0, to
    return {"base": str(base), "run": str(tmp / "run"), "printed": printed, "exports": exports}


def test_the_trainer_reports_the_targets_by_layer_kind_and_the_fp32_families(job):
    assert (
        "LoRA targets by layer kind: k_proj, q_proj matched in 3 of 3 KDA layers; 0 of 1 MLA layers (MLA has "
        "q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj)"
    ) in job["printed"], job["printed"][:2000]
    # and what the precision policy did with the tensors the release stores in fp32 under its bf16 dtype
    assert "tensor(s) stored in float32 under the checkpoint's dtype bfloat16, accepted by rule" in job["printed"]


def test_the_runs_adapter_carries_every_tokenizer_file(job):
    adapter = os.path.join(job["run"], "adapter")
    for name in TOKENIZER_FILES + BESIDE:
        assert os.path.isfile(os.path.join(adapter, name)), name


def test_merged_k3_keeps_the_base_config_and_dtypes(job):
    from transformers import AutoModelForImageTextToText

    out = job["exports"]["merged-k3"]
    with open(os.path.join(job["base"], "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        base_config, written = json.load(f), json.load(g)
    base_config["text_config"].pop("quantization_config")  # the experts are merged dense (no --requantise)
    assert written == base_config
    base, merged = read_dir(job["base"]), read_dir(out)
    for name, value in merged.items():
        if name.endswith(FP32_FAMILIES) or name.startswith(("vision_tower.", "mm_projector.")):
            assert value.dtype == base[name].dtype and torch.equal(value, base[name]), name
    assert sum(name.endswith(FP32_FAMILIES) and t.dtype == torch.float32 for name, t in merged.items()) > 0
    AutoModelForImageTextToText.from_pretrained(out)


def test_merged_hf_reloads_and_the_peft_keys_are_plain_pefts_on_the_auto_class(job):
    """The peft export's keys are the names plain peft gives the base loaded by ``AutoModelForCausalLM`` (the
    whole image+text model, ``language_model.`` inside). Its experts are MXFP4 there, which plain peft cannot
    adapt (docs/exports.md "Packed bases": the adapter loads onto the dequantised base; the full load with
    ``AutoPeftModelForCausalLM`` over a bf16 base is tests/export/test_k3_release_export.py), so the names are
    compared, and the shapes of every adapter but the experts'."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import moe_plugin

    merged = AutoModelForCausalLM.from_pretrained(job["exports"]["merged-hf"])
    assert isinstance(merged, moe_plugin.MoEPluginForConditionalGeneration)
    out = job["exports"]["peft"]
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.language_model.model.layers.") for k in saved)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(job["base"]), LoraConfig.from_pretrained(out))
    names = {k.replace(".default", ""): v for k, v in plain.state_dict().items() if "lora_" in k}
    assert set(saved) == set(names), sorted(set(saved) ^ set(names))[:4]
    for key, value in saved.items():
        assert ".experts." in key or names[key].shape == value.shape, key


@pytest.mark.parametrize("to", FORMATS)
def test_every_export_carries_the_tokenizer(job, to):
    from transformers import AutoTokenizer

    out = job["exports"][to]
    for name in TOKENIZER_FILES + BESIDE:
        assert os.path.isfile(os.path.join(out, name)), (to, name)
    text = "The sky is blue, 2 + 3 = 5."
    ids = AutoTokenizer.from_pretrained(out, trust_remote_code=True).encode(text)
    assert ids == AutoTokenizer.from_pretrained(job["base"], trust_remote_code=True).encode(text)


def test_the_loading_hint_trusts_the_remote_tokenizer(job):
    """eval.answers' hint for loading the adapter names trust_remote_code for K3's remote-code tokenizer, and
    its tokenizer line runs."""
    from transformers import AutoTokenizer

    from moe_plugin.training.metrics.answer_eval import loading_hint

    adapter = os.path.join(job["run"], "adapter")
    hint = loading_hint(job["base"], adapter, images=False)
    assert f"AutoTokenizer.from_pretrained({adapter!r}, trust_remote_code=True)" in hint
    assert AutoTokenizer.from_pretrained(adapter, trust_remote_code=True).encode("blue")
