"""K3's MoonViT-3D tower and its patchmergerv2 projector (moe_plugin/layers/moonvit.py) against the published code.

No MoonViT implementation installs on this CPU machine (transformers 4.x ships none; the release's
modeling_kimi_k3.py imports flash-linear-attention at import time), so the reference below re-derives the published
code's math in plain loop form, from the release's own definitions (docs/multimodal.md 7): the conv patch embedding,
the 64 x 64 table through ``F.interpolate(mode="bilinear")`` unless the grid is the table's size, the sin-cos time
table built with numpy as the release builds it, rotary angles as the release's complex ``freqs_cis`` table (a
512 x 512 polar grid, x = column first) applied with ``view_as_complex`` on adjacent pairs, the eager attention
with its block mask over ``cu_seqlens`` and an fp32 softmax, ``nn.RMSNorm``'s eps (the dtype's when None), GELU(tanh)
and exact GELU written out, the "sd2_tpool" merge as an index loop, then proj.0, GELU, proj.2, post_norm. The names
and shapes come from the published weight list (tests/fixtures/k3/weight_families.tsv) and config
(tests/fixtures/k3/config.json).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_plugin.config import VisionConfig
from moe_plugin.layers.vision_encoder import ImageEncoder
from moe_plugin.models.k3_vision import K3_VISION_CONFIG, vision_config_from_k3, vision_config_to_k3

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "k3"
SMALL = dict(
    K3_VISION_CONFIG,
    vt_hidden_size=32,
    mm_hidden_size=32,
    vt_intermediate_size=64,
    vt_num_attention_heads=2,
    qkv_hidden_size=48,
    vt_num_hidden_layers=2,
    text_hidden_size=40,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
)
# (t, h, w): resampled table, the table's own size (used as it is), two frames (the time table)
GRIDS = [(1, 4, 6), (1, 8, 8), (2, 4, 4)]


def published_vision_families():
    """{name pattern: shape} of the release's vision tensors, from the published weight list."""
    out = {}
    for line in (FIXTURES / "weight_families.tsv").read_text().splitlines():
        if line.startswith(("vision_tower.", "mm_projector.")):
            name, _, shape, dtype, _ = line.split("\t")
            out[name] = json.loads(shape)
    return out


def release_names(num_layers):
    return {
        n.replace("{B}", str(b)) for n in published_vision_families() for b in range(num_layers if "{B}" in n else 1)
    }


def test_the_published_vision_config_maps_key_for_key_and_back():
    published = json.loads((FIXTURES / "config.json").read_text())["vision_config"]
    assert K3_VISION_CONFIG == published
    config = vision_config_from_k3(published)
    assert (config.kind, config.hidden_size, config.num_layers, config.num_heads, config.qkv_hidden_size) == (
        "moonvit3d",
        1024,
        27,
        12,
        1536,
    )
    assert (config.head_dim, config.max_grid, config.pos_emb_time, config.merge_size, config.out_hidden_size) == (
        128,
        64,
        4,
        2,
        7168,
    )
    assert vision_config_to_k3(config) == published
    from moe_plugin.models.presets import preset_config  # the k3 preset's tower is the release's

    assert preset_config("k3").to_model_config().vision == config


def test_full_size_tower_has_the_published_names_and_shapes():
    """Built on meta from the published config: every release tensor and no other, at its published shape."""
    with torch.device("meta"):
        encoder = ImageEncoder(vision_config_from_k3(K3_VISION_CONFIG))
    got = {n: list(p.shape) for n, p in encoder.state_dict().items()}
    want = {}
    for pattern, shape in published_vision_families().items():
        for b in range(27 if "{B}" in pattern else 1):
            want[pattern.replace("{B}", str(b))] = shape
    assert got == want


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mm_projector_type", "patchmerger", "vision_config.mm_projector_type: only 'patchmergerv2'"),
        ("merge_type", "sd2", "vision_config.merge_type: only 'sd2_tpool'"),
        ("activation_func", "gelu", "vision_config.activation_func: only 'gelu_pytorch_tanh'"),
        ("norm_type", "layernorm", "vision_config.norm_type: only 'rmsnorm'"),
        ("attn_bias", True, "vision_config.attn_bias: only False"),
        ("pos_emb_type", "learned", "vision_config.pos_emb_type: only 'divided_fixed'"),
        ("pos_emb_interpolation_mode", "bicubic", "vision_config.pos_emb_interpolation_mode: only 'bilinear'"),
        ("projector_hidden_act", "silu", "vision_config.projector_hidden_act: only 'gelu'"),
        ("merge_kernel_size", [2, 3], r"vision_config.merge_kernel_size: only a square merge"),
        ("init_pos_emb_width", 32, "vision_config.init_pos_emb_width: only a square position table"),
        ("mm_hidden_size", 512, r"vision_config.mm_hidden_size: .* must equal vt_hidden_size \(1024\)"),
        ("vt_rope_theta", 1e4, "vision_config.vt_rope_theta: not a key of K3's MoonViT-3D vision_config"),
        ("vt_num_attention_heads", 7, r"vision_config.vt_num_attention_heads: must divide qkv_hidden_size"),
    ],
)
def test_a_tower_this_project_does_not_build_is_refused_by_key(key, value, message):
    with pytest.raises(ValueError, match="^" + message):
        vision_config_from_k3(dict(K3_VISION_CONFIG, **{key: value}))


def test_a_missing_size_is_refused_by_key():
    config = dict(K3_VISION_CONFIG)
    del config["vt_hidden_size"]
    with pytest.raises(ValueError, match="^vision_config.vt_hidden_size: required"):
        vision_config_from_k3(config)


# --- the published code's math, in loop form -------------------------------------------------------------------


def rms(x, w, eps):
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def freqs_cis_table(head_dim, side=512, theta=10000.0):
    """The release's precomputed cis table: [side, side, head_dim / 2] complex64, entry 2i the column's angle."""
    flat = torch.arange(side * side).float()
    x, y = flat % side, flat // side
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim)
    xc = torch.polar(torch.ones(side * side, head_dim // 4), torch.outer(x, freqs))
    yc = torch.polar(torch.ones(side * side, head_dim // 4), torch.outer(y, freqs))
    return torch.stack([xc, yc], dim=-1).reshape(side, side, head_dim // 2)


def sincos(frames, dim):
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float32) / (dim / 2.0))
    out = np.einsum("m,d->md", np.arange(frames, dtype=np.float32), omega)
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1)).float()


def reference(sd, c: VisionConfig, pixels, grids):
    d, heads, hd = c.hidden_size, c.num_heads, c.head_dim
    x = F.conv2d(pixels, sd["vision_tower.patch_embed.proj.weight"], stride=c.patch_size).view(pixels.shape[0], -1)
    table = sd["vision_tower.patch_embed.pos_emb.weight"]
    pos, rope, cu = [], [], [0]
    cis = freqs_cis_table(hd)
    for t, h, w in grids:
        if (h, w) == tuple(table.shape[:2]):
            two_d = table.flatten(0, 1)
        else:
            two_d = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0].permute(1, 2, 0)
            two_d = two_d.flatten(0, 1)
        pos.append(two_d if t == 1 else (two_d[None] + sincos(c.pos_emb_time, d)[:t, None]).flatten(0, 1))
        rope.append(cis[:h, :w].reshape(-1, hd // 2).repeat(t, 1))
        cu.append(cu[-1] + t * h * w)
    x = x + torch.cat(pos)
    rope = torch.cat(rope)[:, None]
    n = x.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, b in zip(cu[:-1], cu[1:]):
        mask[a:b, a:b] = True
    for i in range(c.num_layers):
        p = f"vision_tower.encoder.blocks.{i}."
        qkv = (rms(x, sd[p + "norm0.weight"], c.norm_eps) @ sd[p + "wqkv.weight"].T).view(n, 3, heads, hd)
        q, k, v = qkv.unbind(1)
        q = torch.view_as_real(torch.view_as_complex(q.float().view(n, heads, -1, 2)) * rope).flatten(-2)
        k = torch.view_as_real(torch.view_as_complex(k.float().view(n, heads, -1, 2)) * rope).flatten(-2)
        scores = q.transpose(0, 1) @ k.transpose(0, 1).transpose(-2, -1) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1, dtype=torch.float32)
        att = (scores @ v.transpose(0, 1)).transpose(0, 1).reshape(n, -1)
        x = x + att @ sd[p + "wo.weight"].T
        hmid = gelu_tanh(rms(x, sd[p + "norm1.weight"], c.norm_eps) @ sd[p + "mlp.fc0.weight"].T)
        x = x + hmid @ sd[p + "mlp.fc1.weight"].T
    x = rms(x, sd["vision_tower.encoder.final_layernorm.weight"], c.norm_eps)
    merged, start, m = [], 0, c.merge_size
    for t, h, w in grids:
        image = x[start : start + t * h * w].view(t, h, w, d)
        for bi in range(h // m):
            for bj in range(w // m):
                rows = [image[:, bi * m + a, bj * m + b].mean(0) for a in range(m) for b in range(m)]
                merged.append(torch.cat(rows))
        start += t * h * w
    y = gelu_erf(torch.stack(merged) @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return rms(y, sd["mm_projector.post_norm.weight"], c.projector_eps)


def release_state_dict(c: VisionConfig, seed=0):
    """Random tensors under the release's names (the published weight list), sized for ``c``."""
    g = torch.Generator().manual_seed(seed)
    sizes = {
        "proj.weight": [c.hidden_size, c.num_channels, c.patch_size, c.patch_size],
        "pos_emb.weight": [c.max_grid, c.max_grid, c.hidden_size],
        "wqkv.weight": [3 * c.qkv_hidden_size, c.hidden_size],
        "wo.weight": [c.hidden_size, c.qkv_hidden_size],
        "fc0.weight": [c.intermediate_size, c.hidden_size],
        "fc1.weight": [c.hidden_size, c.intermediate_size],
        "proj.0.weight": [c.merged_hidden_size] * 2,
        "proj.2.weight": [c.out_hidden_size, c.merged_hidden_size],
        "post_norm.weight": [c.out_hidden_size],
    }
    sd = {}
    for name in sorted(release_names(c.num_layers)):
        key = next((k for k in sizes if name.endswith("." + k)), None)
        shape = sizes[key] if key else [c.hidden_size]  # the tower's norms
        scale = 1.0 if key is None or key in ("pos_emb.weight", "post_norm.weight") else shape[-1] ** -0.5
        sd[name] = torch.randn(shape, generator=g) * scale + (1.0 if re.search(r"norm", name) else 0.0)
    return sd


def inputs(c: VisionConfig, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3, c.patch_size, c.patch_size, generator=g), torch.tensor(GRIDS)


def test_tower_and_projector_equal_the_published_math():
    c = vision_config_from_k3(SMALL)
    sd = release_state_dict(c)
    encoder = ImageEncoder(c)
    encoder.load_state_dict(sd, strict=True)
    pixels, grid = inputs(c)
    got = encoder(pixels, grid)
    want = reference(sd, c, pixels, GRIDS)
    assert got.shape == (sum(h * w // 4 for _, h, w in GRIDS), 40)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    flat = encoder(pixels.flatten(1), grid)  # the flattened patch form and a [n, 2] grid (t = 1) are the same
    torch.testing.assert_close(flat, got, rtol=0, atol=0)
    one = torch.tensor([GRIDS[0][1:]])
    torch.testing.assert_close(encoder(pixels[:24], one), got[:6], rtol=1e-5, atol=1e-5)


def test_bf16_norms_take_the_dtype_eps_as_the_release_does():
    c = vision_config_from_k3(SMALL)
    sd = {k: v.bfloat16() for k, v in release_state_dict(c).items()}
    encoder = ImageEncoder(c).bfloat16()
    encoder.load_state_dict(sd, strict=True)
    pixels, grid = inputs(c)
    got = encoder(pixels, grid).float()
    want = reference(
        {k: v.float() for k, v in sd.items()}, VisionConfig(**{**vars(c), "norm_eps": 2.0**-7}), pixels, GRIDS
    )
    assert (got - want).abs().max() < 0.15 * want.abs().max()


@pytest.mark.parametrize(
    "grid, message",
    [
        ([[1, 3, 4]], r"grid_thws: image 0 has grid 3x4; each side must be a positive multiple of merge_size \(2\)"),
        ([[5, 2, 2]], r"grid_thws: image 0 has 5 frames; the time table covers 1..4"),
        ([[1, 4, 4]], r"grid_thws: its grids hold 16 patches but pixel_values has 20 rows"),
        ([[1, 514, 2]], r"grid_thws: image 0 has grid 514x2; .* at most 512 patches"),
    ],
)
def test_grid_errors_name_grid_thws(grid, message):
    encoder = ImageEncoder(vision_config_from_k3(SMALL))
    with pytest.raises(ValueError, match="^" + message):
        encoder(torch.zeros(20, 3, 14, 14), torch.tensor(grid))


def test_pixel_values_of_another_patch_shape_are_refused():
    encoder = ImageEncoder(vision_config_from_k3(SMALL))
    with pytest.raises(ValueError, match=r"^pixel_values: expected \[num_patches, 3, 14, 14\]"):
        encoder(torch.zeros(4, 3, 16, 16), torch.tensor([[1, 2, 2]]))
