"""Argument checks and sequence bookkeeping shared by the KDA ops (flash-linear-attention's layout)."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from moe_plugin.ops.checks import check_cu_seqlens, check_same_dtype, check_tensor
from moe_plugin.ops.debug import debug_checks
from moe_plugin.ops.offsets import host_offsets


class KDADims(NamedTuple):
    seq_len: int
    heads: int
    key_dim: int
    value_dim: int
    scale: float


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
) -> KDADims:
    """Validate q, k ``[B,T,H,K]``, v ``[B,T,H,V]``, g ``[B,T,H,K]``, beta ``[B,T,H]``, initial_state ``[N,H,K,V]``.

    q, k, v and beta must share a dtype; g and the state may be wider (the gate is computed in fp32).
    """
    check_tensor("q", q, ndim=4, floating=True)
    B, T, H, K = q.shape
    check_tensor("k", k, shape=(B, T, H, K), floating=True)
    check_tensor("v", v, shape=(B, T, H, None), floating=True)
    check_tensor("g", g, shape=(B, T, H, K), floating=True)
    check_tensor("beta", beta, shape=(B, T, H), floating=True)
    check_same_dtype(q=q, k=k, v=v, beta=beta)
    check_cu_seqlens(cu_seqlens, B, T)
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(N, H, K, V), floating=True)
    if scale is None:
        scale = K**-0.5
    elif not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"scale: expected a positive number, got {scale!r}")
    return KDADims(T, H, K, V, float(scale))


def max_decay(g: torch.Tensor, gate_lower_bound: Optional[float]) -> Optional[float]:
    """The bound ``-gate_lower_bound`` on each position's log decay that ``gate_lower_bound`` promises for g
    (None: no bound). The promise fixes the form of the intra-chunk scores (``intra.factorised_block``); its
    values are checked only with ``MOE_PLUGIN_DEBUG_CHECKS=1``, since the check reads the device."""
    if gate_lower_bound is None:
        return None
    if isinstance(gate_lower_bound, bool) or not isinstance(gate_lower_bound, (int, float)) or gate_lower_bound > 0:
        raise ValueError(f"gate_lower_bound: expected a number <= 0 (a log decay) or None, got {gate_lower_bound!r}")
    if debug_checks() and g.numel() and not g.is_meta:
        low = float(g.min())
        if low < gate_lower_bound:
            raise ValueError(
                f"g: a log decay of {low} is below gate_lower_bound={gate_lower_bound}; pass the bound the gate "
                "really has (kda_gate_k3's lower_bound), or None for an unbounded gate"
            )
    return -float(gate_lower_bound)


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """At least fp32: the state accumulates over the whole sequence and bf16 rounding compounds."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def sequence_bounds(seq_len: int, cu_seqlens: Optional[torch.Tensor]) -> List[Tuple[int, int]]:
    """``[(start, end), ...]`` of the packed sequences, or one ``(0, T)`` covering each batch row (cu_seqlens
    read at most once per tensor, ``ops.offsets``)."""
    if cu_seqlens is None:
        return [(0, seq_len)]
    offsets = host_offsets(cu_seqlens)
    return list(zip(offsets[:-1], offsets[1:]))
