"""The MoE metrics of a training log (docs/hf-trainer.md section 2), for the recipe trainer and the Hugging
Face Trainer callback alike.

* Expert load (``load_metrics``): per MoE layer, from its ``[E]`` token counts of a global batch (the trainer's:
  of the global batches since the last logged step, ``MoEMetrics.add_step``), a bounded set of
  summaries (max/mean, min/mean, coefficient of variation, the number of dead experts, which got no token, and
  of overloaded ones, above ``OVERLOAD_FACTOR`` times the mean) and a ``Distribution`` of the load shares
  (load / mean), which trackers store as a fixed-size histogram: the number of keys grows with the number of
  layers, never with the number of experts.
* Routing drift (``MoEMetrics``): the share of (token, slot) expert choices of the adapted router that the
  frozen base router would not have made. It is computed from the router's own forward through hooks, the base
  logits read from peft's ``base_layer`` on its way through, so no module runs an extra time: under ZeRO-3 an
  extra module call gathers parameters, a collective, and one made on some ranks only deadlocks.
* Indexer KL: the DSA indexer's KL loss of the forwards that computed it (the model trains the indexer when its
  weights are trainable): read off the Hugging Face model's output by a hook, and handed over by the loop from
  the backend's loss metrics for a model without one (megatron's ``GPTModel``: ``add_loss_metrics``).
* Balance term (``moe/aux_loss``, ``moe/<label>/aux_loss``): the sequence-wise balance loss the step's loss holds
  (coefficient included), handed over by the loop from the backend's loss metrics on both faces.
* Per-rank load (``rank_load_metrics``): from the global per-expert load and the expert-parallel size, the
  busiest EP rank's token copies over its balanced share (the trainer's: its worst step since the last log), the
  quantity ``parallel.capacity_factor`` bounds in the plan; ``MoEMetrics`` warns once per layer and rank that
  goes past it.
* Parameter counts (``global_parameter_counts``): the whole model's, every expert-parallel rank's experts
  included, for the run's "model:" line.

Drift, KL and the balance term are this process's sums until ``collect`` adds them over every rank (a
collective: every rank calls it at the same step).
"""

from __future__ import annotations

import re
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ...compat.deepspeed import full_numel
from ...layers.moe import LatentMoEMixin, route_logits
from .logger import Distribution, Value

__all__ = [
    "OVERLOAD_FACTOR",
    "MoEMetrics",
    "global_parameter_counts",
    "load_metrics",
    "moe_layer_labels",
    "rank_loads",
    "rank_load_metrics",
]

OVERLOAD_FACTOR = 2.0


def moe_layer_labels(model: nn.Module) -> List[Tuple[str, LatentMoEMixin]]:
    """``[(label, layer)]`` of the model's MoE layers in forward order (the order of the rows of the loop's
    expert loads): the label is ``layer<i>`` with ``i`` the decoder layer index, the same on the megatron and
    the Hugging Face faces (``decoder.layers.3.mlp`` and ``model.layers.3.mlp`` are both ``layer3``)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, LatentMoEMixin):
            index = re.findall(r"layers\.(\d+)\.", name + ".")
            out.append((f"layer{index[-1]}" if index else f"moe{len(out)}", module))
    return out


def load_metrics(
    loads: torch.Tensor, labels: Optional[List[str]] = None, overload_factor: float = OVERLOAD_FACTOR
) -> Dict[str, Value]:
    """loads ``[L, E]`` token copies per expert of each MoE layer (summed over the ranks) -> the metrics:
    ``moe/<label>/{load_max_over_mean, load_min_over_mean, load_cv, dead_experts, overloaded_experts, load}`` per
    layer (``load`` a ``Distribution`` of the ``E`` shares load / mean) and, over all layers,
    ``moe/load_max_over_mean`` (the worst layer), ``moe/dead_experts`` and ``moe/overloaded_experts`` (sums)."""
    loads = loads.detach().double().cpu()
    if loads.dim() != 2 or loads.shape[1] < 1:
        raise ValueError(f"loads: expected [num_moe_layers, num_experts], got {tuple(loads.shape)}")
    labels = labels if labels is not None else [f"moe{i}" for i in range(loads.shape[0])]
    if len(labels) != loads.shape[0]:
        raise ValueError(f"labels: expected one per MoE layer ({loads.shape[0]}), got {len(labels)}")
    out: Dict[str, Value] = {}
    worst, dead_total, over_total = 0.0, 0, 0
    for label, load in zip(labels, loads):
        mean = float(load.mean())
        share = load / mean if mean > 0 else torch.zeros_like(load)
        dead, over = int((load == 0).sum()), int((share > overload_factor).sum())
        prefix = f"moe/{label}/"
        out[prefix + "load_max_over_mean"] = float(share.max())
        out[prefix + "load_min_over_mean"] = float(share.min())
        out[prefix + "load_cv"] = float(share.std(unbiased=False))  # std / mean of the load
        out[prefix + "dead_experts"] = float(dead)
        out[prefix + "overloaded_experts"] = float(over)
        out[prefix + "load"] = Distribution(tuple(share.tolist()))
        worst, dead_total, over_total = max(worst, float(share.max())), dead_total + dead, over_total + over
    out["moe/load_max_over_mean"] = worst
    out["moe/dead_experts"] = float(dead_total)
    out["moe/overloaded_experts"] = float(over_total)
    return out


def rank_loads(loads: torch.Tensor, ep_size: int) -> torch.Tensor:
    """loads ``[L, E]`` global token copies per expert -> ``[L, ep_size]`` each expert-parallel rank's share over
    its balanced share (rank r holds the contiguous experts ``r * E / ep .. (r + 1) * E / ep``, megatron's
    ``local_expert_indices``): 1 everywhere is a balanced dispatch, 0 for a layer that routed nothing."""
    loads = loads.detach().double()
    if loads.dim() != 2 or not isinstance(ep_size, int) or ep_size < 1 or loads.shape[1] % ep_size:
        raise ValueError(
            f"ep_size: expected a positive divisor of the {tuple(loads.shape)[-1:]} experts of loads "
            f"[layers, experts] {tuple(loads.shape)}, got {ep_size!r}"
        )
    per_rank = loads.reshape(loads.shape[0], ep_size, -1).sum(-1)
    mean = per_rank.mean(-1, keepdim=True)
    return torch.where(mean > 0, per_rank / mean.clamp_min(1e-300), torch.zeros_like(per_rank))


def rank_load_metrics(loads: torch.Tensor, ep_size: int, labels: Optional[List[str]] = None) -> Dict[str, Value]:
    """``moe/<label>/rank_load_max_over_mean`` per layer and ``moe/rank_load_max_over_mean`` (the worst layer):
    the busiest expert-parallel rank's token copies over its balanced share (``rank_loads``). It needs only the
    global load, so one process reports what an ``ep_size`` layout would dispatch (1.0 at ``ep_size`` 1)."""
    shares = rank_loads(loads, ep_size)
    return _rank_share_metrics(shares, labels if labels is not None else [f"moe{i}" for i in range(len(shares))])


def _rank_share_metrics(shares: torch.Tensor, labels: List[str]) -> Dict[str, Value]:
    """shares ``[L, ep]`` (``rank_loads``) -> the per-layer and worst-layer ``rank_load_max_over_mean``."""
    out: Dict[str, Value] = {
        f"moe/{label}/rank_load_max_over_mean": float(row.max()) for label, row in zip(labels, shares)
    }
    out["moe/rank_load_max_over_mean"] = float(shares.max()) if shares.numel() else 0.0
    return out


class MoEMetrics:
    """Routing drift and indexer KL of ``model``'s forwards, and the load metrics, for one training run.

    ``collect(loads)`` returns ``load_metrics(loads)`` and ``rank_load_metrics(loads, ep_size)`` (the trainer
    hands every step to ``add_step`` and calls ``collect()``: the steps since the last log) plus
    ``moe/<label>/routing_drift`` for each MoE layer whose ``gate`` carries a LoRA adapter, ``moe/routing_drift``
    (over all of them), ``moe/indexer_kl``, ``moe/a2a_exposed_s`` (under expert parallelism: the seconds per step a
    rank spent blocked on the expert all-to-alls, forward and backward, the mean over ranks: what the dispatch's
    overlap did not hide) and the balance term ``moe/aux_loss`` with ``moe/<label>/aux_loss``
    (the mean over the training micro-batches of every rank since the last call: the steps' term), each over the
    training forwards (gradients enabled) since the last call and summed over every rank; a metric with no
    such forward is left out. A layer whose busiest EP rank exceeds ``capacity_factor`` times its balanced
    share is reported to ``warn`` once per (layer, rank). ``close()`` removes the hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        ep_size: int = 1,
        capacity_factor: Optional[float] = None,
        warn: Optional[Callable[[str], None]] = None,
    ):
        self.layers = moe_layer_labels(model)
        self.labels = [label for label, _ in self.layers]
        self.ep_size, self.capacity_factor = ep_size, capacity_factor
        self.warn = warn if warn is not None else (lambda text: warnings.warn(text, stacklevel=2))
        self.warned: set = set()  # (layer label, EP rank) already reported
        # add_step: the loads summed over the steps since the last collect, and each EP rank's worst step
        self._window: Optional[torch.Tensor] = None
        self._rank_peak: Optional[torch.Tensor] = None
        self._handles = []
        self._base_logits: Dict[int, torch.Tensor] = {}
        self.drifting = [i for i, (_, layer) in enumerate(self.layers) if hasattr(layer.gate, "base_layer")]
        # per drifting layer: (choices that differ from the base router's, choices); per MoE layer the balance
        # term; then the seconds waited on the expert all-to-alls, the balance count (micro-batches), the KL sum
        # and count
        self._aux = 2 * len(self.drifting)
        self._sums = torch.zeros(self._aux + len(self.layers) + 4, dtype=torch.float64)
        self._steps = 0  # add_step calls since the last collect
        # the same slots on the forwards' device: the hooks add device values there, read once per collect()
        self._pending: Optional[torch.Tensor] = None
        for slot, i in enumerate(self.drifting):
            layer = self.layers[i][1]
            self._handles.append(layer.gate.base_layer.register_forward_hook(self._keep_base(i)))
            self._handles.append(layer.gate.register_forward_hook(self._compare(i, slot, layer)))
        hooked = _outermost_models(model)
        for module in hooked:
            self._handles.append(module.register_forward_hook(self._indexer_kl))
        # a model whose output carries no indexer_loss (megatron) reports it through the backend's loss instead
        self._kl_from_loss = not hooked

    def _keep_base(self, i: int):
        def hook(module, inputs, logits):
            if torch.is_grad_enabled():
                self._base_logits[i] = logits.detach()

        return hook

    def _compare(self, i: int, slot: int, layer: LatentMoEMixin):
        @torch.no_grad()
        def hook(gate, inputs, logits):
            base = self._base_logits.pop(i, None)
            if base is None:  # not a training forward (see _keep_base)
                return
            bias = layer.router.e_score_correction_bias
            _, adapted_idx, _ = route_logits(layer.moe_config, logits.detach(), bias)
            _, base_idx, _ = route_logits(layer.moe_config, base, bias)
            kept = (adapted_idx.unsqueeze(-1) == base_idx.unsqueeze(-2)).any(-1)
            self._on(kept.device)[2 * slot] += (~kept).sum()
            self._sums[2 * slot + 1] += kept.numel()

        return hook

    def _indexer_kl(self, module, inputs, output):
        kl = getattr(output, "indexer_loss", None)
        if kl is not None and torch.is_grad_enabled():
            self._add_kl(kl)

    def _on(self, device: torch.device) -> torch.Tensor:
        """The pending sums on ``device`` (made on first use): adding there reads nothing from the device."""
        if self._pending is None:
            self._pending = torch.zeros(self._sums.shape, dtype=torch.float64, device=device)
        return self._pending

    def _add_kl(self, kl: torch.Tensor) -> None:
        self._on(kl.device)[-2] += kl.detach().double()
        self._sums[-1] += 1

    def add_loss_metrics(self, metrics: Dict[str, torch.Tensor]) -> None:
        """A training micro-batch's metrics from the backend's ``loss``: its ``indexer_kl`` counts for a model
        whose forward no hook reads it from (on the Hugging Face model the hook has counted it already)."""
        kl = metrics.get("indexer_kl")
        if kl is not None and self._kl_from_loss:
            self._add_kl(kl)
        aux = metrics.get("aux_loss")  # [MoE layers]: the balance term of this micro-batch, coefficient included
        if aux is not None:
            aux = aux.detach().double().reshape(-1)
            if aux.numel() != len(self.layers):
                raise ValueError(
                    f"aux_loss: expected one balance term per MoE layer ({len(self.layers)}), got {aux.numel()}"
                )
            self._on(aux.device)[self._aux : self._aux + aux.numel()] += aux
            self._sums[-3] += 1

    def add_step(self, loads: Optional[torch.Tensor]) -> None:
        """One optimizer step's ``[L, E]`` loads (summed over the ranks; None: no MoE forward): ``collect()``
        without loads reports the steps since the last call, the expert load of their sum (one step's few rows
        say little about the router: its tokens' choices are correlated) and the per-rank load of the worst
        step (what the dispatch buffers must hold)."""
        self._steps += 1
        if loads is None:
            return
        loads = loads.detach().double()  # kept on its device until collect()
        self._window = loads if self._window is None else self._window + loads
        if loads.shape[1] % self.ep_size == 0:
            shares = rank_loads(loads, self.ep_size)
            self._rank_peak = shares if self._rank_peak is None else torch.maximum(self._rank_peak, shares)

    def collect(self, loads: Optional[torch.Tensor] = None) -> Dict[str, Value]:
        """The metrics of the logged step (see the class docstring); ``loads`` ``[L, E]`` summed over ranks, or
        None for the steps given to ``add_step`` since the last call (if any). Collective when a process group
        of several ranks is up: every rank calls it."""
        peak = None
        if loads is None and self._window is not None:
            loads, peak = self._window, self._rank_peak
        self._window = self._rank_peak = None
        self._sums[-4] += self._pop_waited()
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        steps, self._steps = self._steps, 0
        if self._pending is not None:  # the one read of the device-side sums
            sums, self._pending = sums + self._pending.cpu(), None
        if loads is not None:
            loads = loads.detach().cpu()
        if peak is not None:
            peak = peak.cpu()
        world = 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
            world = dist.get_world_size()
        out: Dict[str, Value] = {}
        if self._communicates():
            out["moe/a2a_exposed_s"] = float(sums[-4]) / world / max(steps, 1)
        if loads is not None:
            out.update(load_metrics(loads, self._row_labels(loads)))
            out.update(self._rank_loads(loads, peak))
        differ, total = 0.0, 0.0
        for slot, i in enumerate(self.drifting):
            d, n = float(sums[2 * slot]), float(sums[2 * slot + 1])
            if n > 0:
                out[f"moe/{self.labels[i]}/routing_drift"] = d / n
                differ, total = differ + d, total + n
        if total > 0:
            out["moe/routing_drift"] = differ / total
        if sums[-1] > 0:
            out["moe/indexer_kl"] = float(sums[-2] / sums[-1])
        if sums[-3] > 0:
            terms = sums[self._aux : self._aux + len(self.layers)] / sums[-3]
            out.update({f"moe/{label}/aux_loss": float(t) for label, t in zip(self.labels, terms)})
            out["moe/aux_loss"] = float(terms.sum())
        return out

    def _dispatches(self) -> list:
        """The MoE layers' dispatchers that communicate (``megatron.expert_dispatch``: they count the seconds
        spent blocked on their all-to-alls)."""
        return [layer.dispatch for _, layer in self.layers if hasattr(getattr(layer, "dispatch", None), "pop_waited")]

    def _communicates(self) -> bool:
        return bool(self._dispatches())

    def _pop_waited(self) -> float:
        return sum(d.pop_waited() for d in self._dispatches())

    def _rank_loads(self, loads: torch.Tensor, peak: Optional[torch.Tensor] = None) -> Dict[str, Value]:
        """``rank_load_metrics`` of ``loads`` (or, given ``peak`` ``[L, ep]``, each rank's worst step), warning
        once per layer and rank past the capacity factor."""
        labels = self._row_labels(loads)
        if loads.shape[1] % self.ep_size:
            return {}
        every = rank_loads(loads, self.ep_size) if peak is None else peak
        out = _rank_share_metrics(every, labels)
        if self.capacity_factor is None:
            return out
        for label, shares in zip(labels, every):
            for rank, share in enumerate(shares.tolist()):
                if share > self.capacity_factor and (label, rank) not in self.warned:
                    self.warned.add((label, rank))
                    self.warn(
                        f"warning: moe/{label}: expert-parallel rank {rank} of {self.ep_size} received "
                        f"{share:.2f}x its balanced share of the token copies, above parallel.capacity_factor "
                        f"{self.capacity_factor:g} that moe-plugin plan sizes its all-to-all buffers and "
                        "expert activations for; a planned layout may run out of memory (reported once per "
                        "layer and rank; see docs/router-balance.md)"
                    )
        return out

    def _row_labels(self, loads: torch.Tensor) -> List[str]:
        return self.labels if len(self.labels) == loads.shape[0] else [f"moe{i}" for i in range(loads.shape[0])]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def global_parameter_counts(model: nn.Module, ep_size: int) -> Tuple[int, int]:
    """(trainable, total) element counts of the whole model: ZeRO-3 partitions count their full size, and this
    rank's expert parameters and adapters (megatron's mark ``allreduce = False``) count ``ep_size`` times, since
    each expert-parallel rank holds a different ``1 / ep_size`` of the experts."""
    trainable = total = 0
    for p in model.parameters():
        n = full_numel(p) * (ep_size if getattr(p, "allreduce", True) is False else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def _outermost_models(model: nn.Module) -> List[nn.Module]:
    """The outermost modules whose forward returns ``indexer_loss`` (this project's Hugging Face models)."""
    from ...models.modeling import MoEPluginPreTrainedModel

    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():  # parents come before their children
        inside = any(p == "" or name.startswith(p + ".") for p, _ in found)
        if isinstance(module, MoEPluginPreTrainedModel) and not inside:
            found.append((name, module))
    return [m for _, m in found]
