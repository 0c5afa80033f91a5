"""Intra-chunk pieces of chunked KDA: decayed scores, and the unit lower-triangular inverse.

Decayed scores: S[r, c, i] = sum_d rows[r, c, d] k[i, d] exp(G[c, d] - G[i, d]) for c >= i (0 above the
diagonal), G non-increasing along the chunk. Writing exp(G_c - G_i) = exp(G_c - m) exp(m - G_i) makes S one
matmul. With m the midpoint of a block's decay range ("span"), each factor lies within exp(+-span/2), and every
kept entry is a product of two normal floats whose exact value is <= |rows| |k|, so it is as accurate as the
elementwise form. Entries above the diagonal may be huge (even inf) but are discarded by tril, which also
stops them in backward. So a block is factorised when exp(span/2) stays well inside the dtype's range.

Which blocks are that small is decided from the gate's bound, never from the values: a block of s positions
spans at most (s - 1) x max_decay (``factorised_block``), so the form is fixed before any data is seen and the
op reads nothing back from the device (issue 24; the same graph on CPU, on meta for the planner and under
torch.compile). Wider blocks are split into sub-blocks: pairs in different sub-blocks are split at the last
position r before the row's sub-block (i <= r < c), so both factors are <= 1 and nothing can overflow; the
diagonal sub-blocks recurse, down to EXACT_MAX positions, which are computed elementwise (-inf above the
diagonal before exp). Nothing of size C x C x K is formed except for those tiny blocks. An unbounded gate
(Kimi-Linear's) takes the full recursion; K3's (-5 < g) factorises blocks of 16 in fp32 and whole chunks of 64
in fp64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

EXACT_MAX = 4


def intra_chunk_scores(
    rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor, max_decay: Optional[float] = None
) -> torch.Tensor:
    """rows ``[M, R, C, K]`` (R row sets sharing the keys, e.g. q and k); k, G ``[M, C, K]`` -> ``[M, R, C, C]``.

    G may be wider than rows (fp64 for fp32 rows): differences of G are taken in G's dtype, since a long
    cumulative sum loses the small differences between nearby positions; only exp runs in rows' dtype.
    max_decay: a bound on each position's log decay, G[c - 1] - G[c] <= max_decay (the gate's promise; None:
    unbounded). It fixes the form; the values are never inspected.
    """
    return _scores(rows, k, G, factorised_block(rows.dtype, max_decay))


def factorised_block(dtype: torch.dtype, max_decay: Optional[float]) -> int:
    """The most positions a block may have and still be factorised in ``dtype`` under ``max_decay``."""
    if max_decay is None:
        return 1
    if not max_decay >= 0:
        raise ValueError(f"max_decay: expected a bound >= 0 on the log decay a position, got {max_decay}")
    # Factors reach exp(span / 2): keep them below ~exp(0.6 log(max)), leaving room for gradient scales.
    limit = 1.2 * math.log(torch.finfo(dtype).max)
    return 1 << 30 if max_decay == 0 else int(limit / max_decay) + 1


def _scores(rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor, block: int) -> torch.Tensor:
    C = rows.shape[2]
    if C <= block:
        return _factorised(rows, k, G)
    if C <= EXACT_MAX:
        return _elementwise(rows, k, G)
    return _split(rows, k, G, block)


def _factorised(rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    M, R, C, K = rows.shape
    mid = (G[:, :1] + G[:, -1:]) / 2
    left = (rows * _exp(G - mid, rows).unsqueeze(1)).flatten(1, 2)  # [M, R*C, K]
    right = k * _exp(mid - G, rows)
    return (left @ right.transpose(-1, -2)).view(M, R, C, C).tril()


def _elementwise(rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    C = rows.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    decay = _exp((G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal.unsqueeze(-1), float("-inf")), rows)
    keyed = decay * k.unsqueeze(1)  # [M, c, i, K]
    return (keyed @ rows.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # [M, c, i, R] -> [M, R, c, i]


def _split(rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor, block: int) -> torch.Tensor:
    M, R, C, K = rows.shape
    n = next(d for d in range(min(4, C), C + 1) if C % d == 0)  # sub-blocks, four when C allows
    sub = C // n
    row_blocks = rows.view(M, R, n, sub, K)
    Gb = G.view(M, n, sub, K)
    diag = _scores(
        row_blocks.transpose(1, 2).reshape(M * n, R, sub, K),
        k.reshape(M * n, sub, K),
        Gb.reshape(M * n, sub, K),
        block,
    ).view(M, n, R, sub, sub)
    eye = torch.eye(n, dtype=rows.dtype, device=rows.device)[:, None, :, None]
    full = (diag.transpose(1, 2).unsqueeze(-2) * eye).reshape(M, R, C, C)
    if n == 1:
        return full
    # Sub-block a >= 1 against every earlier column, split at r = the last position of sub-block a - 1.
    ref = Gb[:, :-1, -1, :]  # [M, n-1, K]
    before = torch.arange(C, device=G.device) < (torch.arange(1, n, device=G.device) * sub)[:, None]
    col_decay = (ref.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~before.unsqueeze(-1), float("-inf"))
    cols = _exp(col_decay, rows) * k.unsqueeze(1)  # [M, n-1, C, K]; 0 from r + 1 on
    row_decay = _exp(Gb[:, 1:] - ref.unsqueeze(2), rows)  # [M, n-1, sub, K], <= 1
    left = (row_blocks[:, :, 1:] * row_decay.unsqueeze(1)).transpose(1, 2).flatten(2, 3)  # [M, n-1, R*sub, K]
    off = (left @ cols.transpose(-1, -2)).view(M, n - 1, R, sub, C).transpose(1, 2).reshape(M, R, C - sub, C)
    return torch.cat([full[:, :, :sub], full[:, :, sub:] + off], dim=2)


def _exp(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.to(like.dtype).exp()


class _UnitLowerInverse(torch.autograd.Function):
    """(I + L)^-1 for strictly lower-triangular L ``[..., C, C]``. A triangular solve against I forward; the
    backward is two matmuls, d(I + L)^-1 = -(I + L)^-1 dL (I + L)^-1, instead of autograd's solve."""

    @staticmethod
    def forward(ctx, L: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
        inv = torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(inv)
        return inv

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (inv,) = ctx.saved_tensors
        inv_t = inv.transpose(-1, -2)
        return -(inv_t @ grad @ inv_t).tril(-1)


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for strictly lower-triangular ``L`` ``[..., C, C]`` (entries on and above the diagonal
    are ignored)."""
    return _UnitLowerInverse.apply(L)
