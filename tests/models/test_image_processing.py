import math

import numpy as np
import pytest
import torch
from PIL import Image

from moe_plugin.layers.vision import patch_positions
from moe_plugin.models.image_processing import ImageProcessor


def rgb(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("height, width", [(56, 84), (100, 37), (20, 300), (900, 700), (14, 14)])
def test_target_size_is_multiple_of_28_within_bounds(height, width):
    proc = ImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    h, w = proc.target_size(height, width)
    assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
    assert h * w <= proc.max_pixels
    if height * width >= proc.min_pixels and max(height, width) / min(height, width) < 4:
        # the aspect ratio survives up to the rounding of each side to 28 pixels
        assert abs(h / w - height / width) <= (28 / min(h, w)) * (height / width) + 1e-9


def test_patches_follow_layout_and_normalisation():
    """No resize (sides already multiples of 28 in bounds): patch i is the pixel block at its (row, col)."""
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    proc = ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 64, image_mean=mean, image_std=std)
    image = rgb(56, 84)
    out = proc([Image.fromarray(image)])
    patches, grid = out["pixel_patches"], out["grid_hw"]
    assert grid.tolist() == [[4, 6]] and patches.dtype == torch.float32 and patches.shape == (24, 3 * 14 * 14)
    normalised = (image.astype(np.float64) / 255.0 - np.array(mean)) / np.array(std)  # [H, W, C]
    for i, (r, c) in enumerate(patch_positions(grid, 2).tolist()):
        block = (
            normalised[r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14, :].transpose(2, 0, 1).reshape(-1)
        )  # (C, ph, pw)
        np.testing.assert_allclose(patches[i].numpy(), block, rtol=1e-5, atol=1e-5)


def test_several_images_and_resize():
    proc = ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    images = [Image.fromarray(rgb(50, 70)), rgb(200, 30, seed=1), Image.fromarray(rgb(40, 40)).convert("L")]
    out = proc(images)
    grid = out["grid_hw"]
    assert grid.dtype == torch.int64 and grid.shape == (3, 2)
    for i, image in enumerate(images):
        height, width = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]
        assert tuple(x // 14 for x in proc.target_size(height, width)) == tuple(grid[i].tolist())
    assert out["pixel_patches"].shape[0] == int((grid[:, 0] * grid[:, 1]).sum())


def test_save_and_load(tmp_path):
    proc = ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16, image_mean=(0.4, 0.5, 0.6))
    proc.save_pretrained(tmp_path)
    loaded = ImageProcessor.from_pretrained(tmp_path)
    assert loaded.to_dict() == proc.to_dict()


def test_too_small_or_too_long_image_raises():
    proc = ImageProcessor()
    with pytest.raises(ValueError, match="images"):
        proc([Image.fromarray(rgb(10, 40))])
    with pytest.raises(ValueError, match="images"):
        proc([Image.fromarray(rgb(14, 14 * 201))])
    with pytest.raises(ValueError, match="images"):
        proc(["not an image"])
    with pytest.raises(ValueError, match="images"):
        proc([np.zeros((30, 30), dtype=np.uint8)])


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="ImageProcessor.max_pixels"):
        ImageProcessor(max_pixels=100)
    with pytest.raises(ValueError, match="ImageProcessor.min_pixels"):
        ImageProcessor(min_pixels=28 * 28 * 10, max_pixels=28 * 28 * 4)
    with pytest.raises(ValueError, match="ImageProcessor.image_std"):
        ImageProcessor(image_std=(0.5, 0.0, 0.5))


# --- K3's processor rules (moe_plugin/models/k3_image_processing.py) ---------------------------------------------
# The reference is the release's navit rule re-stated from its media_utils (docs/multimodal.md 7), plus sizes
# worked by hand; the pixel checks build the expected patches from the image by slicing.


def published_navit(width, height, patch=14, merge=2, limit=65536, side=512):
    s1 = math.sqrt(limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, s1, side * patch / width, side * patch / height)
    w = min(max(1, int(width * scale)), side * patch)
    h = min(max(1, int(height * scale)), side * patch)
    return w, h


@pytest.mark.parametrize(
    "width, height, resized, tokens",
    [
        (1000, 500, (1000, 500), 18 * 36),  # wide, under every limit: no resize, padded to 1008 x 504
        (8000, 6000, (4142, 3107), 111 * 148),  # huge: scaled by sqrt(65536 / (571 * 428)) = 0.51785
        (100, 20000, None, None),  # tall: the 512-patch side limit binds
        (20000, 100, None, None),  # wide: the same on the other side
        (10, 5, (10, 5), 1),  # tiny: padded to one 28 x 28 token
        (1, 1, (1, 1), 1),
        (28 * 10, 28 * 7, (280, 196), 70),  # exact multiples: no padding
    ],
)
def test_k3_navit_resize_and_token_count(width, height, resized, tokens):
    from moe_plugin.models.k3_image_processing import K3ImageProcessor

    proc = K3ImageProcessor()
    new_w, new_h, pad_w, pad_h, count = proc.resize_config(width, height)
    assert (new_w, new_h) == published_navit(width, height)
    if resized is not None:
        assert (new_w, new_h) == resized and count == tokens
    assert count == math.ceil(new_h / 28) * math.ceil(new_w / 28)
    assert (new_w + pad_w) % 28 == 0 and (new_h + pad_h) % 28 == 0 and pad_w < 28 and pad_h < 28
    assert max(new_w, new_h) <= 512 * 14


def test_k3_patches_are_raster_order_normalised_and_padded():
    from moe_plugin.models.k3_image_processing import K3ImageProcessor

    image = rgb(30, 44, seed=3)  # 30 x 44 (h x w): no resize, padded to 56 x 56
    out = K3ImageProcessor()([Image.fromarray(image)])
    pixels, grid = out["pixel_values"], out["grid_thws"]
    assert grid.tolist() == [[1, 4, 4]] and grid.dtype == torch.int64
    assert pixels.shape == (16, 3, 14, 14) and pixels.dtype == torch.float32
    padded = np.zeros((56, 56, 3), np.uint8)
    padded[:30, :44] = image
    want = (padded.astype(np.float32) / 255 - 0.5) / 0.5
    for index in range(16):
        r, c = divmod(index, 4)
        block = want[r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14].transpose(2, 0, 1)
        np.testing.assert_allclose(pixels[index].numpy(), block, atol=1e-6)
    assert pixels[15].eq(-1).all()  # the padding is black: -1 after normalising


def test_k3_transparent_images_are_filled_with_a_chessboard_after_the_resize():
    from moe_plugin.models.k3_image_processing import K3ImageProcessor

    clear = np.zeros((40, 40, 4), np.uint8)  # fully transparent
    clear[:, 20:, :] = [255, 0, 0, 128]  # right half half-opaque red
    pixels = K3ImageProcessor()([Image.fromarray(clear, "RGBA")])["pixel_values"]
    image = pixels.view(4, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 56)  # back to [C, H, W]
    norm = lambda v: (v / 255 - 0.5) / 0.5  # noqa: E731
    assert torch.allclose(image[:, 0, 0], torch.tensor(norm(255.0)))  # the top-left square is white
    assert torch.allclose(image[:, 0, 16], torch.tensor(norm(200.0)))  # its right neighbour gray
    alpha = np.float32(128 / 255)
    red = np.uint8(alpha * 255 + (1 - alpha) * 255), np.uint8((1 - alpha) * 255)  # over white (row 0, col 32)
    want = torch.tensor([norm(float(red[0])), norm(float(red[1])), norm(float(red[1]))])
    assert torch.allclose(image[:, 0, 32], want)
    assert image[:, 40:, :].eq(-1).all() and image[:, :, 40:].eq(-1).all()  # the padding stays black


def test_k3_processor_feeds_the_moonvit_tower_and_is_read_from_a_base(tmp_path):
    import json

    from moe_plugin.layers.vision_encoder import ImageEncoder
    from moe_plugin.models.k3_image_processing import K3ImageProcessor, load_image_processor
    from moe_plugin.models.k3_vision import K3_VISION_CONFIG, vision_config_from_k3

    proc = K3ImageProcessor()
    images = [Image.fromarray(rgb(60, 30, 1)), Image.fromarray(rgb(20, 90, 2))]
    out = proc(images)
    small = dict(K3_VISION_CONFIG, vt_hidden_size=8, mm_hidden_size=8, vt_intermediate_size=16, qkv_hidden_size=8)
    small.update(vt_num_attention_heads=2, vt_num_hidden_layers=1, text_hidden_size=8)
    tokens = ImageEncoder(vision_config_from_k3(small))(out["pixel_values"], out["grid_thws"])
    assert tokens.shape[0] == sum(proc.num_tokens(i) for i in images) == 3 * 2 + 1 * 4
    proc.save_pretrained(tmp_path)
    loaded = load_image_processor(str(tmp_path))
    assert isinstance(loaded, K3ImageProcessor) and loaded.media_proc_cfg == proc.media_proc_cfg
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {"patch_sise": 14}}))
    with pytest.raises(ValueError, match=r"^media_proc_cfg.patch_sise: not a key of K3's image processor"):
        load_image_processor(str(tmp_path))
