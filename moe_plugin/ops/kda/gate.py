"""Per-channel decay gates of KDA and the L2 normalisation of q and k (docs/architecture.md 2.1), in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_plugin.ops.checks import check_tensor


def _gate_inputs(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    check_tensor("f", f, ndim=4, floating=True)
    H, K = f.shape[-2:]
    check_tensor("A_log", A_log, shape=(H,), floating=True)
    check_tensor("dt_bias", dt_bias, shape=(H * K,), floating=True)
    dtype = torch.promote_types(f.dtype, torch.float32)  # fp32 at least, fp64 kept for gradcheck
    x = f.to(dtype) + dt_bias.to(dtype).view(H, K)
    return x, A_log.to(dtype).exp().view(H, 1)


def kda_gate_k3(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0) -> torch.Tensor:
    """K3's bounded gate ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, in ``(lower_bound, 0)``.

    f: ``[B,T,H,K]``; A_log: ``[H]``; dt_bias: ``[H*K]``. Returns ``[B,T,H,K]`` in fp32 (fp64 for fp64 f).
    """
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: must be negative (a log decay), got {lower_bound}")
    x, rate = _gate_inputs(f, A_log, dt_bias)
    return lower_bound * torch.sigmoid(rate * x)


def kda_gate_kimi_linear(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear's unbounded gate ``-exp(A_log) * softplus(f + dt_bias)``.

    f: ``[B,T,H,K]``; A_log: ``[H]``; dt_bias: ``[H*K]``. Returns ``[B,T,H,K]`` in fp32 (fp64 for fp64 f).
    """
    x, rate = _gate_inputs(f, A_log, dt_bias)
    return -rate * F.softplus(x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (eps inside the root, as fla), computed in fp32.

    x: ``[..., D]`` -> ``[..., D]`` in x's dtype.
    """
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
