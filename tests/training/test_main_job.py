"""The README's main job, its own 150 steps with fewer held-out pictures (the same path): the deepspeed launcher on
2 CPU processes, megatron's expert parallelism 2 under ZeRO-3, LoRA over the shipped image base
(``recipes/bases/tiny-shapes``, trained on the shapes' colours) learning to name the background's colour.

What is checked is what a user sees: the printed chance level and ``held-out accuracy: before X after Y`` line,
with the accuracy risen to >= 0.9; the offline W&B run it names (with its ``wandb sync`` command) holding the
logged steps, and in its last row the experts kept balanced by the router balance loss the recipe turns on
(every MoE layer's busiest expert <= 1.5x the mean load, none dead; before it, 3.1x with near-dead experts);
no deprecation warning of a collective in the output (they used to break the progress bar); and, independently of the
trainer's own evaluation, the adapter loaded with plain peft from another working directory answers the held-out
pictures by ``generate`` as the trainer reported."""

from __future__ import annotations

import pytest
import json
import os
import re

import torch

from moe_plugin.recipe.schema import DEFAULT_ROUTER_AUX_LOSS_COEFF
from tests.training.launchers import BIN, REPO, free_port, launch
from tests.training.wandb_records import offline_history

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

HELD_OUT = 24  # pictures answered (the full job answers 60)
STEPS = 150  # the job's own: the balance figures the README reports are its final ones


def _main_job(tmp_path) -> str:
    with open(os.path.join(REPO, "recipes", "tiny_lora.json")) as f:
        recipe = json.load(f)
    assert recipe["parallel"] == {"backend": "megatron", "expert_parallel_size": 2}  # the job's own layout
    recipe["output_dir"] = str(tmp_path / "run")
    assert recipe["schedule"]["steps"] == STEPS
    assert recipe["lora"]["router_balance"] == {"aux_loss_coeff": DEFAULT_ROUTER_AUX_LOSS_COEFF}  # on, as by default
    recipe["eval"]["answers"]["limit"] = HELD_OUT
    path = tmp_path / "main_job.json"
    path.write_text(json.dumps(recipe))
    return str(path)


@torch.no_grad()
def _answers_in_plain_peft(model, held_out: str, limit: int):
    """Greedy answers of ``model`` (the base + adapter in peft) to the first ``limit`` pictures, by ``generate``."""
    import moe_plugin
    from moe_plugin.training.metrics.answer_eval import read_questions

    processor, given = moe_plugin.MoEProcessor(), []
    for question in read_questions(held_out, limit):
        text = processor.apply_chat_template(question.messages, add_generation_prompt=True)
        inputs = processor(text, images=question.images)
        out = model.generate(**inputs, do_sample=False, max_new_tokens=16)
        assert out[0, -1].item() in model.generation_config.eos_token_id  # it stopped at end of sequence
        answer = out[0, inputs["input_ids"].shape[1] :]
        given.append(processor.tokenizer.decode(answer, skip_special_tokens=True).strip())
    return given


def test_main_job_raises_held_out_accuracy_with_balanced_experts(tmp_path, monkeypatch):
    out = launch(
        [
            os.path.join(BIN, "deepspeed"),
            "--num_accelerators",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "moe_plugin.train",
            "--recipe",
            _main_job(tmp_path),
        ],
        env_extra={"WANDB_MODE": "offline"},
        timeout=1500,
    )  # no network, whatever the machine's setting
    assert "expert parallel 2, ZeRO stage 3" in out
    for collective in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        assert f"`torch.distributed.{collective}` is deprecated" not in out
    # the recipe's W&B run is offline by default, inside the run's directory
    run_dir, synced = re.search(r"^W&B run \(offline\): (\S+); upload it with: wandb sync (\S+)$", out, re.M).groups()
    assert run_dir == synced and run_dir.startswith(str(tmp_path / "run" / "wandb" / "offline-run-"))
    rows = [row for row in offline_history(run_dir) if "train/loss" in row]
    assert [row["_step"] for row in rows] == [1, 25, 50, 75, 100, 125, 150]  # logging.every 25 and the first step
    final = rows[-1]  # the load of steps 126-150 against the mean, per layer
    layers = sorted(k for k in final if k.startswith("moe/layer") and k.endswith("/load_max_over_mean"))
    assert len(layers) == 3 and all(final[k] <= 1.5 for k in layers), {k: final[k] for k in layers}
    assert final["moe/dead_experts"] == 0 and final["moe/load_max_over_mean"] <= 1.5
    assert 0 < final["moe/aux_loss"] and final["moe/rank_load_max_over_mean"] >= 1.0
    chance = float(
        re.search(
            r"chance level: ([0-9.]+) \(always the most common of 4 answers, "
            rf"{HELD_OUT} held-out examples\)",
            out,
        ).group(1)
    )
    before, after = map(float, re.search(r"held-out accuracy: before ([0-9.]+) after ([0-9.]+)", out).groups())
    assert after >= 0.9 and after - before >= 0.3 and after > chance + 0.3, (chance, before, after)

    with open(tmp_path / "run" / "answers.json") as f:
        reported = json.load(f)
    expected = reported["expected"]
    # the base answers the shape's colour, which is never the background's
    assert reported["given_before"] != expected and reported["before"] == before
    monkeypatch.chdir(tmp_path)  # the adapter loads from any working directory
    import moe_plugin  # noqa: F401  (registers the Auto classes)
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForImageTextToText

    adapter = str(tmp_path / "run" / "adapter")
    held_out = os.path.join(REPO, "recipes", "data", "backgrounds_heldout.jsonl")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    # as the job's printed hint says, and through peft's auto class (no import allow-list: the base's
    # `architectures` makes AutoModelForCausalLM build the image+text model)
    hinted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    auto = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    assert type(auto.base_model.model) is type(hinted.base_model.model)
    for model in (hinted, auto):
        given = _answers_in_plain_peft(model, held_out, HELD_OUT)
        assert given == reported["given_after"]
        assert abs(sum(g == e for g, e in zip(given, expected)) / HELD_OUT - after) < 0.005
