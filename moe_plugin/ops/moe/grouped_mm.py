"""``grouped_mm``: row blocks times their own matrices, as the custom op ``moe_plugin::grouped_mm``.

``torch._grouped_mm`` (``compat.torch``) does the work on real tensors. Registered with ``torch.library`` it
gets a fake kernel (a meta or fake tensor of the output's shape, any dtype: torch's own meta kernel takes
bf16 only) and a backward of two more grouped products, so the planner runs the experts on ``meta`` unpatched
and ``torch.compile`` traces them as one op. Backward saves only what it needs: the weights for the rows'
gradient, the rows for the weights' (none for frozen experts under LoRA).
"""

from __future__ import annotations

import torch

from ...compat.torch import grouped_mm_kernel, has_grouped_mm

__all__ = ["grouped_mm", "grouped_mm_supported"]


@torch.library.custom_op("moe_plugin::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_mm_kernel(_aligned(a), _aligned(b), offs)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself, or a copy (same strides) when its base address is off the kernel's 16-byte boundary (a view
    into a larger buffer may start anywhere). Checked here, in the op's eager kernel, because an address is
    no property a traced graph (``torch.compile``, the fake kernel) can see."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


@_grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(b if ctx.needs_input_grad[0] else None, a if ctx.needs_input_grad[1] else None, offs)


def _backward(ctx, grad: torch.Tensor):
    b, a, offs = ctx.saved_tensors
    grad = grad.contiguous()  # e.g. the expanded gradient of a sum: the kernel takes no zero strides
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:  # [M, N] x [G, N, K] -> [M, K]
        grad_a = _grouped_mm(grad, b.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:  # each block's rows^T x its gradient: [K, M] x [M, N] -> [G, K, N]
        grad_b = _grouped_mm(a.transpose(0, 1), grad, offs)
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a ``[M, K]`` rows in blocks ending at ``offs`` ``[G]`` int32 (cumulative sizes, on a's device), times
    b ``[G, K, N]``, block g by ``b[g]`` -> ``[M, N]``. Differentiable in a and b. Check
    ``grouped_mm_supported`` first: the kernel's dtype and alignment rules."""
    return _grouped_mm(a, b, offs)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes rows x ``[M, Din]`` against expert matrices w ``[E, Din, F]`` (read as
    ``w.transpose(1, 2)`` products). Meta tensors always (the fake kernel); CUDA bf16; CPU fp32 and bf16,
    with every row stride (Din and F elements) on 16-byte boundaries. Decided from dtypes and shapes only, so
    ``torch.compile`` traces it; an unaligned base address is the op's own business (``_aligned``)."""
    if x.is_meta:
        return True
    if not has_grouped_mm():
        return False
    if x.is_cuda:
        ok_dtype = x.dtype == torch.bfloat16
    else:
        ok_dtype = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    size = x.element_size()
    din, f = w.shape[1], w.shape[2]
    aligned = (din * size) % 16 == 0 and (f * size) % 16 == 0
    return ok_dtype and aligned
