"""K3's vision encoder, MoonViT-3D, with its patch-merger projector (docs/multimodal.md 7), under the release's names.

Parameters (``weight`` each, no biases), as the published checkpoint names them below ``vision_tower.`` and
``mm_projector.``:

- ``patch_embed.proj`` ``[hidden, C, P, P]``: a stride-P convolution, one output row a patch;
- ``patch_embed.pos_emb`` ``[G, G, hidden]``: the 2-D position table, resampled bilinearly to each image's grid
  (used as it is when the grid is G x G). The time table (``pos_emb_time`` frames of 1-D sin-cos over ``hidden``)
  is fixed, computed rather than stored: the release has no tensor for it. An image is one frame and takes none;
- ``encoder.blocks.{i}.{norm0, wqkv [3 * qkv, hidden], wo [hidden, qkv], norm1, mlp.fc0, mlp.fc1}`` and
  ``encoder.final_layernorm``: pre-norm blocks, RMSNorm with the eps of the input's dtype (``norm_eps`` None, as the
  release builds ``nn.RMSNorm(hidden)``), GELU(tanh) inside the MLP;
- the projector ``proj.0 [4 * hidden, 4 * hidden]``, exact GELU, ``proj.2 [out, 4 * hidden]``, then ``post_norm``
  (RMSNorm, ``projector_eps``): the norm comes after the projection, none before it.

Layout: ``pixel_values`` ``[N, C, P, P]`` (or flattened ``[N, C * P * P]``), each image's ``t * h * w`` patches in
raster order (frame, row, column) one image after another, ``grid_thws`` ``[num_images, 3]`` (``[num_images, 2]``
means t = 1). Attention is block-diagonal per image (all its frames). Rotary angles: head dims (2j, 2j + 1) form
pair j; pair 2i turns by ``col * f_i`` and pair 2i + 1 by ``row * f_i``, ``f_i = theta ** (-4 i / head_dim)``,
for rows and columns below 512. The merge ("sd2_tpool") takes each m x m neighbourhood of the raster, averages it
over the frames and concatenates its m * m rows in (inner row, inner col) order into one token.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import VisionConfig
from ..ops.checks import check_tensor
from .vision import Rotary, Segments, _attend, image_segments

ROPE_MAX_SIDE = 512  # the release's rotary table covers rows and columns 0..511
Thw = List[Tuple[int, int, int]]


def grid_thw_sides(grid: torch.Tensor, merge_size: int, total_patches: int, max_frames: int) -> Thw:
    """The (t, h, w) of every image as host ints (one read of ``grid``), checked: ``grid`` is ``[n, 3]`` (t, h, w)
    or ``[n, 2]`` (h, w; t = 1) integers, h and w positive multiples of ``merge_size`` below 512 patches, t in
    [1, ``max_frames``], the patch counts summing to ``total_patches``. ValueError naming ``grid_thws`` otherwise."""
    check_tensor("grid_thws", grid, ndim=2)
    if grid.shape[0] == 0 or grid.shape[1] not in (2, 3):
        raise ValueError(f"grid_thws: expected shape [num_images >= 1, 3] (t, h, w), got {tuple(grid.shape)}")
    if grid.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grid_thws: expected an int32/int64 tensor, got {grid.dtype}")
    rows = [tuple(int(v) for v in r) for r in grid.tolist()]
    sides = [r if len(r) == 3 else (1, *r) for r in rows]
    for i, (t, h, w) in enumerate(sides):
        if not 1 <= t <= max_frames:
            raise ValueError(f"grid_thws: image {i} has {t} frames; the time table covers 1..{max_frames}")
        if h <= 0 or w <= 0 or h % merge_size or w % merge_size or max(h, w) > ROPE_MAX_SIDE:
            raise ValueError(
                f"grid_thws: image {i} has grid {h}x{w}; each side must be a positive multiple of merge_size "
                f"({merge_size}) of at most {ROPE_MAX_SIDE} patches (the processor's navit resize keeps it so)"
            )
    total = sum(t * h * w for t, h, w in sides)
    if total != total_patches:
        raise ValueError(f"grid_thws: its grids hold {total} patches but pixel_values has {total_patches} rows")
    return sides


def sincos_table(frames: int, dim: int) -> torch.Tensor:
    """1-D sin-cos embedding of positions 0..frames-1: ``[frames, dim]`` fp32, sines then cosines of
    ``pos * 10000 ** (-k / (dim / 2))`` for k < dim / 2 (the release's fixed time table)."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float32) / (dim / 2.0))
    angles = np.arange(frames, dtype=np.float32)[:, None] * omega[None, :]
    return torch.from_numpy(np.concatenate([np.sin(angles), np.cos(angles)], axis=1)).float()


def interleaved_rotary(sides: Thw, head_dim: int, theta: float, device) -> Rotary:
    """(cos, sin) ``[N, head_dim / 2]`` fp32 for the packed patches (layout in the module docstring)."""
    quarter = head_dim // 4
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[:quarter].float() / head_dim)
    parts = []
    for t, h, w in sides:
        rows = torch.arange(h, device=device).float().repeat_interleave(w)
        cols = torch.arange(w, device=device).float().repeat(h)
        # pair 2i: the column; pair 2i + 1: the row
        angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).flatten(1)
        parts.append(angles.repeat(t, 1))
    angles = torch.cat(parts)
    return angles.cos(), angles.sin()


def apply_interleaved_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate pairs (2j, 2j + 1) of x ``[N, H, D]`` by the angles of ``rotary`` (each ``[N, D / 2]``), in fp32."""
    cos, sin = (r.unsqueeze(1) for r in rotary)
    x32 = x.float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class MoonViTPosEmb(nn.Module):
    """``weight`` ``[G, G, hidden]`` plus the fixed time table (buffer ``time_weight`` ``[frames, 1, hidden]``)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.max_grid, config.max_grid, config.hidden_size))
        self.register_buffer("time_weight", sincos_table(config.pos_emb_time, config.hidden_size)[:, None], False)
        nn.init.normal_(self.weight)  # the release's init: N(0, 1)

    def forward(self, x: torch.Tensor, sides: Thw) -> torch.Tensor:
        """x ``[N, hidden]`` + each image's table, resampled to its grid, plus the time table for t > 1."""
        table, parts = self.weight, []
        for t, h, w in sides:
            if (h, w) == tuple(table.shape[:2]):
                grid = table.flatten(0, 1)
            else:
                grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
                grid = grid[0].permute(1, 2, 0).flatten(0, 1)
            if t > 1:
                grid = (grid[None] + self.time_weight[:t].to(grid.dtype)).flatten(0, 1)
            parts.append(grid)
        return x + torch.cat(parts).to(x.dtype)


class MoonViTPatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = MoonViTPosEmb(config)

    def forward(self, pixel_values: torch.Tensor, sides: Thw) -> torch.Tensor:
        """``[N, C, P, P]`` -> ``[N, hidden]`` with the position embeddings added."""
        x = self.proj(pixel_values).view(pixel_values.shape[0], -1)
        return self.pos_emb(x, sides)


class MoonViTMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, hidden]."""
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class MoonViTBlock(nn.Module):
    """x + wo(attention(rotary(wqkv(norm0(x))))), then + mlp(norm1(x)); attention within each image only."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.norm0 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        # wqkv's rows are laid out [3, heads, head_dim]: q, k, v one after another, heads inside each
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, config.hidden_size, bias=False)
        self.mlp = MoonViTMLP(config)

    def attention(self, x: torch.Tensor, rotary: Rotary, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_interleaved_rotary(q, rotary), apply_interleaved_rotary(k, rotary)
        parts = []
        for index, images, length in segments:
            qs, ks, vs = (t.index_select(0, index).unflatten(0, (images, length)) for t in (q, k, v))
            parts.append(_attend(qs, ks, vs).flatten(0, 1))
        # the segments' indices partition 0..N-1, so one index_copy puts every row back in place
        order = torch.cat([index for index, _, _ in segments])
        out = torch.empty_like(q).index_copy(0, order, torch.cat(parts))
        return self.wo(out.reshape(n, -1))

    def forward(self, x: torch.Tensor, rotary: Rotary, segments: Segments) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x = x + self.attention(self.norm0(x), rotary, segments)
        return x + self.mlp(self.norm1(x))


class MoonViTEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(MoonViTBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)


class MoonViT3dTower(nn.Module):
    """``vision_tower``: patch embedding with positions, ``encoder.blocks``, ``encoder.final_layernorm``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = MoonViTPatchEmbed(config)
        self.encoder = MoonViTEncoder(config)
        # When set (by hand or by transformers' gradient_checkpointing_enable), training recomputes each
        # block in the backward pass instead of keeping its activations.
        self.gradient_checkpointing = False

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """pixel_values ``[N, C, P, P]`` or ``[N, C * P * P]``, grid_thws ``[n, 3]`` or ``[n, 2]`` -> ``[N, hidden]``
        (raster order kept)."""
        cfg = self.config
        check_tensor("pixel_values", pixel_values, floating=True)
        patch = (cfg.num_channels, cfg.patch_size, cfg.patch_size)
        if tuple(pixel_values.shape[1:]) not in (patch, (cfg.patch_dim,)):
            raise ValueError(
                f"pixel_values: expected [num_patches, {cfg.num_channels}, {cfg.patch_size}, {cfg.patch_size}] "
                f"(or flattened [num_patches, {cfg.patch_dim}]), got {tuple(pixel_values.shape)}"
            )
        n = pixel_values.shape[0]
        sides = grid_thw_sides(grid_thws, cfg.merge_size, n, cfg.pos_emb_time)  # the grid's one read
        pixels = pixel_values.reshape(n, *patch).to(self.patch_embed.proj.weight.dtype)
        x = self.patch_embed(pixels, sides)
        rotary = interleaved_rotary(sides, cfg.head_dim, cfg.rope_theta, x.device)
        # an image attends over all its frames: group by t * h * w
        segments = image_segments([(t * h, w) for t, h, w in sides], x.device)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.encoder.blocks:
            if recompute:
                x = checkpoint(block, x, rotary, segments, use_reentrant=False)
            else:
                x = block(x, rotary, segments)
        return self.encoder.final_layernorm(x)


class TemporalPatchMerger(nn.Module):
    """ "sd2_tpool": each m x m neighbourhood of an image's raster, averaged over its frames, as one token."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merge_size = config.merge_size

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """x ``[N, hidden]`` (raster order), grid_thws ``[n, 3]`` or ``[n, 2]`` ->
        ``[sum h * w / m^2, m^2 * hidden]``."""
        m, d = self.merge_size, x.shape[-1]
        sides = grid_thw_sides(grid_thws, m, x.shape[0], max_frames=x.shape[0])
        parts, start = [], 0
        for t, h, w in sides:
            image = x[start : start + t * h * w].view(t, h // m, m, w // m, m, d)
            parts.append(image.permute(0, 1, 3, 2, 4, 5).mean(0).reshape(h * w // (m * m), m * m * d))
            start += t * h * w
        return torch.cat(parts)


class PatchMergerProjector(nn.Module):
    """``mm_projector`` ("patchmergerv2"): ``proj`` = Linear(4D, 4D), GELU, Linear(4D, out), then ``post_norm``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.merged_hidden_size
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=False), nn.GELU(), nn.Linear(width, config.out_hidden_size, bias=False)
        )
        self.post_norm = nn.RMSNorm(config.out_hidden_size, eps=config.projector_eps)
        for linear in (self.proj[0], self.proj[2]):  # the release's init
            nn.init.trunc_normal_(linear.weight, std=math.sqrt(2 / linear.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[M, m^2 * hidden] -> [M, out_hidden]."""
        return self.post_norm(self.proj(x))
