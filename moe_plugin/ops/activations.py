"""Gated activations of the MLPs and experts: SiTU-GLU (K3) and SwiGLU.

``situ_glu``/``swiglu``/``glu`` take the gate projection ``a`` and the up projection ``b`` of the same shape
``[..., F]`` and return ``[..., F]`` in the input dtype; they are the plain references. ``glu_packed`` is the
fast form for a fused ``[..., 2F]`` projection ``[a | b]``: one autograd node with a hand-written backward
that writes both halves of the gradient in place, instead of autograd's zero-filled full-width gradient per
slice plus their sum, and that recomputes the cheap elementwise terms rather than storing them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_tensor

GLU_KINDS = ("situ", "swiglu")


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: ``(beta tanh(a/beta) sigmoid(a)) * (linear_beta tanh(b/linear_beta))`` (docs/architecture.md 2.3).

    gate, up: ``[..., F]``. Computed in fp32 because the soft caps saturate early in bf16; returned in
    ``gate``'s dtype. The tanh caps bound both factors, which is what keeps K3's activations from blowing up.
    """
    _check_pair(gate, up)
    a, b = gate.float(), up.float()
    h = (beta * torch.tanh(a / beta)) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))
    return h.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(a) * b``. gate, up: ``[..., F]`` -> ``[..., F]``."""
    _check_pair(gate, up)
    return F.silu(gate) * up


def glu(kind: str, gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Apply the gated activation named ``kind`` ("situ" or "swiglu"); SwiGLU ignores the SiTU betas.

    gate, up: ``[..., F]`` -> ``[..., F]``.
    """
    if kind == "situ":
        return situ_glu(gate, up, beta=beta, linear_beta=linear_beta)
    if kind == "swiglu":
        return swiglu(gate, up)
    raise ValueError(f"activation: expected one of {GLU_KINDS}, got {kind!r}")


def glu_packed(kind: str, gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """``glu(kind, a, b)`` for ``gate_up = [a | b]``: ``[..., 2F]`` -> ``[..., F]`` in gate_up's dtype.

    Computed in fp32 for lower-precision inputs; SwiGLU ignores the SiTU betas.
    """
    if kind not in GLU_KINDS:
        raise ValueError(f"activation: expected one of {GLU_KINDS}, got {kind!r}")
    check_tensor("gate_up", gate_up, floating=True)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension [..., 2F], got {tuple(gate_up.shape)}")
    return _PackedGLU.apply(gate_up, kind, float(beta), float(linear_beta))


class _PackedGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, kind, beta, linear_beta):
        ctx.save_for_backward(gate_up)
        ctx.kind, ctx.beta, ctx.linear_beta = kind, beta, linear_beta
        a, b = _halves(gate_up)
        if kind == "swiglu":
            h = F.silu(a)
        else:
            h = torch.tanh(a / beta).mul_(beta).mul_(torch.sigmoid(a))
            b = torch.tanh(b / linear_beta).mul_(linear_beta)
        return h.mul_(b).to(gate_up.dtype)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        a, b = _halves(gate_up)
        g = grad.to(a.dtype)
        # Eager writes both halves of one buffer in place (no cat); dynamo takes no out= views, so a traced
        # backward makes the halves and joins them, which inductor fuses.
        out = None if torch.compiler.is_compiling() else torch.empty(gate_up.shape, dtype=a.dtype, device=a.device)
        grad_gate, grad_up = _halves(out) if out is not None else (None, None)
        if ctx.kind == "swiglu":
            # aten's silu_backward fuses silu'(a) = s (1 + a (1 - s)) and the product in one pass.
            grad_gate = torch.mul(g, b, out=grad_gate)
            if out is None:
                grad_gate = torch.ops.aten.silu_backward(grad_gate, a)
            else:
                torch.ops.aten.silu_backward.grad_input(grad_gate, a, grad_input=grad_gate)
            grad_up = torch.mul(F.silu(a), g, out=grad_up)
        else:
            s = torch.sigmoid(a)
            ta = torch.tanh(a / ctx.beta)
            act = (ta * s).mul_(ctx.beta)  # beta tanh(a/beta) sigmoid(a)
            d_act = (1.0 - ta * ta).mul_(s).add_((1.0 - s).mul_(act))
            tb = torch.tanh(b / ctx.linear_beta)
            d_act.mul_(tb).mul_(ctx.linear_beta)  # times the up factor linear_beta tanh(b/linear_beta)
            grad_gate = torch.mul(d_act, g, out=grad_gate)
            d_up = tb.mul_(tb).neg_().add_(1.0)  # d/db of linear_beta tanh(b/linear_beta)
            grad_up = torch.mul(act.mul_(d_up), g, out=grad_up)
        if out is None:
            out = torch.cat([grad_gate, grad_up], dim=-1)
        return out.to(gate_up.dtype), None, None, None


def _halves(gate_up: torch.Tensor):
    f = gate_up.shape[-1] // 2
    x = gate_up if gate_up.dtype in (torch.float32, torch.float64) else gate_up.float()
    return x[..., :f], x[..., f:]


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensor("gate", gate, floating=True)
    check_tensor("up", up, shape=tuple(gate.shape), floating=True)
