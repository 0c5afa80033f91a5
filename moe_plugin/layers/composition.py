"""One decoder layer's composition: the one copy that the Hugging Face ``DecoderLayer`` and megatron's
``CheckpointedTransformerLayer`` / ``AttnResTransformerLayer`` all run.

A layer reads the residual stream at its attention's mixing point, runs the input norm and the attention, adds
the output to the stream, reads the stream at its MLP's mixing point, runs the pre-MLP norm and the dense MLP
or the routed MoE, adds that output, and closes the Attention-Residual block if it is the block's last layer.
``run_layer`` runs that order inside the activation-checkpointing regions of ``layers.recompute``: ``"layer"``
around everything before the router (a dense layer whole), ``"attention"``, ``"mlp_norm"``, ``"dense_mlp"``
and the mixing points' ``"attn_res_mix"``. The MoE is called outside them, so the router runs once whatever
the mode (the MoE holds the same mode and checkpoints its own ``"experts"`` / ``"moe_out"``).

Each face adapts only its calling convention, in the ``LayerParts`` it passes: the Hugging Face layer works on
``[B, T, D]`` through ``PlainStream`` / ``AttnResStream`` and its attention returns the DSA indexer loss;
megatron's layers work on ``[S, B, H]``, the plain one through a stream whose ``add`` is megatron's
bias-dropout-add, the AttnRes one through ``AttnResStream``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch

from .recompute import read_stream, recomputed

__all__ = ["LayerParts", "run_layer"]

# a stream's state() (Hugging Face, AttnRes) or megatron's one residual tensor
State = Union[Tuple[torch.Tensor, ...], torch.Tensor]


class LayerParts(NamedTuple):
    """A layer's sublayers as callables, in the face's own layout (``[B, T, D]`` or ``[S, B, H]``).

    stream: ``(state, after_attention) -> stream``: the residual stream (``read()`` / ``read(proj, norm)``,
    ``add(out)``, ``end_block()``, ``state()``) over the layer's input state, or over the state the layer
    returned from its ``"layer"`` region (``after_attention=True``: an AttnRes stream then ends with the block's
    partial sum).
    attention: the read input -> ``(output, aux)``, the input norm included; aux (the indexer loss or None) is
    returned as ``run_layer``'s third value.
    mlp_norm: the read input -> the pre-MLP norm's output (the MoE's input; a dense layer's MLP input).
    mlp: a dense layer's MLP: the normed input -> the output ``stream.add`` takes. None on an MoE layer.
    moe: an MoE layer's MoE: the normed input -> ``(output, expert load or None)``. None on a dense layer.
    attention_point, mlp_point: the AttnRes mixing points ``(proj, norm)``; ``()`` reads the plain residual.
    ends_block: whether this layer closes an AttnRes block (``layers.attn_res.ends_block``).
    """

    stream: Callable[[State, bool], Any]
    attention: Callable[[torch.Tensor], Tuple[Any, Any]]
    mlp_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Optional[Callable[[torch.Tensor], Any]] = None
    moe: Optional[Callable[[torch.Tensor], Tuple[Any, Optional[torch.Tensor]]]] = None
    attention_point: tuple = ()
    mlp_point: tuple = ()
    ends_block: bool = False


def _norm_then(norm: Callable, mlp: Callable, x: torch.Tensor):
    return mlp(norm(x))


def run_layer(
    state: State, parts: LayerParts, mode: str = "off", checkpoint_fn: Optional[Callable] = None
) -> Tuple[State, Optional[torch.Tensor], Any]:
    """Advance the stream's ``state`` (what ``parts.stream`` takes and ``stream.state()`` gives: a tuple of
    tensors, or one tensor, ``[B, T, D]`` or ``[S, B, H]`` each) through one layer, recomputing the regions
    ``mode`` names (``layers.recompute.recomputed``, with ``checkpoint_fn``).

    Returns ``(state after the layer, expert load or None (dense layers), the attention's aux)``. The
    ``"layer"`` region takes and returns the state rather than the stream, so only tensors cross it. Its form
    is the face's: torch's non-reentrant checkpoint saves a bare tensor argument through the saved-tensor hooks
    (megatron's layer passes its residual so) and holds a tuple's tensors by reference (the AttnRes state).
    """
    if (parts.mlp is None) == (parts.moe is None):
        raise ValueError("LayerParts: pass exactly one of mlp (a dense layer) and moe (an MoE layer)")

    def region(name: str, fn: Callable, *args):
        return recomputed(mode, name, fn, *args, checkpoint_fn=checkpoint_fn)

    def through_attention(before: State):
        """(the stream after the attention's add, the MLP's read input, aux)."""
        stream = parts.stream(before, False)
        x = read_stream(mode, stream, parts.attention_point, checkpoint_fn)
        out, aux = region("attention", parts.attention, x)
        stream.add(out)
        return stream, read_stream(mode, stream, parts.mlp_point, checkpoint_fn), aux

    def closed(stream) -> State:
        if parts.ends_block:
            stream.end_block()
        return stream.state()

    if parts.moe is None:

        def dense_layer(before: State):
            stream, x, aux = through_attention(before)
            stream.add(region("dense_mlp", _norm_then, parts.mlp_norm, parts.mlp, x))
            return closed(stream), aux

        after, aux = region("layer", dense_layer, state)
        return after, None, aux

    def before_router(before: State):
        stream, x, aux = through_attention(before)
        return stream.state(), region("mlp_norm", parts.mlp_norm, x), aux

    after_attention, h, aux = region("layer", before_router, state)
    out, load = parts.moe(h)
    stream = parts.stream(after_attention, True)
    stream.add(out)
    return closed(stream), load, aux
