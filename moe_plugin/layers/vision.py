"""Vision input (docs/architecture.md 4): ViT tower over 14-pixel patches, 2x2 patch merge, MLP projector.

Patch layout, shared with ``moe_plugin.models.image_processing`` (the one convention both sides use):

- a patch is the ``patch_size x patch_size`` square of all channels, flattened in (C, ph, pw) order, so
  ``pixel_patches[i]`` has length ``C * P * P``;
- an image whose patch grid is ``(h, w)`` (``h``, ``w`` multiples of ``merge_size`` m) contributes ``h * w``
  consecutive rows, ordered by (merged row, merged col, inner row, inner col): the patch at grid position
  ``(row, col)`` has ``row = m * merged_row + inner_row`` and ``col = m * merged_col + inner_col``. Each
  m x m neighbourhood is therefore ``m * m`` consecutive rows, and the merge is a plain reshape;
- images are packed one after another, in the order of ``grid_hw`` ([num_images, 2] = (h, w) per image).

Position embeddings and rotary angles use each patch's true (row, col) from ``patch_positions``, never its
index in the packed sequence. Attention is block-diagonal: a patch sees only the patches of its own image.

The grid is read on the host once per forward (``grid_sides``); positions and segments are built from those
ints on the patches' device, so a grid given as a CPU tensor (as the processor makes it) costs no device read,
and the tower runs on ``meta`` (the planner) as it is.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..compat.torch import fused_attention
from ..config import VisionConfig
from ..ops.checks import check_tensor
from .norm import RMSNorm

# (flat indices [B * L] into the packed sequence, B images, L patches each): images of one length attend
# in one batched SDPA call, which equals running each alone and needs no [N, N] mask.
Segments = List[Tuple[torch.Tensor, int, int]]
# (cos, sin) of the rotary angles, each [N, head_dim / 2] fp32: computed once per forward, used by every layer.
Rotary = Tuple[torch.Tensor, torch.Tensor]
POS_EMBED_INIT_STD = 0.02
# a grid: [num_images, 2] int tensor, or its (h, w) pairs as host ints
Grid = Union[torch.Tensor, Sequence[Sequence[int]]]


def grid_sides(grid_hw: Grid) -> List[Tuple[int, int]]:
    """The (h, w) of every image as host ints: one read of a tensor (none of a CPU one's device), pairs as given."""
    rows = grid_hw.tolist() if isinstance(grid_hw, torch.Tensor) else grid_hw
    return [(int(h), int(w)) for h, w in rows]


def _device_of(grid_hw: Grid, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    return grid_hw.device if isinstance(grid_hw, torch.Tensor) else torch.device("cpu")


def check_grid_hw(grid_hw: torch.Tensor, merge_size: int, total_patches: int) -> List[Tuple[int, int]]:
    """Raise ValueError naming ``grid_hw`` unless it is [num_images, 2] integers, each side a positive multiple
    of ``merge_size``, whose patch counts sum to ``total_patches``; returns its sides (``grid_sides``)."""
    check_tensor("grid_hw", grid_hw, ndim=2)
    if grid_hw.shape[1] != 2 or grid_hw.shape[0] == 0:
        raise ValueError(f"grid_hw: expected shape [num_images >= 1, 2], got {tuple(grid_hw.shape)}")
    if grid_hw.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grid_hw: expected an int32/int64 tensor, got {grid_hw.dtype}")
    sides = grid_sides(grid_hw)
    for i, (h, w) in enumerate(sides):
        if h <= 0 or w <= 0 or h % merge_size or w % merge_size:
            raise ValueError(
                f"grid_hw: image {i} has grid {h}x{w}; each side must be a positive multiple "
                f"of merge_size ({merge_size})"
            )
    total = sum(h * w for h, w in sides)
    if total != total_patches:
        raise ValueError(f"grid_hw: its grids hold {total} patches but pixel_patches has {total_patches} rows")
    return sides


def patch_positions(grid_hw: Grid, merge_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """True (row, col) of every packed patch, in the module docstring's order.

    grid_hw: [num_images, 2] int (or its (h, w) pairs); returns [total_patches, 2] int64 on ``device`` (default:
    grid_hw's, or the CPU for pairs).
    """
    m, device = merge_size, _device_of(grid_hw, device)
    parts = []
    for h, w in grid_sides(grid_hw):
        rows = torch.arange(h, device=device).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
        cols = torch.arange(w, device=device).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
        parts.append(torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1))
    return torch.cat(parts)


def interpolate_pos_embed(table: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bilinearly resample the learned position table to a ``height x width`` grid (half-pixel centres, so
    the table's own size returns it unchanged). table: [G, G, D] -> [height, width, D] in table's dtype."""
    grid = table.permute(2, 0, 1).unsqueeze(0).float()
    out = F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)
    return out[0].permute(1, 2, 0).to(table.dtype)


def rotary_2d_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotation angle of each rotary pair: [N, 2] (row, col) -> [N, head_dim // 2] float32.

    Pair ``i`` (dims ``i`` and ``i + head_dim/2``) turns by ``row * f_i`` for ``i < head_dim/4`` and by
    ``col * f_(i - head_dim/4)`` above, with ``f_j = theta ** (-j / (head_dim / 4))``: each axis gets half
    the rotary dims and the usual 1-D frequency ladder over them.
    """
    quarter = head_dim // 4
    freqs = theta ** (-torch.arange(quarter, device=positions.device, dtype=torch.float32) / quarter)
    pos = positions.float()
    return torch.cat([pos[:, :1] * freqs, pos[:, 1:] * freqs], dim=-1)


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of ``x`` by the angles whose (cos, sin) ``rotary`` holds, each [N, D/2] fp32:
    x [N, H, D] -> [N, H, D] in x's dtype."""
    cos, sin = (t.unsqueeze(1) for t in rotary)
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


def image_segments(grid_hw: Grid, device: Optional[torch.device] = None) -> Segments:
    """Group the packed images by patch count: one entry per distinct length (see ``Segments``), its indices
    on ``device`` (default: grid_hw's, or the CPU for pairs)."""
    device = _device_of(grid_hw, device)
    lengths = [h * w for h, w in grid_sides(grid_hw)]
    starts = [0, *itertools.accumulate(lengths)][:-1]
    by_length = {}
    for start, n in zip(starts, lengths):
        by_length.setdefault(n, []).append(start)
    segments = []
    for n, group in by_length.items():
        base = torch.tensor(group, device=device, dtype=torch.long)
        index = (base[:, None] + torch.arange(n, device=device)).reshape(-1)
        segments.append((index, len(group), n))
    return segments


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.hidden_size)

    def forward(self, pixel_patches: torch.Tensor) -> torch.Tensor:
        """[N, C * P * P] flattened (C, ph, pw) -> [N, hidden]."""
        return self.proj(pixel_patches)


class VisionAttention(nn.Module):
    """Multi-head self-attention with 2-D rotary positions, block-diagonal over the packed images."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        # qkv output is laid out [3, heads, head_dim]: q, k, v one after another, heads inside each.
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, rotary: Rotary, segments: Segments) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if len(segments) == 1 and segments[0][1] == 1:  # one image: no gather/scatter needed
            out = _attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)).squeeze(0)
        else:
            # The segments' indices partition 0..N-1, so one index_copy puts every row back in place.
            parts = []
            for index, images, length in segments:
                qs, ks, vs = (t.index_select(0, index).unflatten(0, (images, length)) for t in (q, k, v))
                parts.append(_attend(qs, ks, vs).flatten(0, 1))
            order = torch.cat([index for index, _, _ in segments])
            out = torch.empty_like(q).index_copy(0, order, torch.cat(parts))
        return self.proj(out.reshape(n, -1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention within each image: [B, L, H, D] each -> [B, L, H, D]."""
    o = fused_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return o.transpose(1, 2)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, hidden]."""
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm ViT layer: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rotary: Rotary, segments: Segments) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """ViT over packed variable-size images (layout in the module docstring)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Parameter(torch.empty(config.max_grid, config.max_grid, config.hidden_size))
        self.reset_parameters()
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps)
        # When set (by hand or by transformers' gradient_checkpointing_enable), training recomputes each
        # block in the backward pass instead of keeping its activations.
        self.gradient_checkpointing = False

    def reset_parameters(self) -> None:
        """The tower's own parameter: the position table ``[max_grid, max_grid, hidden]`` from N(0, 0.02)."""
        nn.init.normal_(self.pos_embed, 0.0, POS_EMBED_INIT_STD)

    def position_embeddings(self, grid_hw: Grid, positions: torch.Tensor) -> torch.Tensor:
        """Learned table resampled to each image's grid, read at each patch's (row, col): -> [N, hidden]."""
        parts, offset, cache = [], 0, {}
        for h, w in grid_sides(grid_hw):
            if (h, w) not in cache:
                cache[h, w] = interpolate_pos_embed(self.pos_embed, h, w)
            pos = positions[offset : offset + h * w]
            parts.append(cache[h, w][pos[:, 0], pos[:, 1]])
            offset += h * w
        return torch.cat(parts)

    def forward(self, pixel_patches: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        """pixel_patches [N, C * P * P] float, grid_hw [num_images, 2] int -> [N, hidden]."""
        cfg = self.config
        check_tensor("pixel_patches", pixel_patches, shape=(None, cfg.patch_dim), floating=True)
        sides = check_grid_hw(grid_hw, cfg.merge_size, pixel_patches.shape[0])  # the grid's one read
        positions = patch_positions(sides, cfg.merge_size, pixel_patches.device)
        angles = rotary_2d_angles(positions, cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        rotary = (angles.cos(), angles.sin())
        segments = image_segments(sides, pixel_patches.device)
        x = self.patch_embed(pixel_patches.to(self.patch_embed.proj.weight.dtype))
        x = x + self.position_embeddings(sides, positions)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, rotary, segments, use_reentrant=False)
            else:
                x = block(x, rotary, segments)
        return self.final_norm(x)


class PatchMerger(nn.Module):
    """Concatenates each m x m neighbourhood (m*m consecutive rows by the layout) into one token."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.group = config.merge_size**2

    def forward(self, x: torch.Tensor, grid_hw: Optional[Grid] = None) -> torch.Tensor:
        """[N, hidden] -> [N / m^2, m^2 * hidden], the inner (row, col) order kept inside each token. ``grid_hw`` is
        not needed (the layout puts each neighbourhood in consecutive rows); taken as every merger's call is."""
        check_tensor("x", x, ndim=2)
        if x.shape[0] % self.group:
            raise ValueError(f"x: expected a multiple of merge_size**2 ({self.group}) rows, got {x.shape[0]}")
        return x.reshape(x.shape[0] // self.group, self.group * x.shape[1])


class MultimodalProjector(nn.Module):
    """Merged vision tokens into the text model's hidden space: Linear -> GELU -> Linear -> RMSNorm."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.merged_hidden_size
        self.linear_1 = nn.Linear(width, width)
        self.linear_2 = nn.Linear(width, config.out_hidden_size)
        self.norm = RMSNorm(config.out_hidden_size, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[M, m^2 * hidden] -> [M, out_hidden]."""
        return self.norm(self.linear_2(F.gelu(self.linear_1(x))))


class VisionEncoder(nn.Module):
    """Tower, 2x2 merge and projector: the image tokens that replace the placeholders' embeddings.

    Parameter names follow docs/architecture.md 7: ``vision_tower.*`` and ``mm_projector.*``.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.patch_merger = PatchMerger(config)
        self.mm_projector = MultimodalProjector(config)

    def forward(self, pixel_patches: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        """pixel_patches [N, C * P * P], grid_hw [num_images, 2] -> [N / merge_size^2, out_hidden]."""
        return self.mm_projector(self.patch_merger(self.vision_tower(pixel_patches, grid_hw)))
