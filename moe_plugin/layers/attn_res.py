"""The residual stream, plain or with Attention Residuals (docs/architecture.md 2.3).

A decoder layer never adds to the residual itself: it asks the stream for its sublayer's input
(``read``) and hands back the sublayer's output (``add``). That keeps the layer code identical for the
two forms of the stream:

- ``PlainStream``: the usual ``h <- h + sublayer(norm(h))``.
- ``AttnResStream`` (K3's Block Attention Residuals): the stream keeps the embedding and the sum of the
  outputs of each completed block of ``attn_res_block_size`` layers, plus the running partial sum of
  the current block. A sublayer's input is the softmax-weighted mix over those candidates, the weights
  coming from one learned vector per mixing point applied to ``RMSNorm(candidate) * norm_weight``;
  all in fp32. At the end of a block the partial sum becomes a completed block value.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .norm import RMSNorm


def attn_res_mix(candidates: Sequence[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Softmax-weighted mix of the candidates, weights from ``(RMSNorm(v_c) * norm_weight) . proj_weight``.

    candidates: N tensors ``[B, T, D]``; proj_weight: ``[1, D]``; norm_weight: ``[D]``.
    Returns ``[B, T, D]`` in the candidates' dtype, computed in fp32.
    """
    values = torch.stack([c.float() for c in candidates])  # [N, B, T, D]
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    logits = normed @ proj_weight.float().reshape(-1)  # [N, B, T]
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(candidates[0].dtype)


class AttnResProjection(nn.Linear):
    """A mixing point's learned query, ``weight [1, D]``; it starts at zero so the first mixes are plain
    averages. Its own class so that model-wide initialisation can tell it from other one-output Linears."""

    def __init__(self, dim: int):
        super().__init__(dim, 1, bias=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def attn_res_point(dim: int, eps: float) -> Tuple[AttnResProjection, RMSNorm]:
    """One mixing point's ``(proj, norm)``: a zero ``AttnResProjection`` and an ``RMSNorm(dim)``."""
    return AttnResProjection(dim), RMSNorm(dim, eps)


class PlainStream:
    """``h <- h + out`` after every sublayer."""

    def __init__(self, embeddings: torch.Tensor):
        self.hidden = embeddings

    def read(self, proj: Optional[nn.Linear] = None, norm: Optional[RMSNorm] = None) -> torch.Tensor:
        """The residual ``[B, T, D]``; proj and norm are accepted (and unused) so layers call both forms alike."""
        return self.hidden

    def add(self, out: torch.Tensor) -> None:
        """out: a sublayer's output ``[B, T, D]``, added to the residual ``[B, T, D]``."""
        self.hidden = self.hidden + out

    def end_block(self) -> None:
        pass


class AttnResStream:
    """Completed block values (the embedding first) and the current block's partial sum."""

    def __init__(self, embeddings: torch.Tensor):
        self.blocks: List[torch.Tensor] = [embeddings]
        self.partial: Optional[torch.Tensor] = None

    def candidates(self) -> List[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def read(self, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        """The sublayer input ``[B, T, D]``: the candidates mixed by proj (``weight [1, D]``) and norm."""
        return attn_res_mix(self.candidates(), proj.weight, norm.weight, norm.eps)

    def add(self, out: torch.Tensor) -> None:
        """out: a sublayer's output ``[B, T, D]``, added to the current block's partial sum ``[B, T, D]``
        (which it starts when the block has none yet)."""
        self.partial = out if self.partial is None else self.partial + out

    def end_block(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None


def make_stream(embeddings: torch.Tensor, attn_res: bool) -> Union[PlainStream, AttnResStream]:
    """A residual stream over the embeddings ``[B, T, D]``: an ``AttnResStream`` with Attention Residuals,
    else a ``PlainStream``; every tensor it later reads or is given is ``[B, T, D]`` too."""
    return AttnResStream(embeddings) if attn_res else PlainStream(embeddings)
