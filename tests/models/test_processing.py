import numpy as np
import pytest
import torch
from PIL import Image

from moe_plugin.config import VisionConfig
from moe_plugin.layers.vision import VisionEncoder
from moe_plugin.models.image_processing import ImageProcessor
from moe_plugin.models.processing import MoEProcessor


def image(height, width, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor():
    return MoEProcessor(image_processor=ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16))


def test_placeholder_expansion(processor):
    texts = ["a <|image|> b <|image|>", "no image", "<|image|>c"]
    images = [image(56, 84), image(28, 28, 1), image(112, 56, 2)]
    out = processor(texts, images=images)
    grid = out["grid_hw"]
    per_image = (grid[:, 0] * grid[:, 1] // 4).tolist()
    assert per_image == [6, 1, 8]
    ids = out["input_ids"]
    image_id = processor.image_token_id
    counts = (ids == image_id).sum(dim=1).tolist()
    assert counts == [6 + 1, 0, 8]
    assert out["pixel_patches"].shape == (int((grid[:, 0] * grid[:, 1]).sum()), 3 * 14 * 14)
    # the text around each run is intact, and runs sit where the placeholders were
    first = processor.decode(ids[0][out["attention_mask"][0].bool()])
    assert first == "a " + "<|image|>" * 6 + " b " + "<|image|>" * 1
    assert out["attention_mask"].sum(dim=1).tolist() == [len("a  b ") + 7, len("no image"), len("c") + 8]


def test_chat_template_to_model_inputs(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == "<|bos|><|im_start|>user\n<|image|>Describe.<|im_end|>\n<|im_start|>assistant\n"
    out = processor(prompt, images=[image(56, 56)])
    assert out["input_ids"].shape[0] == 1
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 4
    assert out["input_ids"][0, 0].item() == processor.tokenizer.bos_token_id


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "video"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"content": "no role"}],
        ["not a dict"],
    ],
)
def test_bad_messages_raise(processor, messages):
    with pytest.raises(ValueError, match="messages"):
        processor.apply_chat_template(messages)


def test_vision_encoder_gives_one_row_per_placeholder(processor):
    torch.manual_seed(0)
    cfg = VisionConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_grid=8, out_hidden_size=16)
    out = processor(["<|image|> x <|image|>"], images=[image(56, 84), image(84, 28, 1)])
    features = VisionEncoder(cfg)(out["pixel_patches"], out["grid_hw"])
    assert features.shape == (int((out["input_ids"] == processor.image_token_id).sum()), 16)


def test_text_only(processor):
    out = processor("hello")
    assert "pixel_patches" not in out and out["input_ids"].tolist() == [list(b"hello")]


def test_mismatched_images_raise(processor):
    with pytest.raises(ValueError, match="images"):
        processor("<|image|> and <|image|>", images=[image(28, 28)])
    with pytest.raises(ValueError, match="images"):
        processor("no placeholder", images=[image(28, 28)])
    with pytest.raises(ValueError, match="images"):
        processor("<|image|>", images=[image(5, 28)])  # too small
    with pytest.raises(ValueError, match="text"):
        processor([], images=None)


def test_save_and_load(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    loaded = MoEProcessor.from_pretrained(tmp_path)
    args = (["x <|image|>"], [image(56, 28)])
    a, b = processor(*args), loaded(*args)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_patches"], b["pixel_patches"])
