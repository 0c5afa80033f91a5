"""Running the model's own layers on the ``meta`` device (docs/planner.md, "Activations").

A meta tensor has a shape and a dtype but no values, so a forward at full size costs no memory and autograd
still records what it would save. A few ops decide something from values; inside ``meta_forward()`` each of
them gets a stand-in that keeps the op's saved set (read off the op's own source) and replaces the decision
by the planner's stated assumption:

- the MoE dispatch (``permute``): balanced routing times a capacity factor. This rank's ``E / EP`` local
  experts receive ``N x top_k x capacity`` rows (every EP rank sends its share of its tokens' copies), in
  equal blocks; the combine (``unpermute``) takes its ``N x top_k`` rows back. The experts themselves run
  unchanged on those rows, sliced to the local experts;
- with ``MetaDispatch(kernels="gpu")``, the KDA chunk op is counted as the GPU kernel that ``ops/backend.py``
  picks on CUDA holds it (flash-linear-attention 0.6's ``ChunkKDAFunction`` with its default recompute): it
  saves its inputs, the chunk-local cumulative gate (fp32) and the two intra-chunk matrices ``Aqk``, ``Akk``
  ``[B, T, H, chunk]``, and its forward makes and drops the per-chunk states ``h [B, chunks, H, K, V]`` and
  the WY factors; the CPU path (the default) keeps its fp32 chunk tensors, as measured.

The rest runs as it is: the value checks read nothing outside ``MOE_PLUGIN_DEBUG_CHECKS=1`` and check only the
dtype of a meta tensor (``ops.checks.check_ids``); KDA's intra-chunk scores take the form the gate's bound fixes,
the one measured (``ops.kda.intra`` reads no values); DSA's top-k runs unchanged; the experts' grouped
products are the custom op ``moe_plugin::grouped_mm`` with its fake kernel (``ops/moe/grouped_mm.py``), and
DSA's sparse attention the custom op ``moe_plugin::sparse_attention`` with its fake kernels and autograd
(``ops/dsa/sparse_op.py``: it saves q, k, v, the indices, the output and the log-sum-exp).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Iterator

import torch

__all__ = ["meta_forward", "MetaDispatch"]


class MetaDispatch:
    """The routing assumption of a meta forward: ``local_experts`` run on this rank, ``capacity`` >= 1."""

    def __init__(self, local_experts: int, capacity: float, kernels: str = "cpu"):
        if kernels not in ("cpu", "gpu"):
            raise ValueError(f"kernels: must be 'cpu' or 'gpu', got {kernels!r}")
        self.local_experts, self.capacity, self.kernels = local_experts, capacity, kernels

    def rows(self, tokens: int, top_k: int) -> int:
        per_expert = math.ceil(tokens * top_k * self.capacity / self.local_experts)
        return per_expert * self.local_experts


class _MetaCombine(torch.autograd.Function):
    """``unpermute`` on meta: ``N x k`` of the received rows weighted back onto N tokens; saves what
    ``ops.moe.permute._WeightedCombine`` saves (the rows, the order and the weights)."""

    @staticmethod
    def forward(ctx, y_sorted, order, weights):
        ctx.save_for_backward(y_sorted, order, weights)
        return y_sorted.new_empty(weights.shape[0], y_sorted.shape[1])

    @staticmethod
    def backward(ctx, grad):
        y, order, w = ctx.saved_tensors
        return torch.zeros_like(y), None, torch.zeros_like(w)


class _MetaReplicate(torch.autograd.Function):
    """``permute``'s row copy on meta: saves the ``[M]`` token index, as ``_ReplicateRows`` does."""

    @staticmethod
    def forward(ctx, x, rows):
        token = torch.empty(rows, dtype=torch.long, device=x.device)
        ctx.save_for_backward(token)
        ctx.n = x.shape[0]
        return x.new_empty(rows, x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.n, grad.shape[1]), None


class _MetaGpuChunkKDA(torch.autograd.Function):
    """The GPU KDA kernel's memory on meta (module docstring): q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]`` -> o ``[B, T, H, V]``; ``chunks`` is the number of chunks over every sequence."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunks: int, chunk: int):
        b, t, h, kd = q.shape
        g_cumsum = g.new_empty(b, t, h, kd, dtype=torch.float32)
        a_qk, a_kk = q.new_empty(b, t, h, chunk), q.new_empty(b, t, h, chunk)
        # made and dropped inside the forward: states per chunk, the WY factors, the gated keys, new values
        work = [
            q.new_empty(b, chunks, h, kd, v.shape[-1]),
            q.new_empty(b, t, h, kd),
            v.new_empty(v.shape),
            q.new_empty(b, t, h, kd),
            v.new_empty(v.shape),
            g.new_empty(b, t, h, 16, dtype=torch.float32),
        ]
        out = v.new_empty(v.shape)
        del work
        ctx.save_for_backward(q, k, v, g, beta, g_cumsum, a_qk, a_kk)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta = ctx.saved_tensors[:5]
        return (
            torch.zeros_like(q),
            torch.zeros_like(k),
            torch.zeros_like(v),
            torch.zeros_like(g),
            torch.zeros_like(beta),
            None,
            None,
        )


def _chunk_count(t: int, batch: int, chunk: int, cu_seqlens) -> int:
    if cu_seqlens is None:
        return batch * -(-t // chunk)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return sum(-(-n // chunk) for n in lengths if n > 0)


def _patch(stack: contextlib.ExitStack, module, name: str, value) -> None:
    old = getattr(module, name)
    setattr(module, name, value)
    stack.callback(setattr, module, name, old)


@contextlib.contextmanager
def meta_forward(dispatch: MetaDispatch) -> Iterator[None]:
    """Within this context the layers run on meta tensors (see the module docstring); outside, unchanged."""
    from ..layers import kda as kda_layer
    from ..layers import moe as moe_layer

    real_stacked = moe_layer.StackedExperts.forward
    from ..layers.packed_experts import PackedStackedExperts

    real_packed = PackedStackedExperts.forward

    def permute(x, indices, num_experts):
        if not x.is_meta:
            return moe_layer_permute(x, indices, num_experts)
        rows = dispatch.rows(x.shape[0], indices.shape[1])
        counts = torch.full((num_experts,), rows // dispatch.local_experts, dtype=torch.long, device=x.device)
        return _MetaReplicate.apply(x, rows), counts, torch.empty(rows, dtype=torch.long, device=x.device)

    def unpermute(y_sorted, order, weights):
        return (
            _MetaCombine.apply(y_sorted, order, weights)
            if y_sorted.is_meta
            else moe_layer_unpermute(y_sorted, order, weights)
        )

    def stacked_forward(self, x_sorted, tokens_per_expert):
        if not x_sorted.is_meta:
            return real_stacked(self, x_sorted, tokens_per_expert)
        el = dispatch.local_experts  # this rank's experts only: the layer was built with all E on meta
        local = _LocalExperts(self, el)
        return real_stacked(local, x_sorted, tokens_per_expert[:el])

    def packed_forward(self, x_sorted, tokens_per_expert):
        if not x_sorted.is_meta:
            return real_packed(self, x_sorted, tokens_per_expert)
        el = dispatch.local_experts  # per-expert blocks are split on the host: give it real counts
        counts = torch.full((el,), x_sorted.shape[0] // el, dtype=torch.long)
        return real_packed(_LocalExperts(self, el), x_sorted, counts)

    real_chunk_kda = kda_layer.chunk_kda

    def gpu_chunk_kda(
        q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64, **kwargs
    ):
        if not q.is_meta:
            return real_chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                cu_seqlens=cu_seqlens,
                chunk_size=chunk_size,
                **kwargs,
            )
        chunks = _chunk_count(q.shape[1], q.shape[0], 64, cu_seqlens)  # fla's chunk is 64 tokens
        o = _MetaGpuChunkKDA.apply(q, k, v, g, beta, chunks, 64)
        sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        final = (
            q.new_empty(sequences, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
            if output_final_state
            else None
        )
        return o, final

    moe_layer_permute, moe_layer_unpermute = moe_layer.permute, moe_layer.unpermute
    with contextlib.ExitStack() as stack:
        if dispatch.kernels == "gpu":
            _patch(stack, kda_layer, "chunk_kda", gpu_chunk_kda)
        _patch(stack, moe_layer, "permute", permute)
        _patch(stack, moe_layer, "unpermute", unpermute)
        _patch(stack, moe_layer.StackedExperts, "forward", stacked_forward)
        _patch(stack, PackedStackedExperts, "forward", packed_forward)
        yield


class _LocalExperts:
    """The first ``el`` experts of a meta ``StackedExperts`` (or its packed subclass), for its forward."""

    def __init__(self, experts, el: int):
        self._experts, self._el = experts, el

    def __getattr__(self, name):
        value = getattr(self._experts, name)
        if isinstance(value, types.MethodType) and value.__self__ is self._experts:
            return types.MethodType(value.__func__, self)  # its own methods see the sliced tensors too
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] > self._el:
            return value[: self._el]
        return value
