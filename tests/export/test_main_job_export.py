"""Every export of the README's main job reloads to the trained model's logits on a held-out picture.

One shortened main job (``recipes/tiny_lora.json`` as shipped, but 4 steps over 16 pictures, 2 answered, a
checkpoint every 2 steps) runs through the deepspeed launcher on 2 CPU processes (megatron, EP 2 x ZeRO-3), as
tests/training/test_main_job.py does. Its final adapter and its last checkpoint (``--step 4``, which holds the
same adapter) are exported in all four formats with the command (``moe_plugin.cli.main``), and each export is
reloaded with plain transformers / peft (K3's layout with ``load_k3_checkpoint``). The trained model is the
run's adapter put on ``AutoModelForImageTextToText`` with ``PeftModel``, the way the job's last line says."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tolerances import chain_length, chain_rel
from tests.training.launchers import BIN, REPO, free_port, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

FORMATS = ("peft", "per-expert", "merged-hf", "merged-k3")
STEPS, EVERY, PICTURES = 4, 2, 16
HELD_OUT = os.path.join(REPO, "recipes", "data", "backgrounds_heldout.jsonl")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The shortened main job's run directory and its 8 exports (``{(format, step or None): directory}``)."""
    from moe_plugin.cli import main

    tmp = tmp_path_factory.mktemp("main_job_export")
    with open(os.path.join(REPO, "recipes", "tiny_lora.json")) as f:
        recipe = json.load(f)
    assert recipe["parallel"] == {"backend": "megatron", "expert_parallel_size": 2}  # the job's own layout
    with open(os.path.join(REPO, recipe["data"]["path"])) as f:
        (tmp / "train.jsonl").write_text("".join(f.readlines()[:PICTURES]))
    recipe["output_dir"], recipe["data"]["path"] = str(tmp / "run"), str(tmp / "train.jsonl")
    recipe["schedule"]["steps"], recipe["checkpoint"] = STEPS, {"every": EVERY}
    recipe["eval"]["answers"]["limit"] = 2
    (tmp / "recipe.json").write_text(json.dumps(recipe))
    launch(
        [
            os.path.join(BIN, "deepspeed"),
            "--num_accelerators",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "moe_plugin.train",
            "--recipe",
            str(tmp / "recipe.json"),
        ],
        timeout=1500,
    )
    exports = {}
    for to in FORMATS:
        for step in (None, STEPS):
            out = str(tmp / f"{to}-{step or 'final'}")
            assert (
                main(
                    ["export", "--run", str(tmp / "run"), "--to", to, out]
                    + ([] if step is None else ["--step", str(step)])
                )
                == 0
            )
            exports[to, step] = out
    return {"run": str(tmp / "run"), "exports": exports}


def _picture_inputs():
    """The processor's inputs for a held-out picture the run never trained on nor answered (record 10)."""
    import moe_plugin
    from moe_plugin.training.metrics.answer_eval import read_questions

    question = read_questions(HELD_OUT, 11)[10]
    processor = moe_plugin.MoEProcessor()
    text = processor.apply_chat_template(question.messages, add_generation_prompt=True)
    inputs = processor(text, images=question.images)
    assert inputs["pixel_patches"].shape[0] > 0
    return inputs


def _base(run: str) -> str:
    with open(os.path.join(run, "adapter", "adapter_config.json")) as f:
        return json.load(f)["base_model_name_or_path"]


def _with_per_expert_adapter(model, directory: str):
    """Add every ``scaling * B @ A`` of a per-expert export to the weight its key names, as a serving engine
    does (the main job trains no expert adapter, so every key names a dense weight of the image model)."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    state, params = load_file(os.path.join(directory, "adapter_model.safetensors")), dict(model.named_parameters())
    keys_a = [k for k in state if k.endswith(".lora_A.weight")]
    assert keys_a and len(state) == 2 * len(keys_a)
    with torch.no_grad():
        for key in keys_a:
            stem = key[len("base_model.model.") : -len(".lora_A.weight")]
            params[stem + ".weight"].add_(
                scaling * state[stem.join(("base_model.model.", ".lora_B.weight"))] @ state[key]
            )
    return model


def _reloaded(to: str, directory: str, base: str):
    import moe_plugin  # noqa: F401  (registers the Auto classes)
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    if to == "peft":
        return PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), directory)
    if to == "per-expert":
        return _with_per_expert_adapter(AutoModelForImageTextToText.from_pretrained(base), directory)
    if to == "merged-hf":
        return AutoModelForImageTextToText.from_pretrained(directory)
    return moe_plugin.models.load_k3_checkpoint(directory, model_cls=moe_plugin.MoEPluginForConditionalGeneration)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


def test_every_export_of_the_main_job_gives_the_trained_models_logits_on_a_picture(job):
    import moe_plugin  # noqa: F401
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base_path, inputs = _base(job["run"]), _picture_inputs()
    base = AutoModelForImageTextToText.from_pretrained(base_path).float().eval()
    assert isinstance(base, moe_plugin.MoEPluginForConditionalGeneration)
    with torch.no_grad():
        untrained = base(**inputs).logits.float()
        trained = PeftModel.from_pretrained(base, os.path.join(job["run"], "adapter")).eval()(**inputs).logits.float()
    # fp32 rounding of one forward pass, reordered (a merged weight is rounded once more): the text layers and
    # the tower's, over the widest of the hidden sizes, the MLP widths and the prompt
    config, vision = base.config, base.config.to_model_config().vision
    width = max(config.hidden_size, config.intermediate_size, vision.intermediate_size, inputs["input_ids"].shape[1])
    bound = chain_rel(chain_length(0, config.num_hidden_layers + vision.num_layers, width, 0))
    assert _relative(untrained, trained) > 20 * bound  # the adapter's effect is far beyond rounding
    for (to, step), directory in job["exports"].items():
        with open(os.path.join(directory, "moe_plugin_export.json")) as f:
            manifest = json.load(f)
        assert manifest["step"] == step and manifest["check"]["allowed"] == 1e-5  # written in fp32
        model = _reloaded(to, directory, base_path).float().eval()
        inner = getattr(model, "get_base_model", lambda m=model: m)()
        assert isinstance(inner, moe_plugin.MoEPluginForConditionalGeneration)
        with torch.no_grad():
            got = model(**inputs).logits.float()
        assert _relative(got, trained) <= bound, (to, step, _relative(got, trained), bound)


def test_merged_exports_keep_the_base_vision_tensors_bit_for_bit(job):
    from moe_plugin.weights.names import VISION_PREFIXES
    from tests.export.saved_files import directory_tensors

    base = {n: t for n, t in directory_tensors(_base(job["run"])).items() if n.startswith(VISION_PREFIXES)}
    assert base
    for to in ("merged-hf", "merged-k3"):
        for step in (None, STEPS):
            written = directory_tensors(job["exports"][to, step])
            assert all(torch.equal(written[n], t) for n, t in base.items()), (to, step)


def test_the_last_checkpoint_exports_the_final_adapter(job):
    """``--step 4`` of a 4-step run is the final adapter under the same (image model's) names, bit for bit."""
    from safetensors.torch import load_file

    final = load_file(os.path.join(job["exports"]["peft", None], "adapter_model.safetensors"))
    last = load_file(os.path.join(job["exports"]["peft", STEPS], "adapter_model.safetensors"))
    assert sorted(final) == sorted(last) and all(k.startswith("base_model.model.language_model.") for k in final)
    assert all(torch.equal(final[k], last[k]) for k in final)
