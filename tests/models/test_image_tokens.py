"""The one placement of image tokens (moe_plugin/models/modeling_vl.scatter_image_tokens): row-major over
``[B, T]``, its input errors named; megatron's ``MultimodalGPTModel`` places them with it on its ``[T, B, D]``
embeddings, and adds the blank image only when the batch has none."""

from types import SimpleNamespace

import pytest
import torch

from moe_plugin.models.modeling_vl import scatter_image_tokens

IMAGE = 9
IDS = torch.tensor([[1, 2, 3, IMAGE], [IMAGE, 4, IMAGE, 5]])  # placeholders at (0, 3), (1, 0), (1, 2)


def _encode(pixel_patches, grid_hw):
    return pixel_patches * 10.0  # one image token a patch row: recognisable values


def test_tokens_fill_the_placeholders_in_row_major_order():
    embeds = torch.zeros(2, 4, 3)
    patches = torch.arange(9.0).view(3, 3)
    out = scatter_image_tokens(embeds, IDS, IMAGE, _encode, patches, torch.tensor([[1, 3]]))
    assert torch.equal(out[0, 3], patches[0] * 10) and torch.equal(out[1, 0], patches[1] * 10)
    assert torch.equal(out[1, 2], patches[2] * 10)
    assert torch.count_nonzero(out[IDS != IMAGE]) == 0


def test_without_images_the_embeddings_are_returned_as_they_are():
    embeds = torch.randn(1, 3, 4)
    assert scatter_image_tokens(embeds, torch.tensor([[1, 2, 3]]), IMAGE, _encode, None, None) is embeds


@pytest.mark.parametrize(
    "patches, grid, field",
    [
        (None, None, "pixel_patches: input_ids hold 3 image placeholders but no image"),
        (torch.zeros(3, 3), None, "grid_hw: is required with pixel_patches"),
        (torch.zeros(2, 3), torch.tensor([[1, 2]]), "input_ids: 3 image placeholders for 2 image tokens"),
    ],
)
def test_input_errors_name_the_input(patches, grid, field):
    with pytest.raises(ValueError, match="^" + field):
        scatter_image_tokens(torch.zeros(2, 4, 3), IDS, IMAGE, _encode, patches, grid)


def test_megatron_model_places_them_on_its_sequence_first_embeddings():
    from moe_plugin.megatron.multimodal import MultimodalGPTModel

    table = torch.randn(16, 3)
    encoded = []

    def encode(pixel_patches, grid_hw):
        encoded.append(pixel_patches.shape[0])
        return pixel_patches * 10.0

    vision = SimpleNamespace(merge_size=1, patch_dim=3)  # the blank image: one patch row of 3 zeros
    model = SimpleNamespace(
        embedding=lambda input_ids, position_ids: table[input_ids].transpose(0, 1),
        image_token_id=IMAGE,
        encode_images=encode,
        vision=vision,
    )
    patches = torch.arange(9.0).view(3, 3)
    got = MultimodalGPTModel.embed_with_images(model, IDS, patches, torch.tensor([[1, 3]]))
    want = scatter_image_tokens(table[IDS], IDS, IMAGE, _encode, patches, torch.tensor([[1, 3]]))
    assert got.shape == (4, 2, 3) and torch.equal(got, want.transpose(0, 1))
    text = torch.tensor([[1, 2, 3]])
    blank = MultimodalGPTModel.embed_with_images(model, text, None, None)
    assert torch.equal(blank, table[text].transpose(0, 1)) and encoded == [3, 1]  # the blank image was encoded
