"""Held-out answers by greedy generation (moe_plugin/training/metrics/answer_eval.py) and the main job's generated data
(examples/shape_tasks.py): answers against a plain greedy loop, stopping at end of sequence, the
chance level by hand, named errors, and pictures whose answers are read back from their pixels."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from moe_plugin.models import MoEPluginForConditionalGeneration, MoEProcessor, preset_config
from moe_plugin.training.metrics.answer_eval import Question, accuracy, answer, chance_level, read_questions
from moe_plugin.recipe.schema import recipe_from_dict
from examples.shape_tasks import image_bytes, task_records, write_main_job_data, write_task
from examples.shapes import COLORS


def _image(record):
    from PIL import Image

    source = record["messages"][0]["content"][0]["image"]
    return Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")


def _nearest(rgb):
    return min(COLORS, key=lambda c: np.abs(rgb - np.array(COLORS[c])).sum())


def _read_back(image):
    """(colour, background, shape) from the pixels alone: the fill colour, the corner's colour (the shape keeps
    2 pixels from the border), and how much of its bounding box the fill covers."""
    pixels = np.asarray(image).astype(int)
    background = pixels[0, 0]
    filled = np.abs(pixels - background).sum(-1) > 60
    rows, cols = np.nonzero(filled)
    share = filled.sum() / ((rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1))
    shape = "square" if share > 0.9 else ("circle" if share > 0.65 else "triangle")
    assert filled.mean() < 0.3  # the background is always the larger area
    return {"color": _nearest(pixels[filled].mean(0)), "background": _nearest(background), "shape": shape}


@pytest.mark.parametrize("task", ["color", "background", "shape"])
def test_answers_are_what_the_picture_shows(task):
    records = task_records(task, 40, seed=3)
    questions = {r["messages"][0]["content"][1]["text"] for r, _ in records}
    assert len(questions) == 1  # the text is the same for every picture: only the image answers it
    for record, _ in records:
        seen = _read_back(_image(record))
        assert seen["color"] != seen["background"]
        assert record["messages"][1]["content"] == seen[task]
    answers = [r["messages"][1]["content"] for r, _ in records]
    assert len(set(answers)) == (3 if task == "shape" else 4)


def test_held_out_images_never_appear_in_training(tmp_path):
    paths = write_main_job_data(str(tmp_path), scale=0.05)
    train = image_bytes(paths["colors_train.jsonl"]) | image_bytes(paths["backgrounds_train.jsonl"])
    held_out = image_bytes(paths["backgrounds_heldout.jsonl"])
    assert held_out and not held_out & train
    # the exclusion is what keeps them apart: the held-out seed redrawn with a training file excluded skips
    # exactly the pictures that file holds
    trained = image_bytes(paths["backgrounds_train.jsonl"])
    again = write_task(str(tmp_path / "again.jsonl"), "background", 30, seed=12, exclude=trained)
    assert not image_bytes(again) & trained


def test_chance_level_is_the_most_common_answers_share():
    assert chance_level(["circle", "square", "circle", "triangle"]) == 0.5
    assert chance_level(["red"]) == 1.0
    with pytest.raises(ValueError, match="at least one"):
        chance_level([])


def _tiny_model():
    torch.manual_seed(0)
    model = MoEPluginForConditionalGeneration(preset_config("tiny", vocab_size=272)).eval()
    return model


@torch.no_grad()
def _greedy_reference(model, processor, question, max_new_tokens, eos):
    """Greedy decoding by full forwards (no cache), stopping after an ``eos`` token."""
    text = processor.apply_chat_template(question.messages, add_generation_prompt=True)
    inputs = processor(text, images=question.images)
    ids, new = inputs["input_ids"], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, pixel_patches=inputs["pixel_patches"], grid_hw=inputs["grid_hw"]).logits
        logits[0, -1, model.config.image_token_id] = -float("inf")  # generate never emits a placeholder
        token = int(logits[0, -1].argmax())
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if token in eos:
            break
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip(), new


def test_answer_is_greedy_and_stops_at_end_of_sequence():
    model, processor = _tiny_model(), MoEProcessor()
    record, _ = task_records("shape", 1, seed=5)[0]
    question = Question(
        [{"role": "user", "content": [{"type": "image"}, record["messages"][0]["content"][1]]}],
        [_image(record)],
        "circle",
        "test",
    )
    model.generation_config.eos_token_id = None
    text, tokens = _greedy_reference(model, processor, question, 6, eos=())
    assert answer(model, processor, question, max_new_tokens=6) == text
    # the third generated token as end of sequence: generation stops there (and drops it if special)
    stop = tokens[2]
    model.generation_config.eos_token_id = stop
    short, short_tokens = _greedy_reference(model, processor, question, 6, eos=(stop,))
    assert len(short_tokens) == 3 and answer(model, processor, question, max_new_tokens=6) == short
    correct, given = accuracy(
        model, processor, [question, Question(question.messages, question.images, short, "test")], max_new_tokens=6
    )
    assert given == [short, short] and correct == (1 if short != "circle" else 2)


def test_read_questions_names_a_record_without_a_final_answer(tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "more?"},
                ]
            }
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"eval\.answers\.path: line 1 of .*held\.jsonl.*assistant's answer"):
        read_questions(str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="eval.answers.path.*holds no records"):
        read_questions(str(path))


def test_recipe_answers_section_names_its_problems(tmp_path):
    base = {"output_dir": str(tmp_path / "out"), "model": {"preset": "tiny"}}
    with pytest.raises(ValueError) as err:
        recipe_from_dict(
            {**base, "eval": {"answers": {"path": str(tmp_path / "none.jsonl"), "max_new_tokens": 0, "limt": 3}}}
        )
    text = str(err.value)
    assert "eval.answers.max_new_tokens: must be > 0" in text
    assert "eval.answers.limt: unknown key" in text and "did you mean 'limit'" in text
    with pytest.raises(ValueError, match=r"eval\.answers\.path: .*none\.jsonl' does not exist"):
        recipe_from_dict({**base, "eval": {"answers": {"path": str(tmp_path / "none.jsonl")}}})
    held = tmp_path / "held.jsonl"
    held.write_text("{}\n")
    recipe = recipe_from_dict({**base, "eval": {"answers": {"path": str(held)}}})
    assert recipe.eval.answers.max_new_tokens == 16 and recipe.eval.answers.limit is None
