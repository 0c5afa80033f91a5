"""Grouped expert products over packed weights, dequantising one group of experts at a time.

``packed_grouped_linear`` computes ``x_e @ W_e^T`` for every expert block of ``x_sorted`` with ``W`` stored
packed (``formats``). Forward and backward each dequantise a group of ``group_size`` experts into the compute
dtype, run the product for that group's rows, and drop the dequantised weights before the next group, so at
most one group of dequantised weights is alive at a time and none is saved for backward (the autograd
Function saves only the packed tensors themselves and the token counts; backward dequantises again). The
packed base is frozen: no gradient flows to it. The product is the custom op ``moe_plugin::packed_grouped_linear``
(a fake kernel and a registered autograd), so ``torch.compile`` traces a packed layer through it; the group
bounds are host ints read inside its eager kernel, once per counts tensor (``ops.offsets.host_counts``). On
``meta`` the same group loop runs in the open instead (``_PackedGroupedLinear``), so that the planner's dispatch
mode sees its one group of dequantised weights at a time (a custom op's insides are hidden from it); that
needs counts carrying their host copy (``ops.offsets.counts_tensor``, as the planner's dispatch makes them).
``grouped_lora`` adds the experts' low-rank adapters on the
activation side, ``scaling * (x_e A_e^T) B_e^T``, which equals adding ``scaling * B_e A_e`` to ``W_e``.

``dequantize_experts`` decodes a group into one output tensor a slice of rows at a time, so that beyond the
group's dequantised bytes the decoder's work tensors (int64 byte indices, fp32 values: about 8 bytes a weight)
cover at most ``1 / DECODE_SPLITS`` of the group (or ``MIN_DECODE_CHUNK`` weights): a training step's peak then
grows by one group of dequantised experts and little more (tests/layers/test_packed_memory.py measures it).
``ops.backend.packed_dequant_kernel`` is where a fused GPU kernel would replace it; none exists yet.
"""

from __future__ import annotations


import torch

from ..backend import packed_dequant_kernel
from ..meta_loops import steps_to_run
from ..offsets import host_counts
from ..moe.grouped_mm import grouped_mm, grouped_mm_supported
from .formats import decode, packed_spec

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DECODE_SPLITS",
    "MIN_DECODE_CHUNK",
    "dequantize_experts",
    "packed_grouped_linear",
    "packed_grouped_linear_reference",
    "grouped_lora",
    "grouped_lora_reference",
]

DEFAULT_GROUP_SIZE = 8  # experts dequantised together: one grouped matmul per group
DECODE_SPLITS = 16  # a group is decoded in at most this many row slices (work memory ~ 1/16 of ~8 B a weight)
MIN_DECODE_CHUNK = 1 << 16  # weights a slice holds at least, so small groups are not cut into tiny pieces


def dequantize_experts(
    fmt: str, packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """packed ``[G, out, *]``, scale ``[G, out, ceil(in/32)]`` -> ``[G, out, in]`` of ``dtype``: a fused kernel
    where ``ops.backend.packed_dequant_kernel`` has one (none today), else the torch decoder, a slice of rows
    at a time into the one output tensor (see the module docstring)."""
    kernel = packed_dequant_kernel(fmt, packed, scale)
    if kernel is not None:
        return kernel(packed, scale, in_features, dtype)
    rows_p, rows_s = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1])
    out = torch.empty(rows_p.shape[0], in_features, dtype=dtype, device=packed.device)
    step, rows = max(1, max(MIN_DECODE_CHUNK, -(-out.numel() // DECODE_SPLITS)) // max(in_features, 1)), out.shape[0]
    # on meta one slice of each size (ops.meta_loops): the slices free their work tensors one after the other
    starts = steps_to_run(range(0, rows, step), out.is_meta, kind=lambda r: min(step, rows - r), size=lambda r: 0)
    for r in starts:
        out[r : r + step] = decode(fmt, rows_p[r : r + step], rows_s[r : r + step], in_features, dtype)
    return out.view(*packed.shape[:-1], in_features)


def _mm(x: torch.Tensor, w_t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row blocks of ``x [m, k]`` (sizes ``counts [G]``) times ``w_t [G, k, n]`` -> ``[m, n]``."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w_t.shape[2])
    if grouped_mm_supported(x, w_t.transpose(1, 2)) and w_t.shape[2] * x.element_size() % 16 == 0:
        # the group sizes are kept on the host (the blocks are split there); the kernel wants its offsets on x's device
        return grouped_mm(x, w_t, torch.cumsum(counts, 0, dtype=torch.int32).to(x.device))
    blocks = x.split(host_counts(counts).tolist())
    return torch.cat([b @ w for b, w in zip(blocks, w_t.unbind(0))])


def _run_groups(
    x: torch.Tensor,
    counts: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    in_features: int,
    group_size: int,
    transpose: bool,
) -> torch.Tensor:
    """Forward (``transpose``: ``x @ W^T``, out width = W's rows) or the input gradient (``x @ W``, width
    ``in_features``), one dequantised group of experts at a time."""
    width = packed.shape[1] if transpose else in_features
    out = x.new_empty(x.shape[0], width)
    bounds = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).tolist()
    E = packed.shape[0]
    groups = [(g0, min(g0 + group_size, E)) for g0 in range(0, E, group_size)]
    rows = {g: int(bounds[g[1]]) - int(bounds[g[0]]) for g in groups}
    # no token: nothing to dequantise; on meta the group with the most rows of each size (ops.meta_loops)
    groups = [g for g in groups if rows[g]]
    for g0, g1 in steps_to_run(groups, x.is_meta, kind=lambda g: g[1] - g[0], size=lambda g: rows[g]):
        r0, r1 = int(bounds[g0]), int(bounds[g1])
        w = dequantize_experts(fmt, packed[g0:g1], scale[g0:g1], in_features, x.dtype)  # [G, out, in]
        out[r0:r1] = _mm(x[r0:r1], w.transpose(1, 2) if transpose else w, counts[g0:g1])
        del w  # freed before the next group is decoded
    return out


class _PackedGroupedLinear(torch.autograd.Function):
    """The op's group loop in the open (the meta path, module docstring); counts ``[E]`` on the host."""

    @staticmethod
    def forward(ctx, x, counts, packed, scale, fmt, in_features, group_size):
        ctx.save_for_backward(counts, packed, scale)  # the stored packed tensors, not a dequantised copy
        ctx.meta = (fmt, in_features, group_size)
        return _run_groups(x, counts, packed, scale, fmt, in_features, group_size, transpose=True)

    @staticmethod
    def backward(ctx, grad_out):
        counts, packed, scale = ctx.saved_tensors
        fmt, in_features, group_size = ctx.meta
        grad_x = _run_groups(
            grad_out.contiguous(), counts, packed, scale, fmt, in_features, group_size, transpose=False
        )
        return grad_x, None, None, None, None, None, None


@torch.library.custom_op("moe_plugin::packed_grouped_linear", mutates_args=())
def _packed_op(
    x: torch.Tensor,
    counts: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    in_features: int,
    group_size: int,
    transpose: bool,
) -> torch.Tensor:
    """``transpose``: ``x @ W^T`` (the forward), else ``x @ W`` (its input gradient); counts on any device."""
    host = host_counts(counts)  # the group bounds: one read per counts tensor, kept on it for the next call
    if int(host.sum()) != x.shape[0]:
        raise ValueError(
            f"tokens_per_expert: counts summing to x_sorted rows ({x.shape[0]}), got {host.tolist()} "
            f"summing to {int(host.sum())}"
        )
    return _run_groups(x, host, packed, scale, fmt, in_features, group_size, transpose)


@_packed_op.register_fake
def _(x, counts, packed, scale, fmt, in_features, group_size, transpose):
    return x.new_empty(x.shape[0], packed.shape[1] if transpose else in_features)


def _packed_setup(ctx, inputs, output) -> None:
    _, counts, packed, scale, fmt, in_features, group_size, transpose = inputs
    ctx.save_for_backward(counts, packed, scale)  # the stored packed tensors, not a dequantised copy
    ctx.meta = (fmt, in_features, group_size, transpose)


def _packed_backward(ctx, grad_out):
    counts, packed, scale = ctx.saved_tensors
    fmt, in_features, group_size, transpose = ctx.meta
    grad_x = _packed_op(grad_out.contiguous(), counts, packed, scale, fmt, in_features, group_size, not transpose)
    return grad_x, None, None, None, None, None, None, None


_packed_op.register_autograd(_packed_backward, setup_context=_packed_setup)


def packed_grouped_linear(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    in_features: int,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """``x_e @ W_e^T`` per expert block. x_sorted: ``[M, in]`` rows grouped by expert; tokens_per_expert:
    ``[E]``; packed/scale: ``[E, out, *]`` in ``fmt`` (``formats``). Returns ``[M, out]`` in x's dtype;
    differentiable in x only (the packed base is frozen)."""
    spec = packed_spec(fmt, in_features)
    if x_sorted.dim() != 2 or x_sorted.shape[1] != in_features or not x_sorted.is_floating_point():
        raise ValueError(
            f"x_sorted: expected a floating [M, {in_features}] tensor, got {x_sorted.dtype} {list(x_sorted.shape)}"
        )
    if packed.dim() != 3 or packed.shape[2] != spec.packed_cols:
        raise ValueError(
            f"packed: expected [E, out, {spec.packed_cols}] for {fmt} with {in_features} inputs, "
            f"got {list(packed.shape)}"
        )
    if tokens_per_expert.shape != (packed.shape[0],):
        raise ValueError(
            f"tokens_per_expert: expected [{packed.shape[0]}] counts (one per expert), got "
            f"{list(tokens_per_expert.shape)}"
        )
    if group_size < 1:
        raise ValueError(f"group_size: must be a positive number of experts, got {group_size}")
    if x_sorted.is_meta:  # the group loop in the open, for the planner (module docstring)
        counts = host_counts(tokens_per_expert)
        return _PackedGroupedLinear.apply(x_sorted, counts, packed, scale, fmt, in_features, group_size)
    return _packed_op(x_sorted, tokens_per_expert, packed, scale, fmt, in_features, group_size, True)


def packed_grouped_linear_reference(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    in_features: int,
) -> torch.Tensor:
    """Same contract, plainly: every expert dequantised once by the reference decoder, then a loop."""
    w = decode(fmt, packed, scale, in_features, x_sorted.dtype, reference=True)
    blocks = x_sorted.split(tokens_per_expert.tolist())
    outs = [b @ we.t() for b, we in zip(blocks, w.unbind(0))]
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, packed.shape[1])


def grouped_lora(
    x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``scaling * (x_e A_e^T) B_e^T`` per expert block: lora_a ``[E, r, in]``, lora_b ``[E, out, r]`` ->
    ``[M, out]`` (peft's stacked adapters, see ``moe_plugin.lora_packed``)."""
    # the counts stay where they are: the grouped kernel takes them on the device (_mm)
    # grouped matmul wants each expert's matrix contiguous: peft's B columns are expert-minor
    xa = _mm(x_sorted, lora_a.to(x_sorted.dtype).contiguous().transpose(1, 2), tokens_per_expert)
    return _mm(xa, lora_b.to(x_sorted.dtype).contiguous().transpose(1, 2), tokens_per_expert) * scaling


def grouped_lora_reference(
    x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Same contract as ``grouped_lora``, as a loop over experts."""
    blocks = x_sorted.split(tokens_per_expert.tolist())
    outs = [scaling * (b @ a.t()) @ bb.t() for b, a, bb in zip(blocks, lora_a.unbind(0), lora_b.unbind(0))]
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, lora_b.shape[1])
