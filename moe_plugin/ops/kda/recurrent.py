"""Token-by-token KDA: the plain reference for the chunked form, and the O(1) decoding step."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_plugin.ops.kda.gate import l2norm
from moe_plugin.ops.kda.inputs import check_kda_inputs, compute_dtype, sequence_bounds


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention one token at a time (docs/architecture.md 2.1); q and k arrive L2-normalised.

    Per head, with state S ``[K, V]``: S <- exp(g_t) * S (row-wise); S <- S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = S^T (scale q_t).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay (<= 0); beta: ``[B, T, H]``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of packed sequences with ``cu_seqlens``).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences in a batch of one; the state restarts at each.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (flash-linear-attention's flag of that name).
    Returns:
        o ``[B, T, H, V]`` in v's dtype, and the final state ``[N, H, K, V]`` (fp32 or wider) or None.
    """
    dims = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    dtype, out_dtype = compute_dtype(q, g, initial_state), v.dtype  # v is rebound to the compute dtype below
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * dims.scale
    outputs, finals = [], []
    for seq, (start, end) in enumerate(sequence_bounds(dims.seq_len, cu_seqlens)):
        rows = slice(None) if cu_seqlens is None else slice(seq, seq + 1)
        if initial_state is None:
            state = q.new_zeros(q.shape[0], dims.heads, dims.key_dim, dims.value_dim)
        else:
            state = initial_state[rows].to(dtype)
        for t in range(start, end):
            state = _step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        finals.append(state)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    final = (finals[0] if cu_seqlens is None else torch.cat(finals)) if output_final_state else None
    return o.to(out_dtype), final


def _step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token. state ``[b,H,K,V]``; q, k, g ``[b,H,K]``; v ``[b,H,V]``; beta ``[b,H]`` -> new state."""
    state = state * g.exp().unsqueeze(-1)
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    return state + torch.einsum("bhk,bhv->bhkv", beta.unsqueeze(-1) * k, v - recalled)
