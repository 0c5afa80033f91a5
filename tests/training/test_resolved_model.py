"""The model resolved once (moe_plugin/recipe/resolved_model.py): the trainer's ids and labels come from the
base's own tokenizer and chat template, for the byte base and a subword base; a base without a tokenizer, or
with remote code not trusted, is refused; adapter/ and merged exports carry the base's tokenizer files."""

from __future__ import annotations

import base64
import filecmp
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moe_plugin.training.data.pipeline import IGNORE, load_examples
from moe_plugin.recipe.schema import recipe_from_dict
from moe_plugin.recipe.resolved_model import resolve_model, tokenizer_files
from tests.recipes import minimal

REPO = Path(__file__).resolve().parents[2]
BYTE_BASE, SUBWORD = REPO / "recipes/bases/tiny-arith", REPO / "recipes/bases/tiny-subword"
REMOTE = REPO / "tests/fixtures/remote_tokenizer"
MERGE = 2  # the image processor's merge size


def _png(color) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


USER = {"role": "user", "content": "What is 37 - 12?"}
CHATS = {
    "one turn": [USER, {"role": "assistant", "content": "25"}],
    "several turns": [
        USER,
        {"role": "assistant", "content": "25"},
        {"role": "user", "content": "And 9 + 4?"},
        {"role": "assistant", "content": "It is 13."},
    ],
    "image": [
        {
            "role": "user",
            "content": [{"type": "image", "image": _png("red")}, {"type": "text", "text": "What color is the shape?"}],
        },
        {"role": "assistant", "content": "red"},
    ],
}


def _subword_checkpoint(path: Path, image: bool) -> Path:
    """A tiny model with the subword tokenizer's ids (240, pad/bos/eos 0/1/2, image: its <|media_pad|> 12)
    and that tokenizer's files."""
    from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration, preset_config

    torch.manual_seed(0)
    config = preset_config(
        "tiny", vocab_size=240, pad_token_id=0, bos_token_id=1, eos_token_id=2, image_token_id=12, attn_res=False
    )
    if not image:
        config.vision_config = None
    (MoEPluginForConditionalGeneration if image else MoEPluginForCausalLM)(config).save_pretrained(path)
    for name in tokenizer_files(str(SUBWORD)):
        shutil.copy(SUBWORD / name, path / name)
    return path


@pytest.fixture(scope="module")
def subword_base(tmp_path_factory) -> Path:
    return _subword_checkpoint(tmp_path_factory.mktemp("subword") / "base", image=True)


def _bases(subword_base):
    return {"byte": BYTE_BASE, "subword": subword_base}


def _recipe(tmp_path, base, data: Path, **model) -> object:
    return recipe_from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"from_pretrained": str(base), **model},
            "data": {"kind": "sft", "path": str(data), "seq_len": 512, "eval_fraction": 0.0},
        }
    )


def _expected(tok, messages, image_id, tokens_per_image):
    """ids and labels computed here from apply_chat_template: after each prompt rendered with the generation
    prompt, the answer's own tokens and <|im_end|> are trained; each image placeholder stands for its tokens."""
    bare = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [{"type": "image"} if i["type"] == "image" else i for i in m["content"]],
        }
        for m in messages
    ]

    def render(msgs, prompt=False):
        return list(tok.apply_chat_template(msgs, add_generation_prompt=prompt, return_dict=True)["input_ids"])

    ids = render(bare)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(bare):
        if message["role"] == "assistant":
            start = len(render(bare[:i], prompt=True))
            answer = tok.encode(message["content"], add_special_tokens=False) + [
                tok.convert_tokens_to_ids("<|im_end|>")
            ]
            assert ids[start : start + len(answer)] == answer  # the answer is where the template put it
            labels[start : start + len(answer)] = answer
    out_ids, out_labels, counts = [], [], iter(tokens_per_image)
    for t, label in zip(ids, labels):
        n = next(counts) if t == image_id else 1
        out_ids += [t] * n
        out_labels += [IGNORE if t == image_id else label] * n
    return out_ids, out_labels


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("which", ["byte", "subword"])
def test_trainer_ids_and_labels_equal_the_bases_chat_template(tmp_path, subword_base, which, chat):
    from transformers import AutoTokenizer

    base = _bases(subword_base)[which]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": CHATS[chat]}) + "\n")
    recipe = _recipe(tmp_path, base, data)
    resolved = resolve_model(recipe.model)
    (example,), held_out = load_examples(
        recipe.data, recipe.seed, resolved.tokenizer, resolved.tokens, resolved.processor
    )
    assert held_out == []
    tok = AutoTokenizer.from_pretrained(str(base))
    image_id = tok.convert_tokens_to_ids("<|image|>" if which == "byte" else "<|media_pad|>")
    per_image = (
        [int(h) * int(w) // MERGE**2 for h, w in example.images.grid_hw.tolist()] if example.images is not None else []
    )
    assert per_image == ([(84 // 14) * (56 // 14) // MERGE**2] if chat == "image" else [])
    assert (example.input_ids, example.labels) == _expected(tok, CHATS[chat], image_id, per_image)
    assert resolved.tokens.image_token_id == image_id
    if which == "subword":  # subword ids: not the byte tokenizer's, and the run says which tokenizer it uses
        assert max(example.input_ids) < 240 and type(resolved.tokenizer).__name__ != "ByteTokenizer"
        assert resolved.tokenizer_note.startswith("tokenizer: the base's own ") and str(base) in resolved.tokenizer_note


def test_a_preset_uses_the_byte_tokenizer_and_says_so():
    resolved = resolve_model(recipe_from_dict({"output_dir": "x", "model": {"preset": "tiny"}}).model)
    assert (resolved.path, resolved.format, type(resolved.tokenizer).__name__) == (None, "preset", "ByteTokenizer")
    assert resolved.tokenizer_note.startswith("tokenizer: the built-in byte tokenizer (preset 'tiny'")


def test_the_format_and_configs_are_resolved_once(subword_base, tmp_path):
    recipe = recipe_from_dict(
        {"output_dir": "x", "model": {"from_pretrained": str(subword_base), "overrides": {"num_experts_per_token": 1}}}
    )
    resolved = resolve_model(recipe.model)
    assert resolved.path == str(subword_base.resolve()) and resolved.format == "hf"
    assert resolved.model_config.moe.top_k == 1 and resolved.hf_config.num_experts_per_token == 1
    assert resolved.processor is not None and resolved.processor.tokenizer is resolved.tokenizer


def test_a_base_without_a_tokenizer_is_refused_naming_the_field(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(BYTE_BASE / name, bare / name)
    recipe = recipe_from_dict({"output_dir": str(tmp_path / "run"), "model": {"from_pretrained": str(bare)}})
    with pytest.raises(ValueError) as err:
        resolve_model(recipe.model)
    message = str(err.value)
    assert message.startswith(f"model.from_pretrained: {bare.resolve()} holds no tokenizer") and "\n" not in message
    assert "copy the base's tokenizer files into it" in message


def test_a_remote_code_tokenizer_is_refused_naming_trust_remote_code(tmp_path):
    base = tmp_path / "remote"
    base.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(BYTE_BASE / name, base / name)
    for name in ("tokenizer_config.json", "tokenization_tiny.py"):
        shutil.copy(REMOTE / name, base / name)
    recipe = recipe_from_dict({"output_dir": str(tmp_path / "run"), "model": {"from_pretrained": str(base)}})
    assert recipe.model.trust_remote_code is False
    with pytest.raises(ValueError) as err:
        resolve_model(recipe.model)
    message = str(err.value)
    assert message.startswith("model.trust_remote_code: ") and "set model.trust_remote_code to true" in message
    assert "\n" not in message
    assert not [n for n in sys.modules if n.endswith("tokenization_tiny")]  # the payload never ran
    # the refusal names the field a recipe writes
    assert recipe_from_dict(
        {"output_dir": "x", "model": {"from_pretrained": str(base), "trust_remote_code": True}}
    ).model.trust_remote_code


def _words(n: int):
    words = ["red", "blue", "green", "yellow"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Say the color number {i % 4}."},
                {"role": "assistant", "content": words[i % 4]},
            ]
        }
        for i in range(n)
    ]


def test_adapter_and_merged_export_carry_the_bases_tokenizer_files(tmp_path):
    from transformers import AutoTokenizer

    from moe_plugin.export import export_run
    from moe_plugin.training.loop import train

    subword_base = _subword_checkpoint(tmp_path / "base", image=False)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _words(32)))
    recipe = recipe_from_dict(
        minimal(
            tmp_path / "run",
            base=subword_base,
            seed=1,
            lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj"]},
            data={"kind": "sft", "path": str(data), "seq_len": 64, "eval_fraction": 0.0},
            parallel={"backend": "hf"},
            schedule={"steps": 2, "micro_batch_size": 2, "warmup_steps": 0},
            eval={"every": 0, "batches": 1},
            checkpoint={"every": 0, "keep": 1},
            logging={"every": 1, "wandb": {"mode": "disabled"}},
        )
    )
    train(recipe)
    names = tokenizer_files(str(subword_base))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    out = tmp_path / "merged"
    export_run(str(tmp_path / "run"), "merged-hf", str(out))
    base_tok = AutoTokenizer.from_pretrained(str(subword_base))
    for directory in (tmp_path / "run" / "adapter", out):
        assert tokenizer_files(str(directory)) == names
        for name in names:
            assert filecmp.cmp(subword_base / name, directory / name, shallow=False), (directory, name)
        tok = AutoTokenizer.from_pretrained(str(directory))
        assert type(tok).__name__ != "ByteTokenizer" and tok.get_vocab() == base_tok.get_vocab()
        assert tok.chat_template == base_tok.chat_template
