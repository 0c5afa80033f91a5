"""Stable Latent MoE on one device (docs/architecture.md 3), with K3's module names, and the one MoE forward.

``LatentMoEMixin.moe_forward`` is the MoE forward of both faces of the model: the single-device
``StableLatentMoE`` here and megatron's ``LatentMoELayer`` (``moe_plugin.megatron.latent_moe``, a thin adapter to
megatron's calling convention). How the token copies reach the experts and come back is the layer's
``dispatch`` slot: ``TokenDispatch`` (this device, every expert), ``megatron.expert_dispatch.
ExpertParallelDispatch`` (all-to-all over the expert-parallel ranks, overlapped in chunks with compute; put in
from outside by ``parallel.expert_parallel.apply_expert_parallel``) or the planner's balanced routing
(``plan.routing``), so its meta run is this forward, unpatched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..ops.moe import document_balance, permute, quantile_balance_bias, route, unpermute, update_bias_sign
from .mlp import GLUMLP
from .norm import RMSNorm
from .packed_experts import PackedStackedExperts
from .recompute import RECOMPUTED, recomputed
from .stacked_experts import StackedExperts

BIAS_METHODS = ("sign", "quantile")


def route_logits(
    config: MoEConfig, logits: torch.Tensor, bias: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.moe.route`` with ``config``'s routing options: logits ``[N, E]``, bias ``[E]`` -> weights ``[N, k]``
    fp32, indices ``[N, k]`` int64, unbiased scores ``[N, E]`` fp32."""
    return route(
        logits.float(),
        config.top_k,
        bias=bias,
        renormalize=config.renormalize,
        scaling=config.routed_scaling_factor,
        num_groups=config.num_groups,
        topk_groups=config.topk_groups,
    )


def expert_load(indices: torch.Tensor, num_experts: int, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """indices: ``[N, k]`` chosen experts; padding_mask: ``[N]`` bool, True = padding (megatron's GPTModel
    convention) -> ``[E]`` float count of the non-padded token copies each expert received (detached)."""
    indices = indices.detach()
    if padding_mask is not None:
        if padding_mask.numel() != indices.shape[0]:
            raise ValueError(
                f"padding_mask: expected {indices.shape[0]} entries (one per token), got {tuple(padding_mask.shape)}"
            )
    # counted into E slots with a weight per copy: a boolean index or bincount would size by a host read
    weights = torch.ones(indices.shape, dtype=torch.float32, device=indices.device)
    if padding_mask is not None:
        weights = weights * (~padding_mask.reshape(-1, 1).bool().to(indices.device))
    return weights.new_zeros(num_experts).index_add_(0, indices.reshape(-1).long(), weights.reshape(-1))


class TokenDispatch:
    """How an MoE layer sends its token copies to its experts and takes their outputs back: on this device,
    sorted by expert over all ``E`` (``ops.moe.permute`` / ``unpermute``). Stateless; the layer's ``dispatch``
    attribute holds one. Whoever replaces it keeps ``run``'s contract (the planner's balanced routing overrides
    ``send`` and ``combine``; expert parallelism overrides ``run``)."""

    def send(
        self, z: torch.Tensor, indices: torch.Tensor, num_experts: int
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z ``[N, L]``, indices ``[N, k]`` -> rows ``[M, L]`` grouped by expert, counts ``[E_held]`` int64 (one
        per expert the layer's ``experts`` hold, summing to M) and the ``order`` that ``combine`` takes."""
        return permute(z, indices, num_experts)

    def combine(self, y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' rows ``[M, L]`` back onto the N tokens, weighted by ``weights`` ``[N, k]``: ``[N, L]``."""
        return unpermute(y_sorted, order, weights)

    def run(
        self,
        z: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        num_experts: int,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        region: Callable,
        side: Callable[[], Optional[torch.Tensor]],
        keep_plan: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """z ``[N, L]`` the latent tokens, indices / weights ``[N, k]`` the router's choices -> ``(u [N, L]`` the
        weighted sum of each token's expert outputs, ``counts [E_held]`` int64 as ``send`` gives them,
        ``side()``'s value)``. ``experts(rows [M, L], counts) -> [M, L]`` runs the layer's experts;
        ``region(fn, *tensors)`` is the layer's recompute region "experts" (``layers.recompute``): here it holds
        the experts and the combine. ``side`` is work that needs no dispatched token (the shared experts); a
        dispatcher that communicates runs it while tokens travel. ``keep_plan``: this call will be run again in
        the backward (``"full_routing"``); a dispatcher that exchanges counts keeps them for that rerun."""
        z_sorted, counts, order = self.send(z, indices, num_experts)

        def experts_combined(rows, counts, order, weights):
            return self.combine(experts(rows, counts), order, weights)

        u = region(experts_combined, z_sorted, counts, order, weights)
        return u, counts, side()


class MoERouter(nn.Linear):
    """``gate``: fp32 router logits ``W_r x`` plus the selection bias buffer ``e_score_correction_bias``.

    A subclass of ``nn.Linear`` so that peft can put a LoRA adapter on it (the seed targets ``gate``).
    Both tensors are created fp32 and kept there by ``moe_plugin.precision`` (``apply_precision``); a frozen
    router weight may be a buffer of the same name there, which ``forward`` reads the same way.
    The bias is a persistent buffer: it is in the state dict (K3 checkpoints carry it) but no optimizer
    touches it; only ``StableLatentMoE.update_routing_bias`` changes it.
    """

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "e_score_correction_bias"):  # nn.Linear.__init__ calls this before the buffer exists
            with torch.no_grad():
                self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[N, hidden]`` -> logits ``[N, E]`` fp32 (routing in bf16 flips near-tied choices)."""
        return F.linear(x.float(), self.weight.float())


def experts_class(config: MoEConfig) -> type:
    """``StackedExperts``, or ``PackedStackedExperts`` when ``config.expert_format`` names a packed format."""
    if config.expert_format == "dense":
        return StackedExperts
    return PackedStackedExperts


def experts_kwargs(config: MoEConfig) -> dict:
    """The extra keyword arguments of ``experts_class(config)`` (the packed format)."""
    return {} if config.expert_format == "dense" else {"expert_format": config.expert_format}


class LatentMoEMixin:
    """What the single-device ``StableLatentMoE`` and megatron's ``LatentMoELayer`` share: the latent
    down/norm/up modules, routing with the config's options, the expert load and selection-bias balancing.

    The host is an ``nn.Module`` with ``moe_config`` (``MoEConfig``), a ``gate`` and a ``router`` property
    (the ``MoERouter`` behind ``gate``). ``moe_plugin.training.metrics.routing.moe_layers`` finds MoE layers by
    this class.

    Load: ``last_load`` ``[E]`` sums the token copies per expert over every forward run with gradients enabled
    (so evaluation and the no-grad first pass of full activation recomputation do not count) since the last
    ``pop_load`` / ``reset_load``, i.e. over all micro-batches of a step. It is this process's count: with data or
    expert parallelism the training loop sums ``pop_load()`` over the data-parallel group (expert-parallel ranks
    route different tokens over all ``E`` experts, so that group spans them) before ``update_routing_bias``,
    and every rank applies the same update so the replicated bias stays equal.

    Balance loss: inside ``balancing`` (around a training forward) the router step records DeepSeek-V3's
    sequence-wise balance term of its tokens, per document, in ``last_balance`` (``pop_balance``), from the very
    scores and choices it routes with; the model (or the megatron backend) adds it to the loss
    (docs/router-balance.md).
    """

    moe_config: MoEConfig
    last_load: Optional[torch.Tensor] = None
    # layers.recompute: the experts and what follows the combine may be recomputed; the routing never is
    recompute_mode = "off"
    recompute_checkpoint_fn = None
    # set by ``balancing`` around a training forward: (doc_ids [N] int64, weights [D] fp32, combine) of its tokens
    _balance_documents: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[Callable]]] = None
    last_balance: Optional[torch.Tensor] = None

    def _build_latent_modules(self, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        c = self.moe_config
        if c.latent_size is None:
            return
        kw = dict(bias=False, dtype=dtype, device=device)
        self.routed_expert_down_proj = nn.Linear(c.hidden_size, c.latent_size, **kw)
        norm = RMSNorm(c.latent_size, c.norm_eps) if c.latent_norm else None
        if norm is not None and (dtype is not None or device is not None):
            norm = norm.to(device=device, dtype=dtype)
        self.routed_expert_norm = norm
        self.routed_expert_up_proj = nn.Linear(c.latent_size, c.hidden_size, **kw)

    def route_tokens(self, x_flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_flat: ``[N, hidden]`` -> weights ``[N, k]`` fp32, indices ``[N, k]`` int64, scores ``[N, E]`` fp32."""
        return route_logits(self.moe_config, self.gate(x_flat), self.router.e_score_correction_bias)

    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., hidden]`` -> ``[..., expert_dim]`` (the tokens the experts, and the all-to-all, see)."""
        if self.moe_config.latent_size is None:
            return x
        return self.routed_expert_down_proj(x)

    def from_latent(self, u: torch.Tensor) -> torch.Tensor:
        """u: ``[..., expert_dim]`` combined expert outputs -> ``[..., hidden]``."""
        if self.moe_config.latent_size is None:
            return u
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        return self.routed_expert_up_proj(u)

    def moe_forward(
        self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The MoE forward of both faces: x ``[N, hidden]``, padding_mask ``[N]`` bool (True = padding: routed and
        sent like any token, but not counted in the load) -> ``(y [N, hidden], load [E])``, load the detached
        float count of this call's non-padded token copies per global expert (also added to ``last_load``).

        The routing and the dispatch run once and are kept; ``recompute_mode``'s regions (``layers.recompute``)
        are the experts (with the local combine) and what follows the combine, so "off" and the recompute modes
        accumulate gradients alike and a recompute never exchanges again. The shared experts are the
        dispatch's side work: an expert-parallel dispatch runs them while tokens travel."""
        weights, indices, scores = self.route_tokens(x)
        self._record_balance(scores, indices, padding_mask)
        mode, ckpt = self.recompute_mode, self.recompute_checkpoint_fn
        num_experts = self.moe_config.num_experts
        # "full_routing": everything after the routing is one region, recomputed with the forward's routing
        # (and its exchange plan, kept by the dispatch: the counts are not exchanged again)
        keep_plan = "dispatch" in RECOMPUTED[mode] and torch.is_grad_enabled()

        def region(fn, *tensors):
            return recomputed(mode, "experts", fn, *tensors, checkpoint_fn=ckpt)

        def dispatched(x, indices, weights):
            def side():
                return recomputed(mode, "moe_out", self.shared_path, x, checkpoint_fn=ckpt)

            u, counts, shared = self.dispatch.run(
                self.to_latent(x), indices, weights, num_experts, self._expert_rows, region, side, keep_plan=keep_plan
            )
            y = recomputed(mode, "moe_out", self.from_latent, u, checkpoint_fn=ckpt)
            return (y if shared is None else y + shared), counts

        y, counts = recomputed(mode, "dispatch", dispatched, x, indices, weights, checkpoint_fn=ckpt)
        if padding_mask is None and counts.shape[0] == num_experts:
            load = counts.detach().float()  # the dispatch counted every expert's copies already
        else:
            load = expert_load(indices, num_experts, padding_mask)
        self._record_load(load)
        return y, load

    def _expert_rows(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """rows ``[M, L]`` grouped by the layer's experts -> their outputs ``[M, L]``, unweighted. The experts are
        called as a module, so a peft wrapper around them applies."""
        return self.experts(rows, tokens_per_expert)

    def shared_path(self, x_flat: torch.Tensor) -> Optional[torch.Tensor]:
        """x_flat: ``[N, hidden]`` -> ``[N, hidden]``, or None without shared experts."""
        return self.shared_experts(x_flat) if self.moe_config.num_shared_experts > 0 else None

    def _record_load(self, load: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.last_load = load if self.last_load is None else self.last_load + load

    def _record_balance(
        self, scores: torch.Tensor, indices: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> None:
        """Inside ``balancing``, with gradients enabled: add this forward's ``sum_d w_d * balance_d`` (a scalar
        with gradients through the router's scores, ``ops.moe.document_balance``) to ``last_balance``.

        scores: ``[N, E]`` the unbiased sigmoid scores the layer routed with; indices: ``[N, k]`` its choices
        (made with the selection bias); padding_mask: ``[N]`` bool, True = padding, which does not count."""
        if self._balance_documents is None or not torch.is_grad_enabled():
            return
        doc_ids, weights, combine = self._balance_documents
        if doc_ids.numel() != scores.shape[0]:
            raise ValueError(
                f"balancing: expected one document id per routed token ({scores.shape[0]}), got "
                f"{doc_ids.numel()}; give the document ids of the tokens in the layer's order"
            )
        doc_ids = doc_ids.to(scores.device)
        if padding_mask is not None:
            doc_ids = doc_ids.masked_fill(padding_mask.reshape(-1).bool().to(scores.device), -1)
        weights = weights.to(scores.device)
        value = (weights * document_balance(scores, indices, doc_ids, weights.numel(), combine)).sum()
        self.last_balance = value if self.last_balance is None else self.last_balance + value

    def pop_balance(self) -> Optional[torch.Tensor]:
        """The balance term recorded since the last call (None if none was), and reset it."""
        value, self.last_balance = self.last_balance, None
        return value

    def pop_load(self) -> Optional[torch.Tensor]:
        """The ``[E]`` load summed since the last call (None if no counted forward ran), and reset it."""
        load, self.last_load = self.last_load, None
        return load

    def reset_load(self) -> None:
        self.last_load = None

    @torch.no_grad()
    def update_routing_bias(self, load_or_scores: torch.Tensor, method: str = "sign") -> torch.Tensor:
        """Move ``gate.e_score_correction_bias`` toward balance, in place; returns the new ``[E]`` bias.

        method "sign": load_or_scores is the ``[E]`` load of a global batch (summed over micro-batches and
        data-parallel ranks, see the class docstring); rate ``moe_config.bias_update_rate``.
        method "quantile": load_or_scores is ``[m, E]`` unbiased scores (``route``'s third output) of the batch.
        """
        bias = self.router.e_score_correction_bias
        if method == "sign":
            new = update_bias_sign(bias, load_or_scores.to(bias.device), self.moe_config.bias_update_rate)
        elif method == "quantile":
            new = quantile_balance_bias(load_or_scores.to(bias.device), bias, self.moe_config.top_k)
        else:
            raise ValueError(f"method: expected one of {BIAS_METHODS}, got {method!r}")
        bias.copy_(new)
        return bias.detach().clone()


class StableLatentMoE(LatentMoEMixin, nn.Module):
    """Routed experts in a latent space with an RMSNorm on their combined output, plus shared experts.

    ``y = up(RMSNorm(sum_k w_k E_k(down(x)))) + shared(x)``; without ``latent_size`` the experts work on
    the hidden directly and there is no down/norm/up.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = self.moe_config = config
        c = config
        self.num_experts, self.top_k = c.num_experts, c.top_k
        self.dispatch = TokenDispatch()
        self.gate = MoERouter(c.hidden_size, c.num_experts)
        self.experts = experts_class(c)(
            c.num_experts,
            c.expert_dim,
            c.expert_intermediate_size,
            c.activation,
            c.situ_beta,
            c.situ_linear_beta,
            **experts_kwargs(c),
        )
        self._build_latent_modules()
        if c.num_shared_experts > 0:
            self.shared_experts = GLUMLP(
                c.hidden_size, c.shared_intermediate_size, c.activation, c.situ_beta, c.situ_linear_beta
            )

    @property
    def router(self) -> MoERouter:
        """The ``MoERouter`` itself, also when peft has wrapped ``gate`` in a LoRA layer."""
        return getattr(self.gate, "base_layer", self.gate)

    def route(self, x_flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_flat: ``[N, hidden]`` -> weights ``[N, k]`` fp32, indices ``[N, k]`` int64, scores ``[N, E]`` fp32."""
        return self.route_tokens(x_flat)

    def forward(
        self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: ``[B, T, hidden]`` -> ``(y [B, T, hidden], load [E])`` (``moe_forward``).

        load is the detached float count of token copies each expert received in this call, to be summed
        over a global batch for ``update_routing_bias`` (``last_load`` also accumulates it, see the mixin).
        padding_mask: ``[B, T]`` bool, True = padding: such tokens are routed (harmless) but not counted.
        """
        shape = hidden_states.shape
        mask = None if padding_mask is None else padding_mask.reshape(-1)
        y, load = self.moe_forward(hidden_states.reshape(-1, shape[-1]), mask)
        return y.view(shape), load


@contextlib.contextmanager
def balancing(
    layers: Iterable[LatentMoEMixin],
    doc_ids: torch.Tensor,
    weights: torch.Tensor,
    combine: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Iterator[List[LatentMoEMixin]]:
    """Within the block, every MoE layer of ``layers`` records the sequence-wise balance term of its training
    forwards (``LatentMoEMixin._record_balance``; read it with ``pop_balance``).

    doc_ids: ``[N]`` int64 document of each token in the order the layers route them (the flattened
    ``[B, T]`` of the Hugging Face layer, ``[S, B]`` of megatron's with B = 1: the same for packed rows),
    -1 for a token that does not count; weights: ``[D]`` fp32 (``ops.moe.document_weights``). A term left from
    an earlier forward is dropped on entry, so what the block records is its own. combine: under context
    parallelism, sums the per-document statistics over the context ranks (``ops.moe.document_balance``); the
    caller then divides ``weights`` by the context size, since every context rank adds the whole term."""
    layers = list(layers)
    for layer in layers:
        layer.last_balance = None
        layer._balance_documents = (doc_ids, weights, combine)
    try:
        yield layers
    finally:
        for layer in layers:
            layer._balance_documents = None
