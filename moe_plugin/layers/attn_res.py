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

Under ZeRO-3 a parameter is gathered only when its module is called, so the stream *calls* a mixing
point's ``proj`` and ``norm`` (``attn_res_read``) and never reads their ``.weight``. Between modules the
stream travels as a tuple of tensors (``state()`` / ``from_state``), a type ZeRO-3's hooks understand: the
completed block values, then the current block's partial sum when the block has one, i.e. when the number
of layers done is not a multiple of the block size (``has_partial``). A pipeline stage would send that
tuple as its payload (docs/attn-res-distributed.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm, rms_norm


def _stack(candidates: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([c.float() for c in candidates])  # [N, ..., D] in fp32


def _combine(values: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values ``[N, ..., D]`` fp32, logits ``[N, ...]`` -> the softmax(N)-weighted sum ``[..., D]`` in dtype."""
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(dtype)


def attn_res_mix(
    candidates: Sequence[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-weighted mix of the candidates, weights from ``(RMSNorm(v_c) * norm_weight) . proj_weight``.

    The functional form (plain tensors); modules use ``attn_res_read``, which calls them instead.
    candidates: N tensors ``[..., D]`` (``[B, T, D]`` or megatron's ``[S, B, D]``); proj_weight: ``[1, D]``;
    norm_weight: ``[D]``. Returns ``[..., D]`` in the candidates' dtype, computed in fp32.
    """
    values = _stack(candidates)
    return _combine(values, rms_norm(values, norm_weight, eps) @ proj_weight.float().reshape(-1), candidates[0].dtype)


def attn_res_read(candidates: Sequence[torch.Tensor], proj: "AttnResProjection", norm: RMSNorm) -> torch.Tensor:
    """``attn_res_mix`` with the mixing point's modules called (so ZeRO-3 gathers their weights).

    candidates: N tensors ``[..., D]``; proj: ``AttnResProjection(D)``; norm: ``RMSNorm(D)``. -> ``[..., D]``.
    """
    values = _stack(candidates)
    return _combine(values, proj(norm(values)).squeeze(-1), candidates[0].dtype)


class AttnResProjection(nn.Linear):
    """A mixing point's learned query, ``weight [1, D]``; it starts at zero so the first mixes are plain
    averages. Its own class so that model-wide initialisation can tell it from other one-output Linears."""

    def __init__(self, dim: int):
        super().__init__(dim, 1, bias=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., D]`` -> logits ``[..., 1]`` in fp32 (a bf16 weight is promoted, as the mix is fp32)."""
        return F.linear(x.float(), self.weight.float())


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

    def state(self) -> Tuple[torch.Tensor, ...]:
        """``(hidden,)``."""
        return (self.hidden,)

    @classmethod
    def from_state(cls, state: Sequence[torch.Tensor], has_partial: bool = False) -> "PlainStream":
        return cls(state[0])


class AttnResStream:
    """Completed block values (the embedding first) and the current block's partial sum."""

    def __init__(self, embeddings: torch.Tensor):
        self.blocks: List[torch.Tensor] = [embeddings]
        self.partial: Optional[torch.Tensor] = None

    def candidates(self) -> List[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def read(self, proj: AttnResProjection, norm: RMSNorm) -> torch.Tensor:
        """The sublayer input ``[B, T, D]``: the candidates mixed by calling proj (``weight [1, D]``) and norm."""
        return attn_res_read(self.candidates(), proj, norm)

    def add(self, out: torch.Tensor) -> None:
        """out: a sublayer's output ``[B, T, D]``, added to the current block's partial sum ``[B, T, D]``
        (which it starts when the block has none yet)."""
        self.partial = out if self.partial is None else self.partial + out

    def end_block(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None

    def state(self) -> Tuple[torch.Tensor, ...]:
        """The completed block values ``[B, T, D]`` each (the embedding first), then the partial sum if any."""
        return tuple(self.candidates())

    @classmethod
    def from_state(cls, state: Sequence[torch.Tensor], has_partial: bool) -> "AttnResStream":
        """The stream whose ``state()`` is ``state``; ``has_partial``: its last tensor is the partial sum."""
        if len(state) < (2 if has_partial else 1):
            raise ValueError(
                f"state: {len(state)} tensors cannot hold the embedding"
                f"{' and a partial sum' if has_partial else ''}; pass the tuple state() returned"
            )
        stream = cls(state[0])
        stream.blocks = list(state[:-1] if has_partial else state)
        stream.partial = state[-1] if has_partial else None
        return stream


def has_partial(layers_done: int, block_size: int) -> bool:
    """Whether an AttnRes state after ``layers_done`` layers ends with a partial block sum."""
    return layers_done % block_size != 0


def ends_block(layer_idx: int, block_size: int) -> bool:
    """Whether the 0-based layer ``layer_idx`` closes an AttnRes block of ``block_size`` layers (its state then
    has no partial sum): the one block schedule of both faces' decoder layers."""
    return not has_partial(layer_idx + 1, block_size)


def stream_from_state(
    state: Sequence[torch.Tensor], attn_res: bool, layers_done: int, block_size: int
) -> Union[PlainStream, AttnResStream]:
    """The stream whose ``state()`` is ``state`` after ``layers_done`` layers (blocks of ``block_size``)."""
    if not attn_res:
        return PlainStream.from_state(state)
    return AttnResStream.from_state(state, has_partial(layers_done, block_size))


def layer_stream(
    state: Sequence[torch.Tensor], after_attention: bool, *, attn_res: bool, layer_idx: int, block_size: int
) -> Union[PlainStream, AttnResStream]:
    """The stream of the 0-based layer ``layer_idx`` over ``state``: its input (the state after ``layer_idx``
    layers) or, ``after_attention``, the state after its attention's add, when an AttnRes stream always ends
    with the block's partial sum. A ``layers.composition.LayerParts.stream`` for both faces."""
    if attn_res and after_attention:
        return AttnResStream.from_state(state, True)
    return stream_from_state(state, attn_res, layer_idx, block_size)


def make_stream(embeddings: torch.Tensor, attn_res: bool) -> Union[PlainStream, AttnResStream]:
    """A residual stream over the embeddings ``[B, T, D]``: an ``AttnResStream`` with Attention Residuals,
    else a ``PlainStream``; every tensor it later reads or is given is ``[B, T, D]`` too."""
    return AttnResStream(embeddings) if attn_res else PlainStream(embeddings)
