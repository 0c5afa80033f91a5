"""K3's vision tower on both faces: the release's tensor names load strictly into the Hugging Face model and into
megatron's ``MultimodalGPTModel`` encoder, and both encode the same tokens; one ``<|media_pad|>`` per image (K3's
prompts) is expanded in the model to the image's tokens, with labels -100 there (docs/multimodal.md 7).

The megatron face is checked through ``MultimodalGPTModel.attach_encoder`` / ``encode_images`` (its own code path)
on an instance without megatron's decoder: building ``GPTModel`` needs megatron's process groups, which this
single-process test does not start; the whole model is trained on that face by
tests/training/test_multimodal_trainer.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_plugin.megatron.multimodal import MultimodalGPTModel
from moe_plugin.models import MoEPluginForConditionalGeneration
from moe_plugin.models.configuration import MoEPluginConfig
from moe_plugin.models.image_tokens import IGNORE, expand_image_placeholders
from moe_plugin.models.k3_vision import vision_config_from_k3, vision_kwargs
from moe_plugin.models.presets import tiny
from tests.layers.test_vision_moonvit import SMALL, inputs, release_names, release_state_dict

PAD = 259  # the tiny preset's image token (K3's media_placeholder_token_id in the release)
K3_SMALL = dict(SMALL, text_hidden_size=64)  # the tiny text model's width


@pytest.fixture(scope="module")
def faces():
    torch.manual_seed(0)
    config = MoEPluginConfig(**tiny(vision_config=vision_kwargs(K3_SMALL), image_token_id=PAD, use_dsa_indexer=False))
    hf = MoEPluginForConditionalGeneration(config).eval()
    vision = vision_config_from_k3(K3_SMALL)
    sd = release_state_dict(vision)
    megatron = MultimodalGPTModel.__new__(MultimodalGPTModel)
    nn.Module.__init__(megatron)
    megatron.pre_process = True
    megatron.attach_encoder(vision, PAD)
    return hf, megatron, sd, vision


def test_release_names_load_strictly_on_both_faces_and_encode_alike(faces):
    hf, megatron, sd, vision = faces
    hf_vision = {n for n in hf.state_dict() if n.startswith(("vision_tower.", "mm_projector."))}
    assert hf_vision == release_names(vision.num_layers) == set(sd)
    state = {n: t for n, t in hf.state_dict().items() if n not in hf_vision} | sd
    hf.load_state_dict(state, strict=True)
    megatron.load_state_dict(sd, strict=True)
    pixels, grid = inputs(vision)
    with torch.no_grad():
        a, b = hf.encode_images(pixels, grid), megatron.encode_images(pixels, grid)
    assert a.shape == (6 + 16 + 4, 64)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_one_pad_per_image_is_expanded_in_the_model(faces):
    hf, _, sd, vision = faces
    pixels, grid = inputs(vision)
    counts = [6, 16, 4]
    one = torch.tensor([[5, 6, PAD, 7, PAD, 8, PAD, 9, 10]])
    expanded = torch.tensor([[5, 6] + [PAD] * 6 + [7] + [PAD] * 16 + [8] + [PAD] * 4 + [9, 10]])
    labels = one.clone()
    with torch.no_grad():
        short = hf(one, pixel_values=pixels, grid_thws=grid, labels=labels)
        full = hf(expanded, pixel_patches=pixels, grid_hw=grid, labels=expanded.clone())
    assert short.logits.shape == full.logits.shape == (1, expanded.shape[1], 384)
    torch.testing.assert_close(short.logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(short.loss, full.loss, rtol=1e-5, atol=1e-5)
    ids, mask, labs, _ = expand_image_placeholders(one, PAD, counts, labels=labels)
    assert torch.equal(ids, expanded) and mask is None
    assert torch.equal(labs == IGNORE, expanded == PAD) and torch.equal(labs[labs != IGNORE], one[one != PAD])


def test_expansion_pads_rows_on_their_side_and_shifts_packed_documents():
    ids = torch.tensor([[0, 0, 1, PAD], [1, PAD, PAD, 2]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    got, got_mask, _, _ = expand_image_placeholders(ids, PAD, [3, 1, 2], mask, pad_token_id=0)
    # row 0 was left-padded and is the longest; row 1 (right-padded) gets one pad on its right
    assert got.tolist() == [[0, 0, 1, PAD, PAD, PAD], [1, PAD, PAD, PAD, 2, 0]]
    assert got_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    packed = torch.tensor([[1, PAD, 2, 3, PAD, 4]])
    _, _, _, cu = expand_image_placeholders(packed, PAD, [3, 2], cu_seqlens=torch.tensor([0, 3, 6]))
    assert cu.tolist() == [0, 5, 9]


def test_a_placeholder_count_of_neither_form_is_refused():
    with pytest.raises(ValueError, match=r"^input_ids: hold 2 image placeholders for 3 images of 9 tokens"):
        expand_image_placeholders(torch.tensor([[PAD, 1, PAD]]), PAD, [3, 3, 3])


def test_a_release_with_a_tower_this_project_does_not_build_is_refused_or_trained_text_only(tmp_path):
    """The recipe names the refusal's key; ``model.ignore_vision: true`` reads the base as its text model."""
    import json
    from types import SimpleNamespace

    from pydantic import ValidationError

    from moe_plugin.recipe.model_section import ModelSection
    from moe_plugin.recipe.resolved_model import base_hf_config
    from moe_plugin.testing.k3_release import write_k3_release
    from moe_plugin.training.backends.images import wants_images

    base = tmp_path / "k3"
    write_k3_release(str(base), seed=0)
    config = json.loads((base / "config.json").read_text())
    config["vision_config"]["mm_projector_type"] = "patchmerger"
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValidationError, match=r"vision_config.mm_projector_type: only 'patchmergerv2'"):
        ModelSection(from_pretrained=str(base), trust_remote_code=True)
    section = ModelSection(from_pretrained=str(base), trust_remote_code=True, ignore_vision=True)
    text = base_hf_config(section).to_model_config()
    assert text.vision is None and text.hidden_size == config["text_config"]["hidden_size"]
    data = tmp_path / "data.jsonl"
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}
    data.write_text(json.dumps(record) + "\n")
    recipe = SimpleNamespace(model=section, data=SimpleNamespace(kind="sft", path=str(data)))
    with pytest.raises(ValueError, match=r"^model.ignore_vision: is true, .* but the data holds images"):
        wants_images(recipe, text)


def test_one_pad_per_image_with_a_cache_asks_for_the_expansion_first(faces):
    hf, _, _, vision = faces
    pixels, grid = inputs(vision)
    one = torch.tensor([[5, PAD, 7, PAD, 8, PAD]])
    with pytest.raises(ValueError, match=r"^input_ids: hold one placeholder per image; with a cache"):
        hf(one, pixel_values=pixels, grid_thws=grid, use_cache=True)
