"""The shipped subword base (recipes/bases/tiny-subword) and its LoRA recipe, checked with plain transformers + peft.

The trainer runs a shortened recipes/tiny_subword_lora.json in this process; the held-out loss and answers
are then computed here, from the base's own tokenizer and chat template, not by the trainer's code.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "bases" / "tiny-subword"
RECIPE = ROOT / "recipes" / "tiny_subword_lora.json"
STEPS = 60  # the shipped recipe's 100 steps reach a loss of 0.01 by step 40


def _heldout(recipe: dict):
    path = ROOT / recipe["eval"]["answers"]["path"]
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def _encode(tokenizer, messages):
    """(ids, labels) of one chat: labels on the assistant's answer and its end of turn only."""

    def ids(*args, **kwargs):
        out = tokenizer.apply_chat_template(*args, tokenize=True, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full = ids(messages)
    prompt = ids(messages[:-1], add_generation_prompt=True)
    assert full[: len(prompt)] == prompt
    return torch.tensor([full]), torch.tensor([[-100] * len(prompt) + full[len(prompt) :]])


@torch.no_grad()
def _heldout_loss(model, tokenizer, chats) -> float:
    total, count = 0.0, 0
    for messages in chats:
        input_ids, labels = _encode(tokenizer, messages)
        logits = model(input_ids=input_ids).logits[0, :-1].float()
        target = labels[0, 1:]
        total += torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
    return total / count


@torch.no_grad()
def _answers(model, tokenizer, chats):
    out = []
    for messages in chats:
        prompt = tokenizer.apply_chat_template(
            messages[:-1], add_generation_prompt=True, tokenize=True, return_tensors="pt"
        )
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        generated = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False
        )
        out.append(tokenizer.decode(generated[0, prompt.shape[1] :], skip_special_tokens=True).strip())
    return out


def test_lora_over_the_subword_base_learns_the_held_out_answers(tmp_path, monkeypatch):
    import moe_plugin  # noqa: F401  registers the Auto classes
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_plugin.training.data import pipeline as training_data
    from moe_plugin.training.loop import train
    from moe_plugin.recipe.schema import recipe_from_dict

    tokenizer = AutoTokenizer.from_pretrained(str(BASE))
    assert type(tokenizer).__name__ != "ByteTokenizer"
    assert len(tokenizer) == 240 < 256  # a byte id (up to 255) may be out of range here, never silently valid

    shipped = json.loads(RECIPE.read_text())
    recipe = dict(shipped, output_dir=str(tmp_path / "run"))
    recipe["model"] = dict(shipped["model"], from_pretrained=str(BASE))
    recipe["data"] = dict(shipped["data"], path=str(ROOT / shipped["data"]["path"]))
    recipe["schedule"] = dict(shipped["schedule"], steps=STEPS)
    recipe["eval"] = {"every": 0}  # the test scores the run itself below
    recipe["checkpoint"] = {"every": 0, "keep": 1}
    recipe["logging"] = {"every": 20, "progress_bar": False, "wandb": {"mode": "disabled"}}

    fed = []
    next_step = training_data.StepBatches.next_step

    def recording(self, dp_rank):
        micro_batches, label_tokens = next_step(self, dp_rank)
        fed.extend(mb.input_ids for mb in micro_batches)
        fed.extend(mb.labels[mb.labels != -100] for mb in micro_batches)
        return micro_batches, label_tokens

    monkeypatch.setattr(training_data.StepBatches, "next_step", recording)
    result = train(recipe_from_dict(recipe))
    assert len(result.losses) == STEPS and len(fed) > 0
    ids = torch.cat([t.reshape(-1) for t in fed])
    assert int(ids.min()) >= 0 and int(ids.max()) < 240, int(ids.max())

    chats = _heldout(shipped)
    expected = [m[-1]["content"] for m in chats]
    base = AutoModelForCausalLM.from_pretrained(str(BASE)).eval()
    before = _heldout_loss(base, tokenizer, chats)
    before_answers = _answers(base, tokenizer, chats)
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(BASE)), str(tmp_path / "run" / "adapter")
    ).eval()
    after = _heldout_loss(tuned, tokenizer, chats)
    after_answers = _answers(tuned, tokenizer, chats)

    assert after < before, (before, after)
    # chance: always answering the most common held-out colour; the base, which names the shape's colour
    # (never the background's), scores at most that, the adapter far above it
    chance = max(Counter(expected).values()) / len(expected)
    bound = chance + 0.4
    right = sum(a == e for a, e in zip(after_answers, expected)) / len(expected)
    assert right >= bound, (chance, after_answers, expected)
    assert sum(a == e for a, e in zip(before_answers, expected)) / len(expected) <= chance, before_answers
