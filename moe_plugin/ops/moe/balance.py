"""Load balancing: the auxiliary-loss-free bias updates and DeepSeek-V3's sequence-wise auxiliary loss, per
row (``sequence_aux_loss``) or per packed document (``document_balance``, with its loop reference).

The bias updates return a new ``[E]`` bias for ``route``'s ``bias`` argument; a bias shifted by a constant
routes identically, so the quantile rule re-centres its result to mean 0.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..checks import check_cu_seqlens, check_ids_in_debug, check_tensor


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices: ``[..., k]`` chosen expert ids -> ``[E]`` int64 number of token copies each expert received."""
    check_tensor("indices", indices)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive integer, got {num_experts!r}")
    check_ids_in_debug("indices", indices, 0, num_experts, "expert ids")
    return torch.bincount(indices.reshape(-1).long(), minlength=num_experts)


def update_bias_sign(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's rule ``b_i + rate * sign(mean(load) - load_i)``: under-loaded experts become likelier.

    bias: ``[E]``; load: ``[E]`` token counts (any numeric dtype). Returns the new ``[E]`` bias in bias's dtype.
    """
    check_tensor("bias", bias, ndim=1, floating=True)
    check_tensor("load", load, shape=(bias.shape[0],))
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ValueError(f"rate: expected a non-negative number, got {rate!r}")
    load = load.float()
    return (bias.float() + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def quantile_balance_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """K3's quantile balancing: the bias under which each expert would take about ``m k / n`` tokens.

    scores: ``[m, E]`` unbiased sigmoid scores (``route``'s third output) of a batch of m tokens;
    bias: ``[E]`` the current selection bias. Returns the new ``[E]`` bias (bias's dtype), mean 0.

    Token t's cutoff ``a_t`` is its (k+1)-th largest biased score: with the cutoffs held fixed, expert i
    wins token t exactly when ``s_ti + b_i > a_t``, i.e. when the margin ``s_ti - a_t`` exceeds ``-b_i``.
    Setting ``b_i`` to minus the expert's (q+1)-th largest margin lets exactly its q best-margin tokens
    through. The quota ``q = floor(m k / n)`` is rounded down, so no expert is set up for more than its
    share; the at most n-1 copies this leaves over go to whichever experts the cutoffs favour.
    """
    check_tensor("scores", scores, ndim=2, floating=True)
    m, n = scores.shape
    check_tensor("bias", bias, shape=(n,), floating=True)
    if not isinstance(top_k, int) or not 1 <= top_k < n:
        raise ValueError(
            f"top_k: expected an integer in [1, num_experts - 1 = {n - 1}] "
            f"(the cutoff is the (k+1)-th score), got {top_k!r}"
        )
    if m < 1:
        raise ValueError("scores: expected at least one token (m >= 1), got 0 rows")
    s = scores.float()
    cutoff = torch.topk(s + bias.float(), top_k + 1, dim=-1).values[:, top_k]  # [m]
    margins = s - cutoff.unsqueeze(1)
    quota = (m * top_k) // n
    # The (q+1)-th largest of m values is the (m-q)-th smallest.
    threshold = torch.kthvalue(margins, m - quota, dim=0).values
    new_bias = -threshold
    return (new_bias - new_bias.mean()).to(bias.dtype)


def sequence_aux_loss(scores: torch.Tensor, indices: torch.Tensor, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

    scores: ``[B, T, E]`` unbiased sigmoid scores; indices: ``[B, T, k]`` chosen experts. Per sequence,
    ``f_i = E / (k T) * count_i`` and ``P_i = mean_t s_ti / sum_j s_tj``; the loss is
    ``alpha * sum_i f_i P_i`` (a scalar), differentiable through the scores only.
    """
    check_tensor("scores", scores, ndim=3, floating=True)
    b, t, e = scores.shape
    check_tensor("indices", indices, shape=(b, t, None))
    check_ids_in_debug("indices", indices, 0, e, "expert ids")
    k = indices.shape[2]
    counts = torch.zeros(b, e, device=scores.device, dtype=torch.float32)
    counts.scatter_add_(1, indices.reshape(b, -1).long(), torch.ones(b, t * k, device=scores.device))
    f = counts * (e / (k * t))
    s = scores.float()
    p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
    return alpha * (f * p).sum(-1).mean()


# ----------------------------------------------------------------------------- per document (packed rows)
#
# With packed rows a "sequence" of DeepSeek-V3's loss is a document: the statistics f and P are taken per
# document (cu_seqlens), never across a boundary, so they do not depend on how documents are packed into rows,
# micro-batches or ranks. Each document's term is weighted by the tokens the language-model loss scores in it
# (``document_weights``): a padding segment or a document with no label weighs nothing, and the weights divided
# by the step's label-token count make the term a sum over the step's documents that every layout computes alike.


def document_ids(
    cu_seqlens: Optional[torch.Tensor], batch: int, length: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """The ``[batch * length]`` int64 document index of every token, in row-major order: the documents of a
    packed row (``cu_seqlens`` ``[D + 1]``, batch 1), or one document per row without it."""
    if cu_seqlens is None:
        return torch.arange(batch, device=device).repeat_interleave(length)
    check_cu_seqlens(cu_seqlens, batch, length)
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:].long(), right=True).to(device or cu_seqlens.device)


def document_weights(
    labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, num_items: Optional[float] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """labels ``[B, T]`` (unshifted, -100 = not scored, as ``causal_lm_loss`` takes them); cu_seqlens ``[D + 1]``
    (batch 1) or None (one document per row) -> (``doc_ids [B * T]`` int64, ``weights [D]`` fp32).

    A document's weight is the number of its positions ``causal_lm_loss`` scores (a label other than -100 that
    is not the document's first token), divided by ``num_items`` (the step's label-token count over the
    engine's averaging factors) or, without it, by this batch's scored count, as the token loss is averaged.
    """
    check_tensor("labels", labels, ndim=2)
    b, t = labels.shape
    doc = document_ids(cu_seqlens, b, t, labels.device)
    first = torch.ones(b * t, dtype=torch.bool, device=labels.device)
    first[1:] = doc[1:] != doc[:-1]
    scored = (labels.reshape(-1) != -100) & ~first
    num_docs = int(cu_seqlens.numel()) - 1 if cu_seqlens is not None else b
    counts = torch.zeros(num_docs, dtype=torch.float32, device=labels.device).index_add_(0, doc, scored.float())
    if num_items is None:  # on the device: no host read
        total = counts.sum()
        return doc, counts / torch.where(total > 0, total, torch.ones_like(total))
    total = float(num_items)
    return doc, counts / (total if total > 0 else 1.0)


def document_balance(
    scores: torch.Tensor,
    indices: torch.Tensor,
    doc_ids: torch.Tensor,
    num_docs: int,
    combine: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance ``sum_i f_i P_i`` of every document (no coefficient).

    scores: ``[N, E]`` unbiased sigmoid scores (``route``'s third output); indices: ``[N, k]`` chosen experts
    (chosen on the biased scores); doc_ids: ``[N]`` int64 document of each token, -1 for a token that does not
    count (padding). For document d with ``T_d`` counted tokens: ``f_i = E / (k T_d) * count_i`` and
    ``P_i = mean_t s_ti / sum_j s_tj``. Returns ``[num_docs]`` fp32, 1 for a document whose experts are evenly
    used, 0 for an empty one; differentiable through the scores only. ``document_balance_reference`` is the
    same by a loop over documents.

    combine: under context parallelism a document's tokens lie on several ranks; ``combine`` sums a
    ``[num_docs, 2E + 1]`` tensor of per-document statistics (token count, expert counts, probability sums)
    over them, differentiably (``ContextSlice.gather(x).sum(0)``), so every rank gets the whole documents'
    terms.
    """
    check_tensor("scores", scores, ndim=2, floating=True)
    n, e = scores.shape
    check_tensor("indices", indices, shape=(n, None))
    check_tensor("doc_ids", doc_ids, shape=(n,))
    if not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs: expected a non-negative integer, got {num_docs!r}")
    check_ids_in_debug("doc_ids", doc_ids, -1, num_docs, "document ids (-1: not counted)")
    check_ids_in_debug("indices", indices, 0, e, "expert ids")
    k = indices.shape[1]
    # Tokens that do not count (doc -1) are added into document 0 with weight 0 rather than dropped by a
    # boolean index (a data-dependent shape: a host read); with num_docs 0 nothing counts and nothing is added.
    keep = (doc_ids >= 0).float()
    s, idx, doc = scores.float(), indices.long(), doc_ids.long().clamp_min(0)
    if num_docs == 0:
        keep, idx, doc = keep[:0], idx[:0], doc[:0]
        s = s[:0]
    tokens = torch.zeros(num_docs, device=s.device).index_add_(0, doc, keep)
    counts = torch.zeros(num_docs * e, device=s.device)
    counts.index_add_(0, (doc.unsqueeze(1) * e + idx).reshape(-1), keep.unsqueeze(1).expand(-1, k).reshape(-1))
    share = s / s.sum(-1, keepdim=True).clamp_min(1e-30)  # the row's probabilities (a saturated row stays finite)
    p = torch.zeros(num_docs, e, device=s.device).index_add(0, doc, share * keep.unsqueeze(1))
    if combine is not None:
        stats = combine(torch.cat([tokens.unsqueeze(1), counts.view(num_docs, e), p], dim=1))
        tokens, counts, p = stats[:, 0], stats[:, 1 : e + 1].reshape(-1), stats[:, e + 1 :]
    per_token = tokens.clamp_min(1.0).unsqueeze(1)
    f = counts.view(num_docs, e) * (e / k) / per_token
    return (f * (p / per_token)).sum(-1)


def document_balance_reference(
    scores: torch.Tensor, indices: torch.Tensor, doc_ids: torch.Tensor, num_docs: int
) -> torch.Tensor:
    """``document_balance`` by a loop: ``sequence_aux_loss`` (alpha 1) on each document's counted tokens."""
    out = []
    for d in range(num_docs):
        mine = doc_ids == d
        if not bool(mine.any()):
            out.append(scores.new_zeros((), dtype=torch.float32))
            continue
        out.append(sequence_aux_loss(scores[mine].unsqueeze(0), indices[mine].unsqueeze(0), 1.0))
    return torch.stack(out) if out else scores.new_zeros(0, dtype=torch.float32)
