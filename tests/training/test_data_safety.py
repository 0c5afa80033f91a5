"""Training data that is damaged or would train on nothing is named with its file and line: invalid UTF-8,
unreadable files, empty assistant turns, records whose labels data.seq_len cuts away, images over PIL's pixel
limit and damaged image bytes."""

from __future__ import annotations

import base64
import io
import json
import warnings

import numpy as np
import pytest
from PIL import Image

from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.training.data.pipeline import (
    arithmetic_examples,
    label_token_count,
    load_examples,
    pack_examples,
    sft_examples,
    text_examples,
)
from moe_plugin.training.data.records import IGNORE, read_records


def write_lines(path, lines):
    path.write_bytes(
        b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    )
    return str(path)


def chat(user, answer):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def message_of(call):
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- files


def test_invalid_utf8_names_file_line_byte_and_column(tmp_path):
    bad = '{"text": "Müller caf'.encode("utf-8") + 'é"}'.encode("latin-1")
    path = write_lines(tmp_path / "train.jsonl", [{"text": "fine"}, bad])
    # the column counts characters: the two-byte "ü" before the bad byte is one
    assert message_of(lambda: text_examples(path)) == (
        f"data.path: line 2 of {path}: not valid UTF-8 (byte 0xe9 at column 21); save the file as UTF-8"
    )
    valid = write_lines(tmp_path / "utf8.jsonl", ['{"text": "Müller café"}'.encode("utf-8")])
    assert [r for _, r in read_records(valid)] == [{"text": "Müller café"}]


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = write_lines(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + json.dumps({"text": "a"}).encode(), {"text": "b"}])
    assert [r for _, r in read_records(path)] == [{"text": "a"}, {"text": "b"}]


def test_invalid_json_is_still_named(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [{"text": "a"}, b'{"text": '])
    assert message_of(lambda: text_examples(path)).startswith(f"data.path: line 2 of {path}: invalid JSON (")
    huge = write_lines(tmp_path / "huge.jsonl", [b'{"text": "a", "n": ' + b"9" * 5000 + b"}"])
    assert message_of(lambda: text_examples(huge)).startswith(
        f"data.path: line 1 of {huge}: JSON this reader cannot take (ValueError: Exceeds the limit "
    )
    deep = write_lines(tmp_path / "deep.jsonl", [b"[" * 100_000 + b"]" * 100_000])
    assert message_of(lambda: text_examples(deep)).startswith(
        f"data.path: line 1 of {deep}: JSON this reader cannot take (RecursionError: "
    )


def test_an_unreadable_json_file_is_named(tmp_path):
    path = tmp_path / "train.json"
    path.write_bytes(b'[{"text": "a"}, {"text": ')
    message = message_of(lambda: text_examples(str(path)))
    assert message.startswith(f"data.path: {path}: cannot be read as json (")
    assert message.endswith("); check that it is a valid json file in UTF-8, or convert it to .jsonl")


# ------------------------------------------------------------------------------------------- chats


@pytest.mark.parametrize("content", ["", "  \n", [{"type": "text", "text": " "}]])
def test_an_empty_assistant_turn_is_refused(tmp_path, content):
    path = write_lines(tmp_path / "train.jsonl", [chat("hi", "ok"), chat("hi", content)])
    assert message_of(lambda: sft_examples(path)) == (
        f"data.path: line 2 of {path}: messages[1] is an assistant turn with empty content, so it would teach "
        "only to end at once; write the answer (or its tool_calls) or remove the turn"
    )


def first_label(example):
    return next(i for i, label in enumerate(example.labels) if i > 0 and label != IGNORE)


@pytest.fixture()
def short_and_long(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [chat("hi", "ok"), chat("x" * 60, "ok")])
    examples = sft_examples(path)
    short, long = (first_label(e) for e in examples)
    assert short < long
    return path, examples, short, long


def test_records_whose_labels_lie_past_seq_len_are_reported_once(short_and_long):
    path, examples, short, long = short_and_long
    with pytest.warns(UserWarning) as record:
        rows = pack_examples(examples, seq_len=long)  # the long record's first label is position `long`
    lost = [str(w.message) for w in record if "lose every label" in str(w.message)]
    assert lost == [
        f"data.seq_len: 1 of 2 records lose every label to data.seq_len={long} (first: line 2 of "
        f"{path}); raise data.seq_len or shorten them"
    ]
    assert sum(label_token_count(r.labels, r.cu_seqlens) for r in rows) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing cut: no warning at all
        pack_examples(examples, seq_len=max(len(e.input_ids) for e in examples))


def test_a_run_where_no_label_survives_is_refused(short_and_long):
    path, examples, short, long = short_and_long
    assert message_of(lambda: pack_examples(examples, seq_len=short)) == (
        f"data.seq_len: no label survives: all 2 of 2 records with labels lose every label to data.seq_len={short} "
        f"(first: line 1 of {path}); raise data.seq_len to at least {short + 1} or shorten them"
    )
    with pytest.warns(UserWarning) as record:
        rows = pack_examples(examples, seq_len=short + 1)  # the bound the message gives is enough
    assert any("1 of 2 records lose every label" in str(w.message) for w in record)
    assert sum(label_token_count(r.labels, r.cu_seqlens) for r in rows) == 1


def test_generated_and_text_data_keep_labels_at_the_shortest_seq_len(tmp_path):
    tok = ByteTokenizer()
    path = write_lines(tmp_path / "text.jsonl", [{"text": "a longer document than two tokens"}])
    for examples in (arithmetic_examples(4, seed=3, tokenizer=tok), text_examples(path, tok)):
        with pytest.warns(UserWarning) as record:
            rows = pack_examples(examples, seq_len=2)
        assert not [w for w in record if "lose every label" in str(w.message)]
        assert all(label_token_count(r.labels, r.cu_seqlens) == 1 for r in rows)
    assert arithmetic_examples(2, tokenizer=tok)[1].where == "generated arithmetic document 2"
    assert text_examples(path, tok)[0].where == f"line 1 of {path}"


def test_load_examples_then_pack_refuses_the_run(tmp_path):
    """What the trainer does (``loop``: load_examples, then pack_examples with the recipe's seq_len)."""
    path = write_lines(tmp_path / "train.jsonl", [chat("x" * 50, "ok")] * 2)
    section = type(
        "Data", (), {"kind": "sft", "path": path, "eval_fraction": 0.0, "num_documents": 0, "operation": "+"}
    )()
    train, _ = load_examples(section)
    with pytest.raises(ValueError, match=r"^data\.seq_len: no label survives: all 2 of 2 records"):
        pack_examples(train, seq_len=16)


# ------------------------------------------------------------------------------------------- images


def png(height, width, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_chat(source):
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": source}, {"type": "text", "text": "What color?"}]},
            {"role": "assistant", "content": "red"},
        ]
    }


@pytest.mark.parametrize("limit", [3000, 1000])  # PIL warns between its limit and twice it, and raises beyond
def test_an_image_over_pils_pixel_limit_is_named_with_the_limit(tmp_path, monkeypatch, limit):
    (tmp_path / "big.png").write_bytes(png(64, 64))  # 4096 pixels
    path = write_lines(tmp_path / "train.jsonl", [image_chat("big.png")])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    assert message_of(lambda: sft_examples(path)) == (
        f"data.path: line 1 of {path}: image 'big.png' has 4096 pixels, more than PIL's limit "
        f"PIL.Image.MAX_IMAGE_PIXELS = {limit} (a guard against decompression bombs); downscale the image, or "
        "raise PIL.Image.MAX_IMAGE_PIXELS before training if you trust the file"
    )
    assert Image.MAX_IMAGE_PIXELS == limit  # the limit is never raised behind the caller's back
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4096)
    assert len(sft_examples(path)) == 1


@pytest.mark.parametrize("data", [png(28, 28)[:60], b"not an image at all", png(28, 28)[:8] + b"\0" * 40])
def test_damaged_image_bytes_are_named(tmp_path, data):
    (tmp_path / "bad.png").write_bytes(data)
    path = write_lines(tmp_path / "train.jsonl", [chat("hi", "ok"), image_chat("bad.png")])
    message = message_of(lambda: sft_examples(path))
    assert message.startswith(f"data.path: line 2 of {path}: image 'bad.png' cannot be read as an image ("), message
    assert message.endswith("); give a PNG or JPEG file, or a data:image/...;base64, URL")
    inline = write_lines(
        tmp_path / "inline.jsonl", [image_chat("data:image/png;base64," + base64.b64encode(data).decode())]
    )
    assert message_of(lambda: sft_examples(inline)).startswith(
        f"data.path: line 1 of {inline}: image 'data:image/png;base64,"
    )


def test_bad_base64_is_named(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [image_chat("data:image/png;base64,iVBOR!!w0KGgo=")])
    message = message_of(lambda: sft_examples(path))
    assert message.startswith(
        f"data.path: line 1 of {path}: image 'data:image/png;base64,iVBOR!!w0KGgo=' has invalid base64 data ("
    )
    assert message.endswith(
        "); encode the image bytes with standard base64 (A-Z, a-z, 0-9, +, /, = padding, no line breaks)"
    )
