"""Gated multi-head latent attention with DeepSeek-V3.2's lightning indexer (Gated DSA, docs/architecture.md 2.2).

Module names are K3's / DeepSeek's (docs/architecture.md 7) so that checkpoints map one to one. There is no rotary
embedding: the 64 "rope" channels of the query and of the shared key are used as they are (K3 has no positions
outside KDA). With ``config.use_indexer`` each query attends only to the ``config.index_topk`` keys its
indexer scores highest; the indexer sees detached inputs and learns only from its KL loss.

Context parallelism (``forward(..., context=ContextSlice)``): each rank holds one contiguous slice of a packed
row. Without an indexer, when the heads divide over the context ranks, attention is head-parallel: each rank
expands its own slice's keys and values, one all-to-all gives it the whole row of ``H / CP`` heads (queries,
keys, values), it attends there as one process does, and one all-to-all brings every head's output of its
slice back. A rank then holds ``T / CP`` tokens' worth of every tensor and does ``1 / CP`` of the row's
attention, whichever slice it holds. Otherwise queries stay local and the only exchange is one all-gather of
the compressed latent (``c_kv`` and ``k_rope``, the ``kv_a_proj_with_mqa`` output) together with the indexer's
keys, so every rank sees every key up to the end of its slice (later keys are causally invisible and dropped).
The keys and values are expanded from that latent one chunk of keys at a time inside the attention's loop
(``ops.dsa.latent_attention``, forward and backward), so no rank holds the whole row's expanded keys and values.
Attention, the top-k selection and the indexer loss see exactly the keys they would on one process either way
(docs/context-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..compat.deepspeed import tiled_gradients
from ..config import MLAConfig
from ..ops.checks import check_tensor
from ..ops.context import ContextSlice
from ..ops.offsets import offsets_tensor
from ..ops.dsa import (
    attention_target,
    dense_causal_attention,
    indexer_kl_loss,
    indexer_scores,
    indexer_topk,
    sparse_attention,
)
from ..ops.dsa.latent_attention import (
    DEFAULT_BLOCK,
    DEFAULT_KEY_CHUNK,
    causal_plan,
    latent_attention,
    latent_attention_target,
    selection_plan,
)
from .attention_inputs import AttentionInputs, layer_inputs
from .norm import RMSNorm

INIT_STD = 0.02
INDEXER_KEY_NORM_EPS = 1e-6  # DeepSeek-V3.2's fixed LayerNorm eps on the index keys


@dataclass
class MLACache:
    """Decoding state of one gated MLA layer; every field ``None`` while empty, the layer appends in place.

    c_kv: ``[B, S, kv_lora_rank]`` compressed key/value latent before ``kv_a_layernorm``;
    k_rope: ``[B, S, qk_rope_head_dim]`` the key part shared by all heads;
    index_keys: ``[B, S, index_head_dim]`` the indexer's keys (only with the indexer on);
    key_mask: ``[B, S]`` bool, False at padded positions (set once a call passes a ``token_mask``).
    """

    c_kv: Optional[torch.Tensor] = None
    k_rope: Optional[torch.Tensor] = None
    index_keys: Optional[torch.Tensor] = None
    key_mask: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]


def _append(old: Optional[torch.Tensor], new: torch.Tensor, name: str) -> torch.Tensor:
    if old is None:
        return new
    if old.shape[0] != new.shape[0]:
        raise ValueError(f"cache.{name}: holds batch {old.shape[0]}, the input has batch {new.shape[0]}")
    return torch.cat([old, new], dim=1)


def _key_mask(
    cache: Optional[MLACache], token_mask: Optional[torch.Tensor], offset: int, B: int, T: int, device
) -> Optional[torch.Tensor]:
    """The ``[B, offset + T]`` mask of all keys (cached ones first), or None when every key is real; kept in
    ``cache.key_mask`` so that padded prompt keys stay hidden in every later decoding step."""
    old = cache.key_mask if cache is not None else None
    if token_mask is None and old is None:
        return None
    if token_mask is None:
        token_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    if old is None and offset:
        old = torch.ones(B, offset, dtype=torch.bool, device=device)
    mask = token_mask if old is None else _append(old, token_mask, "key_mask")
    if cache is not None:
        cache.key_mask = mask
    return mask


def _context_cu_seqlens(context: ContextSlice, device, end: Optional[int] = None) -> Optional[torch.Tensor]:
    """The row's document boundaries over the keys ``0 .. end`` (``context.end`` when None; those past it
    dropped), or None when the row is one document (causality alone then decides)."""
    if len(context.offsets) == 2:
        return None
    end = context.end if end is None else end
    kept = [o for o in context.offsets if o < end] + [end]
    return offsets_tensor(kept, device)


def heads_parallel(num_heads: int, has_indexer: bool, context: Optional[ContextSlice]) -> bool:
    """Whether a gated MLA layer attends head-parallel under ``context``: no indexer (its top-k and loss need
    every head's index scores of a query in one place) and the heads divide over the context ranks."""
    return context is not None and context.size > 1 and not has_indexer and num_heads % context.size == 0


def _gather_keys(
    context: ContextSlice, latent: torch.Tensor, index_keys: Optional[torch.Tensor], end: int
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's ``latent`` ``[B, L, C]`` (and ``index_keys`` ``[B, L, D_I]``) joined into the row's keys
    ``0 .. end``, in one all-gather when their dtypes agree."""
    if index_keys is None:
        return context.gather_sequence(latent, dim=1)[:, :end], None
    if index_keys.dtype != latent.dtype:
        return context.gather_sequence(latent, dim=1)[:, :end], context.gather_sequence(index_keys, dim=1)[:, :end]
    both = context.gather_sequence(torch.cat([latent, index_keys], dim=-1), dim=1)[:, :end]
    return both.split([latent.shape[-1], index_keys.shape[-1]], dim=-1)


def _to_balanced(context: ContextSlice, *parts: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """``ContextSlice.to_balanced`` of each of ``parts`` ``[B, L, ...]`` (None stays None), in one all-to-all when
    their dtypes agree."""
    given = [p for p in parts if p is not None]
    if len({p.dtype for p in given}) > 1:
        return tuple(None if p is None else context.to_balanced(p) for p in parts)
    B, L = given[0].shape[:2]
    joined = context.to_balanced(torch.cat([p.reshape(B, L, -1) for p in given], dim=-1))
    pieces = iter(joined.split([p[0, 0].numel() for p in given], dim=-1))
    return tuple(None if p is None else next(pieces).reshape(p.shape) for p in parts)


def _by_runs(runs, fn) -> torch.Tensor:
    """``fn(t0, t1, position of t0)`` of each run of queries (``ops.dsa.latent_attention.QueryRuns``), joined
    along the queries (dim 1); a single run's result as it is."""
    if len(runs) == 1:
        return fn(*runs[0])
    return torch.cat([fn(t0, t1, pos) for t0, t1, pos in runs], dim=1)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's indexer projections: index queries from the q latent, one index key per token, head weights."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        # V3.2 folds the dot-product scale D_I^-0.5 and the head-average H_I^-0.5 into the head weights
        # (ReLU commutes with a positive scale).
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def forward(
        self, hidden_states: torch.Tensor, q_latent: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states ``[B, T, D]``, q_latent ``[B, T, q_lora_rank]`` (normed) -> q_index ``[B, T, H_I, D_I]``,
        k_index ``[B, T, D_I]``, weights ``[B, T, H_I]``."""
        B, T, _ = hidden_states.shape
        q_index = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        k_index = self.k_norm(self.wk(hidden_states))
        weights = self.weights_proj(hidden_states) * self.weight_scale
        return q_index, k_index, weights


class GatedMLAAttention(nn.Module):
    """Gated MLA; sparse (top-k by the lightning indexer) when ``config.use_indexer``.

    Set ``indexer_warmup = True`` for the warm-up phase: attention stays dense while the indexer trains
    on the KL to the full attention; afterwards (the default) attention is sparse and the KL covers only
    the selected keys.

    ``context_block_size`` and ``context_key_chunk``: the query block and the keys expanded at a time of the
    gathered context path (``ops.dsa.latent_attention``).
    """

    context_block_size = DEFAULT_BLOCK
    context_key_chunk = DEFAULT_KEY_CHUNK

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.config = config
        c = config
        self.num_heads = c.num_heads
        self.scale = c.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.g_proj = nn.Linear(c.hidden_size, c.num_heads * c.v_head_dim, bias=False) if c.output_gate else None
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.indexer = LightningIndexer(c) if c.use_indexer else None
        self.indexer_warmup = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[MLACache] = None,
        return_indexer_loss: bool = False,
        token_mask: Optional[torch.Tensor] = None,
        context: Optional[ContextSlice] = None,
        inputs: Optional[AttentionInputs] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """hidden_states ``[B, T, D]`` -> ``[B, T, D]``, or ``(out, indexer_loss)`` if ``return_indexer_loss``.

        cu_seqlens: ``[N+1]`` packed-sequence boundaries (batch 1, no cache). cache: appended to in place;
        the new tokens sit after the cached ones. token_mask: ``[B, T]`` bool, False = padding: such keys are
        never attended or selected, now or (through ``cache.key_mask``) later; a query with no real key
        before it (a pad of a left-padded row) gets zeros. There are no positions, so left padding changes
        nothing else for the real tokens. indexer_loss: scalar KL (``ops.dsa.indexer_kl_loss``) whose
        gradient reaches only the indexer; ``None`` without an indexer.

        context: this rank's ``ContextSlice`` under context parallelism; hidden_states is then the rank's slice
        ``[B, context.length, D]`` of the row (B 1 when it packs several documents) and cu_seqlens, cache and
        token_mask must be None (the documents come from ``context.offsets``). The output is the slice's part
        of the whole row's output. indexer_loss is then the mean over this rank's queries; the slices being
        equal, the mean of it over the context ranks is the whole row's loss, so the caller averages it over
        them (the trainer's gradient averaging over the context group does).
        inputs: the forward's ``AttentionInputs`` (``layers.attention_inputs``), in place of cu_seqlens,
        token_mask and context.
        """
        c = self.config
        check_tensor("hidden_states", hidden_states, shape=(None, None, c.hidden_size), floating=True)
        inputs = layer_inputs(
            inputs, hidden_states, cache, cu_seqlens=cu_seqlens, token_mask=token_mask, context=context
        )
        cu_seqlens, token_mask, context = inputs.cu_seqlens, inputs.token_mask, inputs.context
        B, T, _ = hidden_states.shape
        x = hidden_states

        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(B, T, self.num_heads, c.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x)
        index_inputs = None
        if self.indexer is not None:
            index_inputs = self.indexer(x.detach(), q_latent.detach())
        by_heads = heads_parallel(self.num_heads, self.indexer is not None, context)
        if context is not None and not by_heads:
            o, index_loss = self._attend_gathered(q, latent, index_inputs, context, return_indexer_loss)
            return self._output(o, x, index_loss, return_indexer_loss)
        offset = 0
        c_kv, k_rope = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        if cache is not None:
            offset = cache.length
            cache.c_kv = c_kv = _append(cache.c_kv, c_kv, "c_kv")
            cache.k_rope = k_rope = _append(cache.k_rope, k_rope, "k_rope")
        key_mask = _key_mask(cache, token_mask, offset, B, T, x.device)
        if by_heads:  # no indexer; the key's two parts apart, in the exchange's layout
            o = self._attend_by_heads(q, *self._expand_parts(c_kv, k_rope), context)
            return self._output(o, x, None, return_indexer_loss)
        k_nope, k_rope, v = self._expand_parts(c_kv, k_rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        indices = None
        if index_inputs is not None:
            q_index, k_index, weights = index_inputs
            if cache is not None:
                if offset and cache.index_keys is None:
                    raise ValueError("cache.index_keys: the cache was filled without an indexer")
                cache.index_keys = k_index = _append(cache.index_keys, k_index, "index_keys")
            index_inputs = (q_index, k_index, weights)
            if not self.indexer_warmup:
                indices = indexer_topk(q_index, k_index, weights, c.index_topk, cu_seqlens, offset, key_mask=key_mask)
        if indices is not None:
            o = sparse_attention(q, k, v, indices, self.scale)
        else:
            o = dense_causal_attention(q, k, v, self.scale, cu_seqlens, offset, key_mask=key_mask)
        index_loss = None
        if return_indexer_loss and index_inputs is not None:
            target = attention_target(q.detach(), k.detach(), self.scale, cu_seqlens, offset, key_mask)
            scores = indexer_scores(*index_inputs, cu_seqlens=cu_seqlens, query_offset=offset, key_mask=key_mask)
            index_loss = indexer_kl_loss(scores, target, indices)
        return self._output(o, x, index_loss, return_indexer_loss)

    def _output(self, o, x, index_loss, return_indexer_loss: bool):
        """The attention output ``o`` ``[B, T, H, v_head_dim]`` through the output gate and ``o_proj``, with the
        indexer loss when asked for."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.num_heads * self.config.v_head_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        out = self.o_proj(o)
        return (out, index_loss) if return_indexer_loss else out

    def _expand_parts(self, c_kv: torch.Tensor, k_rope: torch.Tensor):
        """``c_kv`` ``[B, S, kv_lora_rank]`` and ``k_rope`` ``[B, S, qk_rope_head_dim]`` -> the keys' two parts
        ``[B, S, H, qk_nope_head_dim]``, ``[B, S, H, qk_rope_head_dim]`` (the rope part shared, expanded) and the
        values ``[B, S, H, v_head_dim]``."""
        c = self.config
        B, S, _ = c_kv.shape
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, S, self.num_heads, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        return k_nope, k_rope.unsqueeze(2).expand(B, S, self.num_heads, c.qk_rope_head_dim), v

    def _expand(self, latent: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The compressed latent ``[B, S, kv_lora_rank + qk_rope_head_dim]`` (``kv_a_proj_with_mqa``'s output) ->
        keys ``[B, S, H, qk_head_dim]`` and values ``[B, S, H, v_head_dim]``."""
        c = self.config
        k_nope, k_rope, v = self._expand_parts(*latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1))
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _attend_gathered(self, q, latent, index_inputs, context: ContextSlice, return_indexer_loss: bool):
        """This rank's queries q ``[B, L, H, qk_head_dim]`` over the gathered compressed latent: keys and values
        expanded one chunk at a time inside the attention (``ops.dsa.latent_attention``), never the whole row's at
        once. Where the slice cuts into ``CP`` pieces (``ContextSlice.balanced``) the queries (and the indexer's)
        are re-laid out around attention so that every rank does the same work (``to_balanced``: a piece of every
        rank's slice), the output sent back after (``from_balanced``); else a rank attends its own slice. Returns
        the output ``[B, L, H, v_head_dim]`` and the indexer loss (None unless asked for with an indexer)."""
        c = self.config
        need_index_keys = index_inputs is not None and (return_indexer_loss or not self.indexer_warmup)
        # top-k alone takes no gradient: detached, the index inputs' part of the gather's and the re-layout's
        # backward stays out of the indexer's parameters (None, as on one process, not zeros)
        q_index = weights = index_keys = None
        if need_index_keys:
            q_index, index_keys, weights = index_inputs
            if not return_indexer_loss:
                q_index, index_keys, weights = q_index.detach(), index_keys.detach(), weights.detach()
        L = q.shape[1]
        runs = context.balanced_runs() if context.balanced else ((0, L, context.start),)
        # every rank takes the whole row's keys and runs the expansion over the same chunks (ops.dsa.latent_attention
        # expands every chunk): under ZeRO-3 each expansion call gathers its parameters, a collective, so the
        # number of calls must not depend on the rank's queries (it deadlocked a 32 k row at CP 4)
        end = context.total
        latent, k_index = _gather_keys(context, latent, index_keys, end)
        if context.balanced:
            q, q_index, weights = _to_balanced(context, q, q_index, weights)
        S = latent.shape[1]
        cu_seqlens = _context_cu_seqlens(context, q.device, end)
        indices = None
        if need_index_keys and not self.indexer_warmup:
            indices = _by_runs(
                runs,
                lambda t0, t1, pos: indexer_topk(
                    q_index[:, t0:t1], k_index, weights[:, t0:t1], c.index_topk, cu_seqlens, pos
                ),
            )
            plan = selection_plan(indices, S, self.context_block_size, runs, cu_seqlens)
        else:
            plan = causal_plan(S, runs, cu_seqlens, device=q.device)
        params = [*self.kv_a_layernorm.parameters(), *self.kv_b_proj.parameters()]
        o = latent_attention(
            q,
            latent,
            self._expand,
            self.scale,
            plan,
            self.context_block_size,
            self.context_key_chunk,
            grads_ready=lambda ready: tiled_gradients(params, ready),
        )
        index_loss = None
        if return_indexer_loss and need_index_keys:
            target = latent_attention_target(
                q.detach(), latent.detach(), self._expand, self.scale, runs, cu_seqlens, self.context_key_chunk
            )
            scores = _by_runs(
                runs,
                lambda t0, t1, pos: indexer_scores(
                    q_index[:, t0:t1], k_index, weights[:, t0:t1], cu_seqlens=cu_seqlens, query_offset=pos
                ),
            )
            index_loss = indexer_kl_loss(scores, target, indices)
        return (context.from_balanced(o) if context.balanced else o), index_loss

    def _attend_by_heads(self, q, k_nope, k_rope, v, context: ContextSlice) -> torch.Tensor:
        """Dense causal attention of this rank's slice, head-parallel: q ``[B, L, H, qk_head_dim]``, the keys'
        two parts ``[B, L, H, qk_nope_head_dim]`` and ``[B, L, H, qk_rope_head_dim]`` (their concatenation is the
        key), v ``[B, L, H, v_head_dim]`` of the slice -> the slice's output ``[B, L, H, v_head_dim]``. One
        all-to-all takes them to the whole row of ``H / CP`` heads, one brings the output back."""
        c = self.config
        row = context.to_heads(q, k_nope, k_rope, v)  # [B, T, H / CP, 2 qk_head_dim + v_head_dim]
        q_row, k_row, v_row = row.split([c.qk_head_dim, c.qk_head_dim, c.v_head_dim], dim=-1)
        cu_seqlens = _context_cu_seqlens(context, q.device, end=context.total)
        return context.from_heads(dense_causal_attention(q_row, k_row, v_row, self.scale, cu_seqlens))
