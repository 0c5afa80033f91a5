"""Stable Latent MoE as a megatron-core ``MoELayer``: a thin adapter over the one MoE forward.

``LatentMoELayer`` is a subclass of megatron-core's ``MoELayer`` (so ``TransformerLayer.is_moe_layer`` holds
and megatron's MoE machinery recognises it), built by megatron from its spec, with megatron's process groups
(``pg_collection``: the expert-parallel group), its shared-expert stage and its experts interface. Its forward
is ``layers.moe.LatentMoEMixin.moe_forward``, the single-device layer's own:

* the router: K3's (``gate``, fp32 sigmoid scores, top-k chosen on scores + ``e_score_correction_bias``,
  weights renormalised and scaled) through ``moe_plugin.ops.moe.route``;
* ``routed_expert_down_proj`` (hidden -> latent) before the dispatch, so what crosses the all-to-all is
  ``[N * top_k, latent]``; after the combine ``routed_expert_norm`` (RMSNorm) and ``routed_expert_up_proj``
  (latent -> hidden), plus the shared experts on the full hidden;
* the dispatch: the layer's ``dispatch`` slot, ``megatron.expert_dispatch.dispatch_for`` its expert-parallel
  group: this device's sort and combine at EP 1, the chunked, overlapped all-to-all over the ranks otherwise
  (one host read a layer). megatron's alltoall dispatcher (still built by ``MoELayer``, unused) reads the device
  8 times a layer to size its permute and chunk sort, 11 under EP (issue 24; ``benchmarks/host_reads.py``).
  Expert tensor parallelism is refused.

Parameter names are ``StableLatentMoE``'s (``gate.weight``, ``gate.e_score_correction_bias``,
``experts.w1/w2/w3`` stacked ``[E_local, ...]``, ``routed_expert_down_proj``, ``routed_expert_norm``,
``routed_expert_up_proj``, ``shared_experts.{gate,up,down}_proj``), so a single-device state dict loads after
slicing the experts to this rank's ``local_expert_indices`` (``ParallelLayout.experts_held``). The modules
themselves are the single-device layer's (``moe_plugin.layers.moe``); this file only adapts them to megatron's
calling conventions.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from ..compat.megatron import pop_router
from ..config import MoEConfig, require
from ..layers.mlp import GLUMLP
from ..layers.moe import LatentMoEMixin, MoERouter, experts_kwargs
from ..layers.packed_experts import PackedStackedExperts
from ..layers.stacked_experts import StackedExperts
from ..expert_adapters import experts_held
from .expert_dispatch import dispatch_for
from .expert_tags import tag_expert_parameter

# megatron routing/balancing options that LatentMoELayer's route never reads: each must keep its default, and
# the MoEConfig field (or mechanism) that does the job instead is named in the error.
UNREAD_ROUTER_FIELDS = {
    # megatron's seq_aux_loss takes a row of the batch as its sequence (a packed row of documents would be one)
    # and lives in its TopKRouter, which this layer replaces: the per-document term is LatentMoEMixin's, the
    # Hugging Face layer's own (moe_plugin.layers.moe.balancing), added to the loss by the training backend
    "moe_aux_loss_coeff": (
        0.0,
        "the balance loss is the recipe's router_balance.aux_loss_coeff (per document, "
        "moe_plugin.layers.moe.balancing); the selection bias balances full training "
        "(MoEConfig.bias_update_rate)",
    ),
    "moe_z_loss_coeff": (None, "no z-loss on this router"),
    "moe_router_padding_for_quantization": (False, "no routing-map padding (the experts are not quantized)"),
    "moe_router_padding_for_fp8": (False, "no routing-map padding (the experts are not quantized)"),
    "moe_router_force_load_balancing": (False, "set the selection bias instead (gate.e_score_correction_bias)"),
    "moe_router_num_groups": (None, "set MoEConfig.num_groups"),
    "moe_router_group_topk": (None, "set MoEConfig.topk_groups"),
    "moe_router_topk_scaling_factor": (None, "set MoEConfig.routed_scaling_factor"),
    "moe_router_enable_expert_bias": (
        False,
        "the selection bias is always on (gate.e_score_correction_bias, MoEConfig.bias_update_rate)",
    ),
    "moe_input_jitter_eps": (None, "no input jitter on this router"),
}


def megatron_moe_fields(moe: MoEConfig) -> dict:
    """The ``TransformerConfig`` fields an MoE model with ``LatentMoELayer`` must set, from ``moe``.

    ``MoELayer`` sizes its dispatcher by ``num_moe_experts`` and ``moe_router_topk`` and builds shared experts only when
    ``moe_shared_expert_intermediate_size`` is set. megatron's own ``moe_latent_size`` stays unset: it requires
    TransformerEngine and has no norm. The score function is unused by this layer but named "sigmoid" (what
    ``route`` does): with "softmax" megatron rejects top-1.
    """
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size if moe.num_shared_experts else None,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        moe_router_score_function="sigmoid",
    )


def check_megatron_config(config: TransformerConfig, moe: MoEConfig) -> None:
    """Raise ValueError naming the ``TransformerConfig`` field that disagrees with ``moe``."""
    for name, want in megatron_moe_fields(moe).items():
        if name in ("moe_ffn_hidden_size", "moe_router_dtype", "moe_router_score_function"):
            continue  # unused by LatentMoELayer: its experts and router take their sizes and dtype from moe
        got = getattr(config, name)
        require(got == want, f"TransformerConfig.{name}", f"must be {want!r} for this MoEConfig, got {got!r}")
    require(
        config.hidden_size == moe.hidden_size,
        "TransformerConfig.hidden_size",
        f"must equal MoEConfig.hidden_size ({moe.hidden_size}), got {config.hidden_size}",
    )
    require(
        config.moe_latent_size is None,
        "TransformerConfig.moe_latent_size",
        "must be None: LatentMoELayer does the latent projection (set MoEConfig.latent_size instead)",
    )
    require(
        not config.moe_shared_expert_overlap,
        "TransformerConfig.moe_shared_expert_overlap",
        "must be False: the shared experts already run while the tokens travel (the layer's dispatch, "
        "parallel.moe_overlap_chunks; docs/moe-overlap.md), without megatron's CUDA side stream",
    )
    require(
        config.moe_expert_capacity_factor is None,
        "TransformerConfig.moe_expert_capacity_factor",
        "must be None: LatentMoELayer is dropless",
    )
    for name, (default, instead) in UNREAD_ROUTER_FIELDS.items():
        got = getattr(config, name)
        require(
            got == default,
            f"TransformerConfig.{name}",
            f"must be {default!r} (LatentMoELayer's router does not read it; {instead}), got {got!r}",
        )


def _param_device(config: TransformerConfig) -> torch.device:
    """Where megatron's own layers allocate parameters: the current CUDA device unless CPU init is asked for."""
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MegatronStackedExperts(StackedExperts):
    """``experts`` with megatron's experts interface: ``(tokens, tokens_per_expert, probs) -> (out, None)``.

    Holds only this rank's ``num_local_experts`` experts (stacked ``[E_local, ...]``), global experts
    ``ep_rank * E_local ..``, in ``config.params_dtype`` on ``_param_device(config)``. Built by ``MoELayer``
    through ``build_module(spec, num_local_experts, config, pg_collection=...)``.

    Initialisation is expert-parallel invariant: one layer seed is drawn from torch's default CPU generator
    (which must agree across ranks, as after megatron's seeding; every rank builds the same layers in the same
    order) and each expert from a generator seeded by (layer seed, global expert index). An EP=n model thus
    starts equal to the EP=1 model, and no two experts start equal. megatron's expert-parallel RNG stream is
    not used: it differs per EP rank, so it makes the experts depend on the layout (and on CPU it was drawn
    by every rank from the same state).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        moe: MoEConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        if pg_collection is not None:
            ep_group, expert_dp_group = pg_collection.ep, pg_collection.expt_dp
        else:
            ep_group = parallel_state.get_expert_model_parallel_group()
            expert_dp_group = parallel_state.get_expert_data_parallel_group()
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        ep_size = get_pg_size(ep_group)
        first, _ = experts_held(num_local_experts * ep_size, ep_size, get_pg_rank(ep_group))
        # experts_kwargs: the packed format when the next class in the MRO is PackedStackedExperts
        super().__init__(
            num_local_experts,
            moe.expert_dim,
            moe.expert_intermediate_size,
            moe.activation,
            moe.situ_beta,
            moe.situ_linear_beta,
            dtype=config.params_dtype,
            device=_param_device(config),
            seed=seed,
            first_expert=first,
            **experts_kwargs(moe),
        )
        for p in self.parameters():
            # megatron's mark for expert parameters (its DDP reduces their gradients over the
            # expert-data-parallel group), and ZeRO-3's placement within that group: set here, inside
            # __init__, so that deepspeed.zero.Init partitions them within their group as they are built
            tag_expert_parameter(p, ep_size, expert_dp_group)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: Optional[torch.Tensor]):
        """tokens: ``[M, L]`` grouped by local expert; tokens_per_expert: ``[E_local]``; probs: ``[M]`` or None.

        Returns ``(probs * E(tokens) [M, L], None)``: the weighting happens here, as in megatron's experts,
        so that the dispatcher's unpermute only sums. With probs None the rows come back unweighted (the
        layer's own dispatch at EP 1 weights them in its combine, as ``StableLatentMoE`` does).
        """
        y = super().forward(tokens, tokens_per_expert.to(tokens.device))
        if probs is None:
            return y, None
        return (y * probs.unsqueeze(-1)).to(y.dtype), None


class MegatronPackedExperts(MegatronStackedExperts, PackedStackedExperts):
    """``MegatronStackedExperts`` over packed experts (``MoEConfig.expert_format``, docs/packed-experts.md): the
    same interface, seeding and ZeRO-3 expert tags, with ``PackedStackedExperts``' storage and forward (its
    ``expert_format`` comes from ``MegatronStackedExperts.__init__`` through ``experts_kwargs``)."""


class MegatronSharedExperts(GLUMLP):
    """``shared_experts``: the fused shared-expert GLU on the full hidden, built the way ``MoELayer`` builds it."""

    def __init__(
        self,
        moe: MoEConfig,
        config: Optional[TransformerConfig] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        gate: bool = False,
    ):
        require(not gate, "TransformerConfig.moe_shared_expert_gate", "is not supported by LatentMoELayer")
        super().__init__(
            moe.hidden_size, moe.shared_intermediate_size, moe.activation, moe.situ_beta, moe.situ_linear_beta
        )
        if config is not None:
            self.to(device=_param_device(config), dtype=config.params_dtype)


def latent_moe_submodules(moe: MoEConfig) -> MoESubmodules:
    """megatron ``MoESubmodules`` building this project's router, stacked experts and shared experts."""
    return MoESubmodules(
        experts=ModuleSpec(
            module=MegatronStackedExperts if moe.expert_format == "dense" else MegatronPackedExperts,
            params={"moe": moe},
        ),
        shared_experts=ModuleSpec(module=MegatronSharedExperts, params={"moe": moe}),
        router=lambda *, config, pg_collection: MoERouter(moe.hidden_size, moe.num_experts),
    )


def latent_moe_spec(moe: MoEConfig) -> ModuleSpec:
    """The ``mlp`` ModuleSpec of an MoE ``TransformerLayer``."""
    return ModuleSpec(module=LatentMoELayer, params={"moe": moe})


class LatentMoELayer(LatentMoEMixin, MoELayer):
    """Stable Latent MoE on megatron's expert parallelism (see the module docstring).

    forward(hidden_states ``[S, B, hidden]``, padding_mask ``[B, S]`` bool, True = padding) ->
    ``(y [S, B, hidden], None)``, as ``MoELayer``. ``config`` must agree with ``moe`` (``check_megatron_config``;
    ``megatron_moe_fields`` gives the fields).

    Balancing is ``LatentMoEMixin``'s (shared with ``StableLatentMoE``): inside ``layers.moe.balancing`` the router step
    records the per-document balance term of this rank's tokens (``pop_balance``); ``last_load`` ``[E]`` accumulates
    this rank's non-padded token copies per (global) expert over the micro-batches until ``pop_load``; the training
    loop all-reduces it (SUM) over ``parallel_state.get_data_parallel_group()``, which spans the expert-parallel
    ranks, and then calls ``update_routing_bias`` on every rank (``training.step_math.balance_loads``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        moe: MoEConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        check_megatron_config(config, moe)
        self.moe = moe
        super().__init__(config, submodules or latent_moe_submodules(moe), layer_number, pg_collection)
        self.moe_config = moe
        # MoELayer registers the router as "router"; the checkpoints and LoRA targets call it "gate".
        self.gate = pop_router(self).to(_param_device(config))  # the router stays fp32
        self._build_latent_modules(dtype=config.params_dtype, device=_param_device(config))
        self.last_load = None
        self.dispatch = dispatch_for(self.ep_group)
        require(
            get_pg_size(self.token_dispatcher.tp_group) == 1,
            "expert_tensor_parallel_size",
            "must be 1: LatentMoELayer shards experts over expert-parallel ranks only (set expert_model_parallel_size)",
        )

    @property
    def router(self) -> Optional[MoERouter]:
        """The ``MoERouter`` behind ``gate`` (also when peft has wrapped ``gate`` in a LoRA layer)."""
        gate = self._modules.get("gate", self._modules.get("router"))
        return getattr(gate, "base_layer", gate)

    @router.setter
    def router(self, value) -> None:
        # BaseMoELayer.__init__ assigns None before any router exists; the real one is registered by
        # nn.Module.__setattr__ (a Module value never reaches this setter) and renamed to "gate".
        if value is not None:
            raise AttributeError("LatentMoELayer.router: assign the router to `gate`")

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(
        self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask: Optional[torch.Tensor] = None
    ):
        """hidden_states ``[S, B, hidden]``, padding_mask ``[B, S]`` bool (True = padding) -> ``(y [S, B, hidden],
        None)``, ``MoELayer``'s interface over the one MoE forward (``LatentMoEMixin.moe_forward``, with this
        layer's ``dispatch``)."""
        require(
            intermediate_tensors is None,
            "intermediate_tensors",
            "LatentMoELayer runs whole (no partial CUDA-graph capture of the MoE layer); leave it None",
        )
        if padding_mask is not None:  # [B, S] -> [S, B] flattened, the order of the tokens
            padding_mask = padding_mask.transpose(0, 1).reshape(-1).bool()
        y, _ = self.moe_forward(hidden_states.reshape(-1, hidden_states.shape[-1]), padding_mask)
        return y.view(hidden_states.shape), None

    def _expert_rows(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """rows ``[M, L]`` grouped by local expert -> their experts' outputs ``[M, L]``, unweighted (megatron's
        experts interface, probs None)."""
        y, _ = self.experts(rows, tokens_per_expert, None)
        return y
