"""The planner's vision tower (moe_plugin/plan/vision.py): the encoder run on meta against the same encoder run
for real on the CPU, the picture grid against the image processor's resize, and the plan's vision rows and
errors."""

from __future__ import annotations

import pytest
import torch

from moe_plugin.config import VisionConfig
from moe_plugin.plan.planner import plan_recipe
from moe_plugin.plan.vision import image_grid, vision_activation_bytes
from moe_plugin.testing.plan_measure import layout_recipe
from moe_plugin.recipe.schema import LoraSection, recipe_from_dict

VISION = VisionConfig(
    hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512, out_hidden_size=64, max_grid=64
)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "gate"], ["qkv", "proj", "fc1"]])
def test_meta_encoder_holds_what_the_real_encoder_holds(targets):
    """Frozen (the seed's targets name no vision module: nothing is saved, only working tensors) and with
    adapters inside the tower; two pictures of 448 px (32 x 32 patches each), fp32."""
    from moe_plugin.layers.vision import VisionEncoder
    from moe_plugin.plan.activations import _add_lora
    from moe_plugin.plan.saved_bytes import _run

    lora = LoraSection(r=8, alpha=16, target_modules=targets)
    saved, working, tokens = vision_activation_bytes(VISION, lora, 2, 448, torch.float32)
    torch.manual_seed(0)
    encoder = VisionEncoder(VISION)
    _add_lora(encoder, lora)
    grid, patches = torch.tensor([[32, 32], [32, 32]]), torch.randn(2 * 32 * 32, VISION.patch_dim)
    real_working: list = []
    real_saved = _run(lambda: encoder(patches, grid), {encoder: "v"}, "v", real_working)
    assert tokens == 2 * 32 * 32 // 4
    assert saved == sum(real_saved.values()) and working == real_working[0]
    if targets[0] == "q_proj":
        assert saved == 0 and working > 0
    else:
        # at least every adapted projection's input is kept for its adapter's gradient
        assert saved >= 2 * 3 * 2 * 32 * 32 * VISION.hidden_size * 4


def test_picture_grid_is_the_image_processors_resize():
    from moe_plugin.models.image_processing import ImageProcessor

    processor = ImageProcessor()
    for side in (56, 300, 448, 896, 1000):
        h, w = processor.target_size(side, side)
        assert image_grid(side, 14, 2) == (h // 14, w // 14), side


def test_picture_grid_of_k3s_tower_is_its_processors_navit_resize():
    import numpy as np
    from PIL import Image

    from moe_plugin.models.k3_image_processing import K3ImageProcessor

    processor = K3ImageProcessor()
    for side in (10, 300, 896, 1000, 8000):
        image = Image.fromarray(np.zeros((side, side, 3), np.uint8)) if side <= 1000 else None
        if image is not None:
            t, h, w = processor([image])["grid_thws"][0].tolist()
        else:  # too big to draw quickly: the processor's own sizing
            nw, nh, pw, ph, _ = processor.resize_config(side, side)
            h, w = (nh + ph) // 14, (nw + pw) // 14
        assert image_grid(side, 14, 2, "moonvit3d") == (h, w), side


def test_plan_adds_the_vision_tower_and_names_bad_picture_counts():
    recipe = recipe_from_dict(layout_recipe("/tmp/never", 1, 1, 512))  # the tiny preset, with its tower
    text = plan_recipe(recipe, devices=1, summaries=False)
    assert text.layout.images == 0 and "vision" not in text.memory.activations_by_segment
    with_images = plan_recipe(recipe, devices=1, images=2, image_size=224, summaries=False)
    saved, working, _ = vision_activation_bytes(recipe_vision(recipe), recipe.lora, 2, 224, torch.float32)
    assert with_images.memory.activations_by_segment["vision"] == saved
    assert with_images.counts["vision"]["parameters"] > 0 and text.counts["vision"]["parameters"] == 0
    assert with_images.memory.peak >= text.memory.peak
    with pytest.raises(ValueError, match=r"--images: .*fill 2048 image tokens, more than the micro-batch's 2 x 512"):
        plan_recipe(recipe, devices=1, images=8, image_size=448)
    no_tower = recipe_from_dict(layout_recipe("/tmp/never", 1, 1, 512, shape={"vision_config": None}))
    with pytest.raises(ValueError, match="--images: the model has no vision tower"):
        plan_recipe(no_tower, devices=1, images=1)


def recipe_vision(recipe):
    from moe_plugin.recipe.resolved_model import base_hf_config

    return base_hf_config(recipe.model).to_model_config().vision
