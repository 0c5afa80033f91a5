"""Shared cases and plain references of the DSA op tests (test_dsa.py: attention; test_dsa_indexer.py: the
lightning indexer, its top-k and its KL loss): causal softmax loops and inputs drawn from a seed."""

import torch

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def qkv(B=2, T=19, S=None, H=3, D=8, Dv=5, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, T, H, D), mk(B, S, H, D), mk(B, S, H, Dv)


def index_inputs(B=2, T=19, S=None, Hi=4, Di=6, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    return (
        torch.randn(B, T, Hi, Di, generator=g, dtype=dtype),
        torch.randn(B, S, Di, generator=g, dtype=dtype),
        torch.randn(B, T, Hi, generator=g, dtype=dtype),
    )


def visible(t, s, offset=0, cu=None):
    """Plain rule: key s is visible to query t iff it is not in the future and in the same packed sequence."""
    pos = offset + t
    if s > pos:
        return False
    if cu is not None:
        seq = lambda p: max(i for i in range(len(cu) - 1) if cu[i] <= p)  # noqa: E731
        return seq(s) == seq(pos)
    return True


def loop_attention(q, k, v, scale, allowed):
    """Per (b, t, h): softmax over the allowed keys, as plain Python loops over queries."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.shape[1]) if allowed(b, t, s)]
            if not keys:
                continue
            for h in range(H):
                scores = torch.stack([q[b, t, h] @ k[b, s, h] for s in keys]) * scale
                p = torch.softmax(scores, 0)
                out[b, t, h] = sum(p[i] * v[b, s, h] for i, s in enumerate(keys))
    return out


def selection(indices):
    sets = [[set(int(i) for i in row if i >= 0) for row in batch] for batch in indices]
    return lambda b, t, s: s in sets[b][t]


def key_mask(B=2, S=19, seed=2):
    """A random bool [B, S] mask with at least one real key per row."""
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[:, -1] = True
    return mask
