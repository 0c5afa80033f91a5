import math

import pytest
import torch

from moe_plugin.config import VisionConfig
from moe_plugin.layers.vision import (
    PatchMerger,
    VisionAttention,
    VisionEncoder,
    VisionTower,
    apply_rotary,
    image_segments,
    interpolate_pos_embed,
    patch_positions,
    rotary_2d_angles,
)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def tiny_config(**kw):
    base = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_grid=8, out_hidden_size=24)
    base.update(kw)
    return VisionConfig(**base)


def random_patches(cfg, grid):
    n = sum(h * w for h, w in grid)
    return torch.randn(n, cfg.patch_dim), torch.tensor(grid, dtype=torch.int64)


def plain_positions(grid, m):
    """(row, col) per packed patch, by walking (merged row, merged col, inner row, inner col)."""
    out = []
    for h, w in grid:
        for mr in range(h // m):
            for mc in range(w // m):
                for ir in range(m):
                    for ic in range(m):
                        out.append((mr * m + ir, mc * m + ic))
    return torch.tensor(out)


def plain_rotary(x, positions, theta):
    """Per position, head and pair: pair (i, i + D/2) turns by row * f_i (i < D/4) or col * f_(i - D/4)."""
    n, heads, d = x.shape
    quarter = d // 4
    out = x.clone().double()
    for t in range(n):
        row, col = positions[t].tolist()
        for h in range(heads):
            for i in range(d // 2):
                axis_pos, j = (row, i) if i < quarter else (col, i - quarter)
                angle = axis_pos * theta ** (-j / quarter)
                a, b = x[t, h, i].item(), x[t, h, i + d // 2].item()
                out[t, h, i] = a * math.cos(angle) - b * math.sin(angle)
                out[t, h, i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_patch_positions_match_plain_walk():
    grid = [[4, 6], [2, 2], [6, 2]]
    got = patch_positions(torch.tensor(grid), 2)
    assert torch.equal(got, plain_positions(grid, 2))


def test_rotary_2d_matches_plain_reference():
    torch.manual_seed(0)
    grid = [[4, 6], [2, 4]]
    positions = patch_positions(torch.tensor(grid), 2)
    x = torch.randn(positions.shape[0], 2, 16)
    angles = rotary_2d_angles(positions, 16, 100.0)
    got = apply_rotary(x, (angles.cos(), angles.sin()))
    assert rel(got.double(), plain_rotary(x, positions, 100.0)) < 1e-6


def test_rotary_scores_depend_only_on_offset():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq, pk):
        aq = rotary_2d_angles(torch.tensor([pq]), 16, 10000.0)
        ak = rotary_2d_angles(torch.tensor([pk]), 16, 10000.0)
        return (apply_rotary(q, (aq.cos(), aq.sin())) * apply_rotary(k, (ak.cos(), ak.sin()))).sum()

    base = score((1, 2), (3, 5))
    assert abs(score((4, 7), (6, 10)) - base) < 1e-4 * abs(base)
    assert abs(score((1, 3), (3, 5)) - base) > 1e-3  # a different offset gives a different score


def test_pos_embed_interpolation_at_own_size_is_identity():
    table = torch.randn(8, 8, 32)
    assert torch.allclose(interpolate_pos_embed(table, 8, 8), table, atol=1e-6, rtol=0)


def test_pos_embed_interpolation_matches_plain_bilinear():
    torch.manual_seed(0)
    g, h, w = 5, 4, 6
    table = torch.randn(g, g, 3, dtype=torch.float64)
    got = interpolate_pos_embed(table, h, w)

    def sample(out_size, i):  # half-pixel centres, clamped at the edge
        src = max((i + 0.5) * g / out_size - 0.5, 0.0)
        lo = min(int(math.floor(src)), g - 1)
        return lo, min(lo + 1, g - 1), src - lo

    want = torch.empty(h, w, 3, dtype=torch.float64)
    for r in range(h):
        r0, r1, fr = sample(h, r)
        for c in range(w):
            c0, c1, fc = sample(w, c)
            top = table[r0, c0] * (1 - fc) + table[r0, c1] * fc
            bottom = table[r1, c0] * (1 - fc) + table[r1, c1] * fc
            want[r, c] = top * (1 - fr) + bottom * fr
    assert rel(got.double(), want) < 1e-6


def test_position_embeddings_read_true_row_and_col():
    cfg = tiny_config()
    tower = VisionTower(cfg)
    grid = [[4, 6], [2, 2]]
    positions = patch_positions(torch.tensor(grid), 2)
    got = tower.position_embeddings(torch.tensor(grid), positions)
    want = []
    for h, w in grid:
        table = interpolate_pos_embed(tower.pos_embed.detach(), h, w)
        for r, c in plain_positions([[h, w]], 2).tolist():
            want.append(table[r, c])
    assert rel(got.detach(), torch.stack(want)) < 1e-6


def test_attention_matches_plain_softmax_per_image():
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=32, num_heads=2)
    attn = VisionAttention(cfg).double()
    grid = [[2, 4], [4, 2], [2, 2]]
    x = torch.randn(sum(h * w for h, w in grid), 32, dtype=torch.float64)
    positions = patch_positions(torch.tensor(grid), 2)
    angles = rotary_2d_angles(positions, 16, cfg.rope_theta)
    got = attn(x, (angles.cos(), angles.sin()), image_segments(torch.tensor(grid)))

    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k, v = qkv[:, :32].view(-1, 2, 16), qkv[:, 32:64].view(-1, 2, 16), qkv[:, 64:].view(-1, 2, 16)
    q, k = plain_rotary(q, positions, cfg.rope_theta), plain_rotary(k, positions, cfg.rope_theta)
    out, offset = torch.zeros_like(q), 0
    for h, w in grid:
        s = slice(offset, offset + h * w)
        for head in range(2):
            scores = q[s, head] @ k[s, head].T / math.sqrt(16)
            out[s, head] = torch.softmax(scores, dim=-1) @ v[s, head]
        offset += h * w
    want = out.reshape(-1, 32) @ attn.proj.weight.T + attn.proj.bias
    assert rel(got, want) < 1e-6  # rotary angles are computed in fp32


def test_packed_images_equal_each_image_alone():
    torch.manual_seed(0)
    cfg = tiny_config()
    enc = VisionEncoder(cfg).eval()
    grid = [[4, 6], [2, 2], [4, 6], [10, 4]]  # a repeated size (batched together) and one above max_grid
    x, g = random_patches(cfg, grid)
    packed = enc(x, g)
    alone, offset = [], 0
    for h, w in grid:
        alone.append(enc(x[offset : offset + h * w], torch.tensor([[h, w]])))
        offset += h * w
    assert rel(packed, torch.cat(alone)) < 1e-5


def test_merged_token_count_and_grouping():
    torch.manual_seed(0)
    cfg = tiny_config()
    enc = VisionEncoder(cfg)
    grid = [[4, 6], [2, 2]]
    x, g = random_patches(cfg, grid)
    out = enc(x, g)
    assert out.shape == (x.shape[0] // 4, cfg.out_hidden_size)
    tower_out = enc.vision_tower(x, g)
    merged = PatchMerger(cfg)(tower_out)
    positions = plain_positions(grid, 2)
    for j in range(merged.shape[0]):
        rows = positions[4 * j : 4 * j + 4].tolist()
        r0, c0 = rows[0]
        assert rows == [[r0, c0], [r0, c0 + 1], [r0 + 1, c0], [r0 + 1, c0 + 1]]
        assert torch.equal(merged[j], tower_out[4 * j : 4 * j + 4].reshape(-1))
    out.sum().backward()
    assert enc.vision_tower.pos_embed.grad is not None and enc.mm_projector.linear_1.weight.grad is not None


def test_parameter_names():
    names = {n for n, _ in VisionEncoder(tiny_config(num_layers=1)).named_parameters()}
    for want in (
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.pos_embed",
        "vision_tower.blocks.0.norm1.weight",
        "vision_tower.blocks.0.attn.qkv.weight",
        "vision_tower.blocks.0.attn.proj.weight",
        "vision_tower.blocks.0.mlp.fc1.weight",
        "vision_tower.blocks.0.mlp.fc2.weight",
        "vision_tower.blocks.0.norm2.weight",
        "vision_tower.final_norm.weight",
        "mm_projector.linear_1.weight",
        "mm_projector.linear_2.weight",
        "mm_projector.norm.weight",
    ):
        assert want in names


@pytest.mark.parametrize(
    "grid, dtype, match",
    [
        ([[4, 6]], torch.int64, "grid_hw"),  # holds 24 patches, 28 given
        ([[3, 4], [2, 2]], torch.int64, "grid_hw"),  # odd side
        ([[4, 6], [2, 2]], torch.float32, "grid_hw"),  # not integers
        ([[4, 6, 1]], torch.int64, "grid_hw"),  # not [num_images, 2]
    ],
)
def test_bad_grid_raises(grid, dtype, match):
    cfg = tiny_config()
    x = torch.randn(28, cfg.patch_dim)
    with pytest.raises(ValueError, match=match):
        VisionTower(cfg)(x, torch.tensor(grid, dtype=dtype))


def test_bad_pixel_patches_raise():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="pixel_patches"):
        VisionTower(cfg)(torch.randn(4, cfg.patch_dim + 1), torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match="pixel_patches"):
        VisionTower(cfg)(torch.ones(4, cfg.patch_dim, dtype=torch.int64), torch.tensor([[2, 2]]))


def test_bad_config_raises():
    with pytest.raises(ValueError, match="VisionConfig.rope_theta"):
        tiny_config(rope_theta=0.0)
    with pytest.raises(ValueError, match="VisionConfig.num_heads"):
        tiny_config(hidden_size=24, num_heads=4)  # head dim 6 is not a multiple of 4


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = tiny_config()
    enc = VisionEncoder(cfg).train()
    x, g = random_patches(cfg, [[4, 6], [2, 2]])
    grads = []
    for recompute in (False, True):
        enc.zero_grad()
        enc.vision_tower.gradient_checkpointing = recompute
        enc(x, g).square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in enc.parameters()]))
    assert rel(grads[1], grads[0]) < 1e-6


def test_bf16_matches_fp32():
    torch.manual_seed(0)
    cfg = tiny_config()
    enc = VisionEncoder(cfg)
    x, g = random_patches(cfg, [[4, 6], [2, 2]])
    want = enc(x, g)
    got = enc.to(torch.bfloat16)(x, g)  # fp32 patches are cast to the weights' dtype
    assert got.dtype == torch.bfloat16 and rel(got.float(), want) < 3e-2
