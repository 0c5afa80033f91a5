"""Chunked KDA: exact intra-chunk work as batched matmuls over all chunks, only the state passes sequentially.

Per chunk of C tokens (docs/architecture.md 2.1, G the in-chunk cumulative log decay):
    W = T (exp(G) K), U = T V with T = (I + L)^-1 diag(beta)  (a unit lower-triangular solve)
    V' = U - W S;  O = (Q exp(G)) S + A V';  S <- exp(G_last) S + (exp(G_last - G) K)^T V'
Substituting V' makes both the output and the next state affine in S:
    O = P S + A U with P = Q exp(G) - A W;   S <- M S + R with M = diag(exp(G_last)) - Kd^T W, R = Kd^T U,
so everything but the K x K by K x V product S <- M S + R runs batched over all chunks at once.

The decayed C x C scores come from ``intra.intra_chunk_scores``, which never forms exp(G_c - G_i) as
C x C x K for whole chunks (see there), so memory grows linearly with T and strong decay cannot overflow.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from moe_plugin.ops.backend import gpu_kernel
from moe_plugin.ops.kda.gate import l2norm
from moe_plugin.ops.kda.inputs import check_kda_inputs, compute_dtype, max_decay, sequence_bounds
from moe_plugin.ops.kda.intra import intra_chunk_scores, unit_lower_inverse


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    gate_lower_bound: Optional[float] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention in chunks; same arguments and results as ``naive_recurrent_kda``.

    Args:
        q, k: ``[B, T, H, K]`` (already L2-normalised); v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay
            (<= 0); beta: ``[B, T, H]``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of packed sequences with ``cu_seqlens``).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences in a batch of one; the state restarts at each.
        chunk_size: tokens per chunk on the torch path (a multiple of 16 keeps it fast); any T works.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (flash-linear-attention's flag of that name).
        gate_lower_bound: a promise that every g >= this (K3's bounded gate gives -5); None: unbounded. On the
            torch path it fixes how much of the intra-chunk scores is one matmul (``intra``), with no read of
            g; ``MOE_PLUGIN_DEBUG_CHECKS=1`` checks it.
    Returns:
        o ``[B, T, H, V]`` in v's dtype, and the final state ``[N, H, K, V]`` (fp32 or wider) or None.

    On CUDA, when flash-linear-attention imports, its Triton ``chunk_kda`` runs instead.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    dims = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    decay_bound = max_decay(g, gate_lower_bound)
    kernel = gpu_kernel("fla.ops.kda", "chunk_kda", q, k, v, g, beta, initial_state)
    if kernel is not None:
        return kernel(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=dims.scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)

    dtype = compute_dtype(q, g, initial_state)
    layout = ChunkLayout(dims.seq_len, chunk_size, cu_seqlens, q.device)
    qc, kc, vc, gc, bc = (layout.to_chunks(x.to(dtype)) for x in (q, k, v, g, beta))
    qc = qc * dims.scale  # after widening, so bf16 inputs are not rounded twice
    state_shape = (q.shape[0] if cu_seqlens is None else 1, dims.heads, dims.key_dim, dims.value_dim)
    if initial_state is None:
        starts = [qc.new_zeros(state_shape)] * len(layout.segments)
    elif cu_seqlens is None:
        starts = [initial_state.to(dtype)]
    else:
        starts = list(initial_state.to(dtype).split(1))
    o, finals = _chunk_forward(qc, kc, vc, gc, bc, layout.segments, starts, decay_bound)
    final = (finals[0] if cu_seqlens is None else torch.cat(finals)) if output_final_state else None
    return layout.from_chunks(o).to(v.dtype), final


class ChunkLayout:
    """Where tokens go in the padded, chunked layout ``[B, H, N, C, ...]``.

    Without cu_seqlens each batch row is one sequence, padded at its end. With cu_seqlens (batch 1) each
    packed sequence starts a fresh chunk, so the state resets on chunk boundaries only; ``segments`` lists
    each sequence's chunk range. Padding carries g = 0 and beta = 0 (and k = 0), so it leaves the state alone.
    """

    def __init__(self, seq_len: int, chunk: int, cu_seqlens: Optional[torch.Tensor], device: torch.device):
        self.seq_len, self.chunk = seq_len, chunk
        if cu_seqlens is None:
            self.index = None
            self.num_chunks = -(-seq_len // chunk)
            self.segments = [(0, self.num_chunks)]
            return
        pieces, self.segments, first = [], [], 0
        for start, end in sequence_bounds(seq_len, cu_seqlens):
            count = -(-(end - start) // chunk)
            pieces.append(torch.arange(end - start, device=device) + first * chunk)
            self.segments.append((first, first + count))
            first += count
        self.num_chunks = first
        self.index = torch.cat(pieces)  # padded position of every token

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, *rest]`` -> ``[B, H, N, C, *rest]``, zero-padded."""
        padded = (self.num_chunks * self.chunk,)
        if self.index is None:
            tail = x.new_zeros(x.shape[0], padded[0] - self.seq_len, *x.shape[2:])
            x = torch.cat([x, tail], dim=1)
        else:
            x = x.new_zeros(1, *padded, *x.shape[2:]).index_copy(1, self.index, x)
        return x.transpose(1, 2).unflatten(2, (self.num_chunks, self.chunk))

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, C, V]`` -> ``[B, T, H, V]``."""
        x = x.flatten(2, 3).transpose(1, 2)
        return x[:, : self.seq_len] if self.index is None else x.index_select(1, self.index)


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: List[Tuple[int, int]],
    starts: List[torch.Tensor],
    decay_bound: Optional[float],
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """q, k, g ``[B,H,N,C,K]`` (q scaled); v ``[B,H,N,C,V]``; beta ``[B,H,N,C]``; one start state
    ``[B,H,K,V]`` per segment of chunks; decay_bound as ``intra_chunk_scores``' max_decay. Returns o
    ``[B,H,N,C,V]`` and each segment's final state."""
    terms = chunk_terms(q, k, v, g, beta, decay_bound)
    entering, finals = [], []
    for (first, last), state in zip(segments, starts):
        states, final = scan_chunks(terms, first, last, state.flatten(0, 1))
        entering += states
        finals.append(final.view(state.shape))
    return terms.output(entering), finals


class ChunkTerms(NamedTuple):
    """Every chunk's output and next state as affine maps of the state S entering it (module docstring):
    O = P S + AU, S <- M S + R. P ``[B,H,N,C,K]``, AU ``[B,H,N,C,V]``; Ms, Rs: one ``[B*H, K, K]`` and
    ``[B*H, K, V]`` per chunk (unbound once: indexing M[:, :, n] per chunk would make backward zero-fill all
    of M per chunk)."""

    P: torch.Tensor
    AU: torch.Tensor
    Ms: Tuple[torch.Tensor, ...]
    Rs: Tuple[torch.Tensor, ...]

    def output(self, entering: List[torch.Tensor]) -> torch.Tensor:
        """o ``[B,H,N,C,V]`` from the ``[B*H, K, V]`` state entering each chunk, in chunk order."""
        S = torch.stack(entering, dim=1).view(*self.P.shape[:3], self.P.shape[-1], -1)
        return self.P @ S + self.AU


def chunk_terms(q, k, v, g, beta, decay_bound: Optional[float] = None) -> ChunkTerms:
    """The batched intra-chunk work of ``_chunk_forward`` (same shapes), everything but the state's passage."""
    K = k.shape[-1]
    # In fp64: exp(G_c - G_i) for nearby c, i needs the difference, which a long fp32 cumsum would blur.
    G = g.to(torch.float64).cumsum(-2)
    C = k.shape[-2]
    scores = intra_chunk_scores(
        torch.stack([q, k], dim=-3).view(-1, 2, C, K), k.reshape(-1, C, K), G.reshape(-1, C, K), decay_bound
    ).view(*k.shape[:-2], 2, C, C)
    scores_qk, scores_kk = scores[..., 0, :, :], scores[..., 1, :, :].tril(-1)
    decay_in = G.to(k.dtype).exp()
    rhs = beta.unsqueeze(-1) * torch.cat([k * decay_in, v], dim=-1)
    # [W | U] = (I + diag(beta) A_kk)^-1 diag(beta) [exp(G) K | V], kept side by side so that each product
    # below is one matmul.
    WU = unit_lower_inverse(beta.unsqueeze(-1) * scores_kk) @ rhs
    G_last = G[..., -1:, :]
    keys_out = (k * (G_last - G).to(k.dtype).exp()).transpose(-1, -2)  # [B,H,N,K,C]: keys decayed to chunk end
    A_WU, Kd_WU = scores_qk @ WU, keys_out @ WU
    P, AU = q * decay_in - A_WU[..., :K], A_WU[..., K:]
    M = torch.diag_embed(G_last.squeeze(-2).to(k.dtype).exp()) - Kd_WU[..., :K]
    R = Kd_WU[..., K:]
    return ChunkTerms(P, AU, M.flatten(0, 1).unbind(1), R.flatten(0, 1).unbind(1))


def scan_chunks(
    terms: ChunkTerms, first: int, last: int, state: torch.Tensor
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The state ``[B*H, K, V]`` passed through chunks ``first .. last-1``: the state entering each, and the last."""
    entering = []
    for n in range(first, last):
        entering.append(state)
        state = torch.baddbmm(terms.Rs[n], terms.Ms[n], state)
    return entering, state
