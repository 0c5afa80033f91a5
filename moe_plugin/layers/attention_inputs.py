"""How one forward's tokens are laid out, as every attention layer of it reads them: the one description the
model builds per forward and hands to each layer (a layer called alone builds its own from its keyword
arguments), so the combinations are checked in one place.

The modes, exactly one at a time:
- rows: ``[B, T]`` rows, each one sequence (a cache may be given: decoding appends to it);
- packed: ``cu_seqlens`` ``[N + 1]``, N documents packed into a batch of one (no cache, no padding);
- padded: ``token_mask`` ``[B, T]`` bool, False at padding before a row's real tokens (left padding, as a
  batched prompt is; with or without a cache);
- context: this rank's ``ContextSlice`` of a packed row under context parallelism, the documents its
  ``offsets`` (no cu_seqlens, cache or padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.checks import check_tensor
from ..ops.context import ContextSlice, check_context_rows, refuse_with_context

__all__ = ["AttentionInputs", "describe_inputs"]


@dataclass(frozen=True)
class AttentionInputs:
    """One forward's token layout (module docstring): ``batch`` x ``length`` tokens a layer sees, with at most one
    of ``cu_seqlens`` (int64, its host copy kept: ``ops.offsets``), ``token_mask`` (bool) and ``context``;
    ``decoding``: a cache is passed beside it."""

    batch: int
    length: int
    cu_seqlens: Optional[torch.Tensor] = None
    token_mask: Optional[torch.Tensor] = None
    context: Optional[ContextSlice] = None
    decoding: bool = False

    @property
    def mode(self) -> str:
        """``"context"``, ``"packed"``, ``"padded"`` or ``"rows"``."""
        if self.context is not None:
            return "context"
        if self.cu_seqlens is not None:
            return "packed"
        return "padded" if self.token_mask is not None else "rows"


def describe_inputs(
    batch: int,
    length: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    token_mask: Optional[torch.Tensor] = None,
    context: Optional[ContextSlice] = None,
    decoding: bool = False,
) -> AttentionInputs:
    """The ``AttentionInputs`` of ``batch`` rows of ``length`` tokens; a combination no mode allows raises a
    ValueError naming the argument and what to pass instead."""
    if context is not None:
        refuse_with_context(cu_seqlens=cu_seqlens, cache=True if decoding else None, token_mask=token_mask)
        check_context_rows(context, "hidden_states", batch, length)
        return AttentionInputs(batch, length, context=context)
    if cu_seqlens is not None and decoding:
        raise ValueError("cu_seqlens: packed sequences cannot be decoded with a cache; pass one or the other")
    if token_mask is not None:
        check_tensor("token_mask", token_mask, shape=(batch, length))
        if cu_seqlens is not None:
            raise ValueError("token_mask: padding cannot be combined with cu_seqlens (pack only real tokens)")
        token_mask = token_mask.bool()
    return AttentionInputs(batch, length, cu_seqlens, token_mask, None, decoding)


def layer_inputs(
    inputs: Optional[AttentionInputs], hidden_states: torch.Tensor, cache, **given: Optional[object]
) -> AttentionInputs:
    """An attention layer's description of its call: the forward's ``inputs`` (then none of ``given``, the
    layer's own keyword arguments ``cu_seqlens``, ``token_mask``, ``context``, may be set as well), or, called
    alone, one built from ``given``. ``hidden_states`` ``[B, T, D]``; ``cache``: the layer's, or None."""
    batch, length = hidden_states.shape[:2]
    if inputs is None:
        return describe_inputs(batch, length, decoding=cache is not None, **given)
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name}: the token layout is already given by inputs; pass it once")
    if (inputs.batch, inputs.length) != (batch, length):
        raise ValueError(
            f"hidden_states: inputs describe {inputs.batch} x {inputs.length} tokens, got {batch} x {length}"
        )
    if inputs.decoding != (cache is not None):
        raise ValueError("cache: inputs were described " + ("with" if inputs.decoding else "without") + " one")
    return inputs
