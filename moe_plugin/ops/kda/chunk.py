"""Chunked KDA: exact intra-chunk work as batched matmuls over all chunks, only the state passes sequentially.

Per chunk of C tokens (docs/architecture.md 2.1, G the in-chunk cumulative log decay):
    W = T (exp(G) K), U = T V with T = (I + L)^-1 diag(beta)  (a unit lower-triangular solve)
    V' = U - W S;  O = (Q exp(G)) S + A V';  S <- exp(G_last) S + (exp(G_last - G) K)^T V'
Substituting V' makes both the output and the next state affine in S:
    O = P S + A U with P = Q exp(G) - A W;   S <- M S + R with M = diag(exp(G_last)) - Kd^T W, R = Kd^T U,
so everything but the K x K by K x V product S <- M S + R runs batched over all chunks at once.

The decayed C x C scores come from ``intra.intra_chunk_scores``, which never forms exp(G_c - G_i) as
C x C x K for whole chunks (see there), so strong decay cannot overflow.

Memory (``run_chunks``): the chunks run in windows of ``WINDOW_CHUNKS``. The forward keeps for backward only its
inputs (chunked, in the compute dtype) and the ``[B*H, K, V]`` state entering each window; the chunk terms (P and
AU, every chunk's M and R, the fp64 cumulative decay, the intra-chunk scores and inverse, the state entering
each chunk) live for one window at a time. Backward recomputes them one window at a time, last window first,
under autograd, and hands the gradient of the state entering a window to the one before: one more forward of
the terms for a bounded set (the inputs plus ``K V / (WINDOW_CHUNKS C)`` values a token and head, against about
``4 C + 3 K`` a token and head for the whole row's terms, plus one window's working set).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from moe_plugin.ops.backend import gpu_kernel
from moe_plugin.ops.meta_loops import steps_to_run
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
    segments = tuple(layout.segments)
    if initial_state is None:
        start, start_index = None, (-1,) * len(segments)
    else:  # [segments, B*H / segments, K, V]: with cu_seqlens one [1*H] state a sequence, else one of B*H
        start = initial_state.to(dtype).reshape(len(segments), -1, dims.key_dim, dims.value_dim)
        start_index = tuple(range(len(segments)))
    run = ChunkRun(segments, start_index, dims.value_dim, True, output_final_state, decay_bound)
    o, finals = run_chunks(run, qc, kc, vc, gc, bc, start)
    final = finals.reshape(-1, dims.heads, dims.key_dim, dims.value_dim) if output_final_state else None
    return layout.from_chunks(o, dims.heads).to(v.dtype), final


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
        """``[B, T, H, *rest]`` -> ``[N, B*H, C, *rest]``, zero-padded: chunk-major, so that a run of chunks
        (a window, ``run_chunks``) is one contiguous block."""
        padded = (self.num_chunks * self.chunk,)
        B, _, H, *rest = x.shape
        if self.index is None:
            tail = x.new_zeros(B, padded[0] - self.seq_len, H, *rest)
            x = torch.cat([x, tail], dim=1)
        else:
            x = x.new_zeros(1, *padded, H, *rest).index_copy(1, self.index, x)
        x = x.view(B, self.num_chunks, self.chunk, H, *rest).transpose(2, 3).transpose(0, 1)
        return x.reshape(self.num_chunks, B * H, self.chunk, *rest)

    def from_chunks(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[N, B*H, C, V]`` -> ``[B, T, H, V]``."""
        N, BH, C, V = x.shape
        x = x.view(N, BH // heads, heads, C, V).permute(1, 0, 3, 2, 4).reshape(BH // heads, N * C, heads, V)
        return x[:, : self.seq_len] if self.index is None else x.index_select(1, self.index)


class ChunkRun(NamedTuple):
    """What ``run_chunks`` computes over a run of chunks (fixed before any data is seen).

    segments: the chunk ranges of the run's sequences, in order, covering it; the state restarts at each.
    start_index: per segment, which of ``start``'s states it begins from (-1: a zero state).
    width: the state's columns X: V, or V + K to carry the run's transition ``[S | Phi]`` beside the state
        (Phi starts as I and passes through each chunk's M alone, so ``Phi`` leaving a run is its A).
    output: whether o is wanted; finals: whether each segment's leaving state is.
    """

    segments: Tuple[Tuple[int, int], ...]
    start_index: Tuple[int, ...]
    width: int
    output: bool
    finals: bool
    decay_bound: Optional[float]


def run_chunks(
    run: ChunkRun,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """KDA over a run of chunks, window by window, holding only each window's entering state for backward.

    Args:
        q, k, g ``[N, B*H, C, K]`` (q scaled); v ``[N, B*H, C, V]``; beta ``[N, B*H, C]``: the chunked layout.
        start: ``[S, B*H, K, X]`` the states segments begin from (``run.start_index``), or None.
    Returns:
        o ``[N, B*H, C, V]`` (None unless ``run.output``) and the states ``[len(segments), B*H, K, X]`` leaving
        each segment (None unless ``run.finals``).

    The forward keeps its inputs and the ``[B*H, K, X]`` state entering each window of ``WINDOW_CHUNKS``
    chunks; backward recomputes one window's chunk terms at a time, last window first, and hands the
    gradient of the state entering it to the window before. So the chunk terms (P, AU, M, R, the fp64 decay
    sums, the intra-chunk scores) of one window are alive at a time, in forward and in backward.
    """
    if torch.compiler.is_compiling():
        # dynamo traces autograd, not a Function whose backward calls it: one graph, the whole run's terms held
        o, finals = _whole_run(run, q, k, v, g, beta, start)
    else:
        o, finals = _WindowedChunks.apply(run, start, q, k, v, g, beta)
    return (o if run.output else None), (finals if run.finals else None)


def _whole_run(run: ChunkRun, q, k, v, g, beta, start):
    """``run_chunks`` as one window under autograd (every chunk's terms saved for backward)."""
    N, BH, _, K = k.shape
    o, ends, _ = _run_window(run, (0, N), q, k, v, g, beta, k.new_zeros(BH, K, run.width), start)
    if not run.finals:
        return o, None
    leaving = dict(ends)
    for segment in _empty(run):
        index = run.start_index[segment]
        leaving[segment] = start[index] if index >= 0 else k.new_zeros(BH, K, run.width)
    return o, torch.stack([leaving[i] for i in range(len(run.segments))])


# Chunks a window: its terms are what the op holds beyond its inputs. At 64-token chunks a window is 1024 tokens,
# so the planner's runs (4096 and 8192 tokens, docs/planner.md) hold whole windows and extend linearly.
WINDOW_CHUNKS = 16


def _windows(num_chunks: int) -> List[Tuple[int, int]]:
    return [(a, min(a + WINDOW_CHUNKS, num_chunks)) for a in range(0, num_chunks, WINDOW_CHUNKS)]


def _window_kind(run: ChunkRun, window: Tuple[int, int]):
    """What fixes a window's allocations: its length and where segments begin (from a given or a zero state)
    and end inside it. Windows of one kind make the same tensors (``meta_loops``)."""
    a, b = window
    begins = tuple(
        (first - a, run.start_index[i] >= 0)
        for i, (first, last) in enumerate(run.segments)
        if a <= first < min(b, last)
    )
    ends = tuple(last - 1 - a for first, last in run.segments if a < last <= b and last > first)
    return b - a, begins, ends


def _run_window(run: ChunkRun, window, q, k, v, g, beta, state, start):
    """One window's chunks (the inputs sliced to it) from ``state`` ``[B*H, K, X]`` entering it: its o
    ``[w, B*H, C, V]`` (or None), ``[(segment, leaving state)]`` for the segments ending in it, and the state
    leaving it."""
    a, b = window
    terms = chunk_terms(q, k, v, g, beta, run.decay_bound, output=run.output)
    value_dim = v.shape[-1]
    begins = {first: i for i, (first, last) in enumerate(run.segments) if last > first}
    ends = {last - 1: i for i, (first, last) in enumerate(run.segments) if last > first}
    entering, finals = [], []
    for n in range(a, b):
        if n in begins:
            index = run.start_index[begins[n]]
            state = start[index] if index >= 0 else torch.zeros_like(state)
        entering.append(state)
        R = terms.Rs[n - a]
        if run.width > value_dim:  # the transition's columns take M alone
            R = torch.nn.functional.pad(R, (0, run.width - value_dim))
        state = torch.baddbmm(R, terms.Ms[n - a], state)
        if n in ends:
            finals.append((ends[n], state))
    o = terms.output([s[..., :value_dim] for s in entering]) if run.output else None
    return o, finals, state


class _WindowedChunks(torch.autograd.Function):
    """``run_chunks``: forward without a graph; backward recomputes each window under autograd, last first."""

    @staticmethod
    def forward(ctx, run: ChunkRun, start, q, k, v, g, beta):
        ctx.set_materialize_grads(False)
        N, BH, C, K = k.shape
        windows = _windows(N)
        meta = k.is_meta
        entering = k.new_empty(len(windows), BH, K, run.width)
        o = v.new_empty(N, BH, C, v.shape[-1]) if run.output else v.new_empty(0)
        finals = k.new_empty(len(run.segments), BH, K, run.width) if run.finals else k.new_empty(0)
        state = k.new_zeros(BH, K, run.width)  # chunk 0 begins a segment: replaced there
        for i in _steps(run, windows, meta):
            a, b = windows[i]
            entering[i].copy_(state)
            parts = (x[a:b] for x in (q, k, v, g, beta))
            o_w, ends, state = _run_window(run, windows[i], *parts, state, start)
            if run.output:
                o[a:b] = o_w
            for segment, leaving in ends:
                if run.finals:
                    finals[segment] = leaving
        for segment in _empty(run):  # a sequence of no tokens leaves the state it begins from
            index = run.start_index[segment]
            finals[segment] = start[index] if index >= 0 else 0
        ctx.run = run
        ctx.save_for_backward(start, q, k, v, g, beta, entering)
        if not run.output:
            ctx.mark_non_differentiable(o)
        if not run.finals:
            ctx.mark_non_differentiable(finals)
        return o, finals

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o, grad_finals):
        run = ctx.run
        start, *inputs, entering = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2:]
        grads = [torch.empty_like(x) if want else None for x, want in zip(inputs, wanted)]
        grad_start = torch.zeros_like(start) if start is not None and ctx.needs_input_grad[1] else None
        windows = _windows(inputs[0].shape[0])
        if run.finals and grad_finals is not None and grad_start is not None:
            for segment in _empty(run):
                if run.start_index[segment] >= 0:
                    grad_start[run.start_index[segment]] += grad_finals[segment]
        carry = None  # the gradient of the state leaving the window in hand
        for i in reversed(_steps(run, windows, inputs[0].is_meta)):
            a, b = windows[i]
            with torch.enable_grad():
                parts = [x[a:b].detach().requires_grad_(want) for x, want in zip(inputs, wanted)]
                state = entering[i].detach().requires_grad_()
                own_start = start.detach().requires_grad_(grad_start is not None) if start is not None else None
                o_w, ends, leaving = _run_window(run, windows[i], *parts, state, own_start)
            outputs, out_grads = [], []
            if run.output and grad_o is not None:
                outputs.append(o_w)
                out_grads.append(grad_o[a:b])
            if run.finals and grad_finals is not None:
                for segment, s in ends:
                    outputs.append(s)
                    out_grads.append(grad_finals[segment])
            if carry is not None:
                outputs.append(leaving)
                out_grads.append(carry)
            sources = [x for x in parts if x.requires_grad] + [state] + ([own_start] if grad_start is not None else [])
            got = iter(
                torch.autograd.grad(outputs, sources, out_grads, allow_unused=True)
                if outputs
                else [None] * len(sources)
            )
            for grad, want in zip(grads, wanted):
                if want:
                    part = next(got)
                    if part is None:  # q, when no output is wanted
                        grad[a:b].zero_()
                    else:
                        grad[a:b] = part
            carry = next(got)
            if grad_start is not None:
                part = next(got)
                if part is not None:
                    grad_start += part
        return (None, grad_start, *grads)


def _empty(run: ChunkRun) -> List[int]:
    """The segments of no chunks (sequences of no tokens)."""
    return [i for i, (first, last) in enumerate(run.segments) if last == first] if run.finals else []


def _steps(run: ChunkRun, windows: List[Tuple[int, int]], meta: bool) -> List[int]:
    return steps_to_run(range(len(windows)), meta, kind=lambda i: _window_kind(run, windows[i]), size=lambda i: 0)


class ChunkTerms(NamedTuple):
    """Every chunk's output and next state as affine maps of the state S entering it (module docstring):
    O = P S + AU, S <- M S + R. P ``[N, B*H, C, K]``, AU ``[N, B*H, C, V]`` (None when no output is wanted);
    Ms, Rs: one ``[B*H, K, K]`` and ``[B*H, K, V]`` per chunk (unbound once: indexing M[n] per chunk would make
    backward zero-fill all of M per chunk)."""

    P: Optional[torch.Tensor]
    AU: Optional[torch.Tensor]
    Ms: Tuple[torch.Tensor, ...]
    Rs: Tuple[torch.Tensor, ...]

    def output(self, entering: List[torch.Tensor]) -> torch.Tensor:
        """o ``[N, B*H, C, V]`` from the ``[B*H, K, V]`` state entering each chunk, in chunk order."""
        return torch.baddbmm(self.AU.flatten(0, 1), self.P.flatten(0, 1), torch.stack(entering).flatten(0, 1)).view_as(
            self.AU
        )


def chunk_terms(q, k, v, g, beta, decay_bound: Optional[float] = None, output: bool = True) -> ChunkTerms:
    """The batched intra-chunk work of ``run_chunks`` (same shapes), everything but the state's passage.
    ``output`` False: only M and R (the queries' scores are not formed)."""
    K = k.shape[-1]
    # In fp64: exp(G_c - G_i) for nearby c, i needs the difference, which a long fp32 cumsum would blur.
    G = g.to(torch.float64).cumsum(-2)
    C = k.shape[-2]
    rows = torch.stack([q, k], dim=-3) if output else k.unsqueeze(-3)
    scores = intra_chunk_scores(
        rows.reshape(-1, rows.shape[-3], C, K), k.reshape(-1, C, K), G.reshape(-1, C, K), decay_bound
    )
    scores = scores.view(*k.shape[:-2], rows.shape[-3], C, C)
    scores_kk = scores[..., -1, :, :].tril(-1)
    decay_in = G.to(k.dtype).exp()
    rhs = beta.unsqueeze(-1) * torch.cat([k * decay_in, v], dim=-1)
    # [W | U] = (I + diag(beta) A_kk)^-1 diag(beta) [exp(G) K | V], kept side by side so that each product
    # below is one matmul.
    WU = unit_lower_inverse(beta.unsqueeze(-1) * scores_kk) @ rhs
    G_last = G[..., -1:, :]
    keys_out = (k * (G_last - G).to(k.dtype).exp()).transpose(-1, -2)  # [B,H,N,K,C]: keys decayed to chunk end
    Kd_WU = keys_out @ WU
    M = torch.diag_embed(G_last.squeeze(-2).to(k.dtype).exp()) - Kd_WU[..., :K]
    R = Kd_WU[..., K:]
    P = AU = None
    if output:
        A_WU = scores[..., 0, :, :] @ WU
        P, AU = q * decay_in - A_WU[..., :K], A_WU[..., K:]
    return ChunkTerms(P, AU, M.unbind(0), R.unbind(0))
