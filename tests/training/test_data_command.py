"""``moe-plugin data --recipe R``: its records and its ``--dump`` are what the trainer's data path gives
(``load_examples`` then ``pack_examples``), on a K3-style base (the tests/fixtures/k3_tokenizer tokenizer in a
saved config's directory, no weights: the command loads no model) and on the shipped subword base."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_plugin.cli import main as cli_main
from moe_plugin.models import preset_config
from moe_plugin.models.base_tokenizer import k3_image_prompt
from moe_plugin.recipe.resolved_model import resolve_model
from moe_plugin.recipe.schema import load_recipe
from moe_plugin.training.data.command import render_labels
from moe_plugin.training.data.pipeline import load_examples, pack_examples
from tests.recipes import minimal, whole

REPO = Path(__file__).resolve().parents[2]
K3_TOKENIZER = REPO / "tests" / "fixtures" / "k3_tokenizer"
K3_IDS = json.loads((K3_TOKENIZER / "k3_token_ids.json").read_text())
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "What is 2 + 3? <|open|>"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Use the tool.",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
        ],
        "tools": TOOLS,
    },
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]},
]


@pytest.fixture(scope="module")
def k3_base(tmp_path_factory):
    base = tmp_path_factory.mktemp("k3-base")
    config = preset_config(
        "tiny",
        vocab_size=K3_IDS["vocab_size"],
        bos_token_id=K3_IDS["bos_token_id"],
        eos_token_id=K3_IDS["eos_token_id"],
        pad_token_id=K3_IDS["pad_token_id"],
    )
    config.save_pretrained(base)
    for name in ("tokenizer_config.json", "tiktoken.model", "tokenization_kimi.py", "encoding_k3.py"):
        shutil.copy(K3_TOKENIZER / name, base / name)
    return base


def write_recipe(tmp_path, base, data):
    recipe = minimal(tmp_path / "out", base=base, model={"trust_remote_code": True}, data=whole(data))
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def pipeline_rows(recipe_path):
    recipe = load_recipe(recipe_path)
    resolved = resolve_model(recipe.model)
    train, held_out = load_examples(recipe.data, recipe.seed, resolved.tokenizer, resolved.tokens, resolved.processor)
    rows = pack_examples(train, recipe.data.seq_len, recipe.data.pack, resolved.tokens.pad_id)
    return resolved.tokenizer, train, rows


def test_data_command_on_a_k3_base(tmp_path, k3_base, capsys):
    data_path = tmp_path / "chats.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = {
        "kind": "sft",
        "path": str(data_path),
        "seq_len": 512,
        "eval_fraction": 0.0,
        "chat_template_kwargs": {"thinking_effort": "high"},
    }
    recipe_path = write_recipe(tmp_path, k3_base, data)
    dump = tmp_path / "dump.jsonl"
    assert cli_main(["data", "--recipe", recipe_path, "--records", "-1", "--ids", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    tokenizer, train, rows = pipeline_rows(recipe_path)
    # the dump is the trainer's rows, field for field
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [(d["input_ids"], d["labels"], d["cu_seqlens"]) for d in lines] == [
        (r.input_ids.tolist(), r.labels.tolist(), r.cu_seqlens.tolist()) for r in rows
    ]
    assert [s for d in lines for s in d["sources"]] == [f"line 1 of {data_path}", f"line 2 of {data_path}"]
    # and each record's ids are the tokenizer's own rendering with the recipe's switch and the record's tools
    k3 = AutoTokenizer.from_pretrained(K3_TOKENIZER, trust_remote_code=True, local_files_only=True)
    for example, record in zip(train, RECORDS):
        want = k3.apply_chat_template(
            record["messages"],
            tools=record.get("tools"),
            add_generation_prompt=False,
            tokenize=True,
            thinking_effort="high",
        )
        assert example.input_ids == want
        assert render_labels(tokenizer, example.input_ids, example.labels) in out
        assert f"input_ids: {example.input_ids}" in out and f"labels: {example.labels}" in out
    trained = sum(1 for e in train for t in e.labels if t != -100)
    assert f"2 records (2 train, 0 held out), {sum(len(e.input_ids) for e in train)} tokens, {trained} trained" in out
    # the first labelled span of record 1 starts after the think opener (the generation prompt's end)
    first = out.split("record 1")[1]
    assert (
        first.index("[[")
        == first.index('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>[[Use the tool.') + 59
    )


def test_data_command_counts_records_cut_by_seq_len(tmp_path, capsys):
    recipe = minimal(
        tmp_path / "out",
        base=REPO / "recipes" / "bases" / "tiny-subword",
        data=whole(
            {
                "kind": "sft",
                "path": str(REPO / "recipes/data/subword_background_train.jsonl"),
                "seq_len": 24,
                "eval_fraction": 0.0,
            }
        ),
    )
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert cli_main(["data", "--recipe", str(path), "--records", "1"]) == 0
    captured = capsys.readouterr()
    _, train, _ = pipeline_rows(str(path))
    cut = sum(1 for e in train if len(e.input_ids) > 24)
    assert cut > 0 and f"{cut} cut by data.seq_len=24" in captured.out
    assert "cut to data.seq_len=24" in captured.out.split("record 2")[0]
    assert "warning: data.seq_len:" in captured.err


def test_data_command_bad_input_is_one_line(tmp_path, capsys):
    assert cli_main(["data", "--recipe", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-plugin data: error: recipe ")


def test_data_command_on_the_tiny_k3_release_with_an_image(tmp_path, capsys):
    from PIL import Image

    from moe_plugin.testing.k3_release import write_k3_release

    base = tmp_path / "k3"
    write_k3_release(base, tokenizer_dir=K3_TOKENIZER)
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "red.png")
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "Color?"}]},
            {"role": "assistant", "content": "red", "reasoning_content": "It looks red."},
        ]
    }
    data_path = tmp_path / "chats.jsonl"
    data_path.write_text(json.dumps(record) + "\n")
    recipe_path = write_recipe(
        tmp_path, base, {"kind": "sft", "path": str(data_path), "seq_len": 256, "eval_fraction": 0}
    )
    dump = tmp_path / "dump.jsonl"
    assert cli_main(["data", "--recipe", recipe_path, "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    _, (example,), rows = pipeline_rows(recipe_path)
    (line,) = [json.loads(x) for x in dump.read_text().splitlines()]
    assert line["input_ids"] == rows[0].input_ids.tolist() and line["labels"] == rows[0].labels.tolist()
    # the image as K3's processor writes it (its original size), its placeholder expanded and never trained
    k3 = AutoTokenizer.from_pretrained(K3_TOKENIZER, trust_remote_code=True, local_files_only=True)
    pad = K3_IDS["media_placeholder_token_id"]
    rendered = k3.apply_chat_template(
        record["messages"], add_generation_prompt=False, tokenize=True, image_prompts=[k3_image_prompt(40, 30)]
    )
    n = example.input_ids.count(pad)
    first = rendered.index(pad)
    assert n >= 1 and example.input_ids == rendered[:first] + [pad] * n + rendered[first + 1 :]
    assert all(label == -100 for t, label in zip(example.input_ids, example.labels) if t == pad)
    assert "<|media_begin|>image 40x30<|media_content|>" in out and "[[It looks red.<|close|>think" in out
