"""The arithmetic of one optimizer step that the loop does around the engine: AdamW's parameter groups, the
loss scale that makes every layout's gradient the global token mean's, sums over the ranks, and the MoE loads
of a step with the selection-bias update of full training."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..compat.deepspeed import full_shape

__all__ = ["parameter_groups", "step_scale", "global_sum", "local_grad_norm", "balance_loads"]


def parameter_groups(params, weight_decay: float) -> List[Dict]:
    """AdamW groups: no weight decay for vectors (norms, biases) and parameters marked ``_no_weight_decay``
    (KDA's ``A_log`` and ``dt_bias``, docs/architecture.md section 2.1)."""
    decay, no_decay = [], []
    for p in params:
        ndim = len(full_shape(p))
        (no_decay if ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def step_scale(label_tokens: int, dp_size: int, accumulation: int) -> float:
    """What a micro-batch's token-loss sum is divided by: the engine divides by ``accumulation`` (backward)
    and averages over ``dp_size`` ranks, so this makes the step's gradient that of the global token mean."""
    return max(label_tokens, 1) / (dp_size * accumulation)


def global_sum(value, device: torch.device) -> float:
    """``value`` (a float, or a one-element tensor, so that a sum kept on the device is read once) summed over
    every rank (fp64, one all-reduce)."""
    t = torch.as_tensor(value, dtype=torch.float64).to(device).reshape(1)
    dist.all_reduce(t)
    return float(t.item())


def local_grad_norm(module) -> float:
    grads = [p.grad.detach().float() for p in module.parameters() if p.requires_grad and p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


def balance_loads(backend, module, full: bool, device: torch.device) -> Optional[torch.Tensor]:
    """Sum each MoE layer's expert load of the step over every rank (``[layers, E]``); with the base training
    (no LoRA) move the selection bias toward balance, the same update on every rank."""
    layers = backend.moe_layers(module)
    loads = [layer.pop_load() for layer in layers]
    if not layers or any(load is None for load in loads):
        return None
    stacked = torch.stack([load.to(device) for load in loads])
    dist.all_reduce(stacked)
    if full:
        for layer, load in zip(layers, stacked):
            layer.update_routing_bias(load)
    return stacked
