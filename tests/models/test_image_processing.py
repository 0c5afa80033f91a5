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
