"""MoonViT-3D's pieces (moe_plugin/layers/moonvit.py) against an independent implementation that installs here:
transformers' Kimi-K2.5 vision model (``transformers.models.kimi_k25``), the same MoonViT family as K3's tower.

Its blocks differ from K3's (LayerNorm, biases, separate q/k/v at the hidden width, a bicubic position table, a
LayerNorm-first projector), so the whole tower cannot be compared (tests/layers/test_vision_moonvit.py does that
against the published code's math); what the two share is compared here with shared weights: the fixed sin-cos
time table, the 2-D rotary attention within each image (K2.5's checkpoint stores q and k in the rotate-half
layout, so K3's interleaved rows are permuted into it: pair j, dims (2j, 2j + 1), becomes dims (j, j + D/2)),
and the "sd2_tpool" merge over frames. (K2.5's image processor, which has the same navit resize, needs
torchvision, which does not install beside this CPU torch.)
"""

from __future__ import annotations

import pytest
import torch

from moe_plugin.layers.moonvit import (
    MoonViTBlock,
    TemporalPatchMerger,
    grid_thw_sides,
    interleaved_rotary,
    sincos_table,
)
from moe_plugin.layers.vision import image_segments
from moe_plugin.models.k3_vision import K3_VISION_CONFIG, vision_config_from_k3

k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig  # noqa: E402
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids  # noqa: E402

WIDTH, HEADS, FRAMES = 32, 2, 4
GRIDS = [(1, 4, 6), (1, 8, 8), (2, 4, 4)]
CONFIG = dict(
    K3_VISION_CONFIG,
    vt_hidden_size=WIDTH,
    mm_hidden_size=WIDTH,
    qkv_hidden_size=WIDTH,  # K2.5's attention is hidden wide
    vt_num_attention_heads=HEADS,
    vt_intermediate_size=64,
    vt_num_hidden_layers=1,
    text_hidden_size=WIDTH,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
)


@pytest.fixture(scope="module")
def k25_model():
    config = Kimi_K25VisionConfig(
        hidden_size=WIDTH,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        intermediate_size=64,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=FRAMES,
    )
    config._attn_implementation = "eager"
    return k25.Kimi_K25VisionModel(config).eval()


def test_the_time_table_is_k25s_sincos_table(k25_model):
    table = k25_model.patch_embed.pos_emb.time_position_embeddings  # row 0: K2.5's zero row for one-frame clips
    torch.testing.assert_close(sincos_table(FRAMES, WIDTH), table[1:], rtol=1e-6, atol=1e-6)


def test_rotary_attention_per_image_equals_k25s(k25_model):
    config = vision_config_from_k3(CONFIG)
    block = MoonViTBlock(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    grid = torch.tensor(GRIDS)
    n = sum(t * h * w for t, h, w in GRIDS)
    x = torch.randn(n, WIDTH, generator=g)
    sides = grid_thw_sides(grid, 2, n, FRAMES)
    rotary = interleaved_rotary(sides, config.head_dim, config.rope_theta, x.device)
    mine = block.attention(x, rotary, image_segments([(t * h, w) for t, h, w in sides]))

    attn, hd = k25_model.layers[0].attn, config.head_dim
    # interleaved pair j (dims 2j, 2j + 1) -> rotate-half dims (j, j + hd/2), within each head
    half = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    order = torch.cat([h * hd + half for h in range(HEADS)])
    q, k, v = block.wqkv.weight.detach().view(3, WIDTH, WIDTH).unbind(0)
    with torch.no_grad():
        attn.q_proj.weight.copy_(q[order])
        attn.k_proj.weight.copy_(k[order])
        attn.v_proj.weight.copy_(v)
        attn.proj.weight.copy_(block.wo.weight)
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.proj):
            linear.bias.zero_()
        position_ids = get_vision_position_ids(grid, spatial_merge_size=1)
        cos_sin = k25_model.rotary_emb(x, position_ids)
        theirs = attn(x, cu_seqlens=get_vision_cu_seqlens(grid, merge_temporal=True), position_embeddings=cos_sin)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_merge_over_frames_equals_k25s_temporal_merge(k25_model):
    grid = torch.tensor(GRIDS)
    n = sum(t * h * w for t, h, w in GRIDS)
    x = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(2))
    mine = TemporalPatchMerger(vision_config_from_k3(CONFIG))(x, grid)
    theirs = k25_model.temporal_merge(x, grid, 2, 2)  # [tokens, 4, D]
    torch.testing.assert_close(mine, theirs.flatten(1), rtol=1e-6, atol=1e-6)
