"""Image+text SFT data: JSONL chats with images (paths or base64) through the processor and the chat template,
packed with their images; each bad-data case named; packing and padding do not change the loss."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from moe_plugin.models.image_processing import ImageProcessor
from moe_plugin.models.presets import preset_config
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.training.backends.images import ImageTextTrainingModel
from moe_plugin.training.data.pipeline import eval_batches, label_token_count, pack_examples, sft_examples
from examples.shapes import COLORS, shapes_records

IMAGE_ID = 259


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def _picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _user(*items):
    return {"role": "user", "content": list(items)}


def _text(t):
    return {"type": "text", "text": t}


@pytest.fixture()
def pictures(tmp_path):
    """A 56x56 picture on disk (4 merged tokens) and a 56x112 one as base64 (8 merged tokens)."""
    small, wide = _picture(56, 56, 1), _picture(56, 112, 2)
    (tmp_path / "pics").mkdir()
    small.save(tmp_path / "pics" / "small.png")
    return {"small": small, "wide": wide, "wide_url": "data:image/png;base64," + base64.b64encode(_png(wide)).decode()}


def test_jsonl_round_trip_gives_the_token_layout_mask_and_patches(tmp_path, tok, pictures):
    records = [
        {
            "messages": [
                _user({"type": "image", "image": "pics/small.png"}, _text("Color?")),
                {"role": "assistant", "content": "red"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "A <|image|> and B"},
                _user({"type": "image"}, _text("?")),
                {"role": "assistant", "content": "ok"},
            ],
            "images": [pictures["wide_url"], "pics/small.png"],
        },
    ]
    first, second = sft_examples(_write(tmp_path / "chat.jsonl", records), tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert first.input_ids == enc(
        "<|bos|><|im_start|>user\n" + "<|image|>" * 4 + "Color?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n"
    )
    prompt = len(enc("<|bos|><|im_start|>user\n" + "<|image|>" * 4 + "Color?<|im_end|>\n<|im_start|>assistant\n"))
    trained = [i for i, label in enumerate(first.labels) if label != -100]
    assert trained == list(range(prompt, prompt + 4))  # "red" and its <|im_end|>, nothing else
    assert tok.decode([first.input_ids[i] for i in trained]) == "red<|im_end|>"
    assert second.input_ids == enc(
        "<|bos|><|im_start|>user\nA " + "<|image|>" * 8 + " and B<|im_end|>\n"
        "<|im_start|>user\n" + "<|image|>" * 4 + "?<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )
    assert tok.decode([t for t in second.labels if t != -100]) == "ok<|im_end|>"
    expected = ImageProcessor()([pictures["wide"], pictures["small"]])
    assert second.images.grid_hw.tolist() == [[4, 8], [4, 4]]
    assert torch.equal(second.images.pixel_patches, expected["pixel_patches"])
    assert torch.equal(first.images.pixel_patches, ImageProcessor()(pictures["small"])["pixel_patches"])


def test_collator_carries_each_rows_images_in_order(tmp_path, tok, pictures):
    records = [r for r, _, _ in shapes_records(str(tmp_path), 5, seed=3)]
    for i, r in enumerate(records):  # distinct tokens, so each example can be found in its row
        r["messages"][1]["content"] += f" #{i}"
    records.insert(
        2, {"messages": [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "fine"}]}
    )
    examples = sft_examples(_write(tmp_path / "train.jsonl", records), tok)
    rows = pack_examples(examples, 128)
    assert len(rows) == 3 and all(len(r.cu_seqlens) == 4 for r in rows)  # two examples and the padding each
    batches = eval_batches(rows, 2)
    got = torch.cat([b.pixel_patches for b in batches if b.pixel_patches is not None])
    grids = torch.cat([b.grid_hw for b in batches if b.grid_hw is not None])
    packed_order = []  # the examples in the order their tokens appear in the rows
    for row in rows:
        ids, bounds = row.input_ids.tolist(), row.cu_seqlens.tolist()
        for a, b in zip(bounds, bounds[1:]):
            packed_order += [i for i, e in enumerate(examples) if e.input_ids == ids[a:b]][:1]
    want = [examples[i].images for i in packed_order if examples[i].images is not None]
    assert len(packed_order) == 6 and len(want) == 5
    assert torch.equal(got, torch.cat([w.pixel_patches for w in want]))
    assert torch.equal(grids, torch.cat([w.grid_hw for w in want]))
    for b in batches:
        tokens = 0 if b.grid_hw is None else int((b.grid_hw[:, 0] * b.grid_hw[:, 1]).sum()) // 4
        assert int((b.input_ids == IMAGE_ID).sum()) == tokens  # one placeholder per merged image token
        assert not bool((b.labels[b.input_ids == IMAGE_ID] != -100).any())  # images are input only


def _chat(*items, images=None, answer="x"):
    record = {"messages": [_user(*items), {"role": "assistant", "content": answer}]}
    if images is not None:
        record["images"] = images
    return record


BAD = [
    (
        _chat({"type": "image", "image": "pics/absent.png"}),
        r"image 'pics/absent\.png' not found \(looked for .*"
        r"pics/absent\.png\); image paths are relative to the data file's folder",
    ),
    (_chat({"type": "image", "image": "notes.png"}), r"image 'notes\.png' cannot be read as an image"),
    (_chat({"type": "image", "image": "data:image/png;base64,@@@"}), r"has invalid base64 data"),
    (_chat({"type": "image", "image": "data:image/png,abc"}), r"is a data URL without base64 data"),
    (_chat(_text("look: <|image|>")), r"the conversation holds 1 <\|image\|> placeholders but 0 images"),
    (
        _chat(_text("<|image|>"), images=["pics/small.png", "pics/small.png"]),
        r"holds 1 <\|image\|> placeholders but 2 images; give exactly one image per placeholder",
    ),
    (
        _chat({"type": "image", "image": "pics/small.png"}, _text("<|image|>")),
        r"holds 2 <\|image\|> placeholders "
        r"but 1 images",
    ),
    (
        _chat({"type": "image", "image": "pics/small.png"}, images=["pics/small.png"]),
        r"names images both inline .* and in an 'images' list; use one of the two",
    ),
    (_chat({"type": "image"}, images="pics/small.png"), r"'images' must be a list of image paths"),
    (_chat({"type": "image", "image": 5}), r"messages\[0\]\.content\[0\]: 'image' must be an image path"),
    (_chat({"type": "image", "image": "pics/tiny.png"}), r"an image of 8x8 pixels is too small"),
]


@pytest.mark.parametrize("bad,pattern", BAD)
def test_bad_image_records_name_the_file_line_and_image(tmp_path, tok, pictures, bad, pattern):
    (tmp_path / "notes.png").write_text("not a picture")
    _picture(8, 8, 0).save(tmp_path / "pics" / "tiny.png")
    good = _chat({"type": "image", "image": "pics/small.png"})
    path = _write(tmp_path / "chat.jsonl", [good, "", bad])
    with pytest.raises(ValueError) as err:
        sft_examples(path, tok)
    message = str(err.value)
    assert message.startswith(f"data.path: line 3 of {path}: "), message
    assert re.search(pattern, message), message


def test_an_image_example_longer_than_seq_len_is_refused_not_cut(tmp_path, tok, pictures):
    path = _write(tmp_path / "chat.jsonl", [_chat({"type": "image", "image": "pics/small.png"})])
    examples = sft_examples(path, tok)
    n = len(examples[0].input_ids)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"data.seq_len: line 1 of {path} holds images and is {n} tokens "
            f"long, more than data.seq_len (16); raise data.seq_len to at "
            f"least {n}"
        ),
    ):
        pack_examples(examples, 16)


def test_synthetic_answers_are_read_from_the_picture(tmp_path):
    for record, shape, color in shapes_records(str(tmp_path), 8, seed=5, embed="base64"):
        source = record["messages"][0]["content"][0]["image"]
        image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")
        pixels = np.asarray(image).reshape(-1, 3)
        painted = pixels[np.abs(pixels.astype(int) - COLORS[color]).sum(1) == 0]
        assert len(painted) > 100  # the shape is drawn in the colour the answer may name
        assert record["messages"][1]["content"] in (shape, color)


def _total_loss(model, rows, micro_batch_size):
    batches = eval_batches(rows, micro_batch_size)
    items = sum(label_token_count(b.labels, b.cu_seqlens) for b in batches)
    total = 0.0
    for b in batches:
        out = model(
            input_ids=b.input_ids,
            labels=b.labels,
            cu_seqlens=b.cu_seqlens,
            num_items_in_batch=items,
            **b.image_inputs("cpu"),
        )
        total = total + out.loss
    return total


def test_packing_and_padding_do_not_change_the_loss(tmp_path, tok):
    records = [r for r, _, _ in shapes_records(str(tmp_path), 5, seed=7)]
    records.append({"messages": [{"role": "user", "content": "text only"}, {"role": "assistant", "content": "yes"}]})
    examples = sft_examples(_write(tmp_path / "train.jsonl", records), tok)
    torch.manual_seed(0)
    model = ImageTextTrainingModel(preset_config("tiny", attn_res=False)).eval()
    with torch.no_grad():
        packed = _total_loss(model, pack_examples(examples, 192), 2)  # several examples and images per row
        alone = _total_loss(model, pack_examples(examples, 64, pack=False), 1)  # one per row, padded
        mixed = _total_loss(model, pack_examples(list(reversed(examples)), 300), 1)  # other order, more padding
    assert float(packed) > 0
    assert torch.allclose(packed, alone, rtol=1e-5, atol=0) and torch.allclose(packed, mixed, rtol=1e-5, atol=0)


def test_a_batch_without_images_still_calls_the_encoder_and_changes_nothing(tok):
    torch.manual_seed(0)
    model = ImageTextTrainingModel(preset_config("tiny", attn_res=False))
    ids = torch.tensor([tok.encode("<|bos|>plain text, no picture", add_special_tokens=False)])
    called = []
    model.vision_tower.register_forward_hook(lambda *a: called.append(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert called == [1]
    with torch.no_grad():
        plain = model.language_model(input_ids=ids, labels=ids)  # the text model alone: no encoder call
    assert called == [1] and torch.equal(out.logits, plain.logits) and torch.equal(out.loss, plain.loss)
    grads = [p.grad for p in model.vision_tower.parameters()] + [p.grad for p in model.mm_projector.parameters()]
    assert all(g is not None and not bool(g.any()) for g in grads)  # zero, but there for ZeRO-3 to reduce
