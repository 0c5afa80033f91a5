"""One rank's memory for a recipe at a layout (docs/planner.md): the pieces and the peak.

Inputs are the counts of the meta-built model (``counts.py``), the activations its layers save on the meta device
(``activations.py``) and the DeepSpeed config's ZeRO-3 knobs. Every number is bytes on one rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, Optional

from ..training.ds_config import zero_stage
from .activations import ActivationPlan
from .counts import ModelCounts, rank_share

__all__ = ["Layout", "MemoryPlan", "plan_memory", "zero3_at", "ZERO3_DEFAULTS"]

# DeepSpeed 0.19.8's defaults for the keys the planner reads (runtime/zero/config.py)
ZERO3_DEFAULTS = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "reduce_bucket_size": 500_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "contiguous_gradients": True,
    # F.linear replaced by DeepSpeed's for the process (compat.deepspeed.linear_as_trained): saves every input
    "memory_efficient_linear": True,
}


@dataclass
class Layout:
    """What one step looks like: ``devices`` ranks, EP ``ep``, ZeRO-3 or not, ``micro_batch`` rows of
    ``seq_len`` tokens per rank, activation checkpointing, capacity factor of the expert dispatch, and
    ``images`` square pictures of ``image_size`` pixels per micro-batch through the vision tower."""

    devices: int
    ep: int
    zero3: bool
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    checkpointing: str = "off"  # layers.recompute's mode (MODES): "off", "selective", "full", "full_routing"
    capacity: float = 1.25
    precision_bytes: int = 2  # bf16 (2) or fp32 (4)
    zero: Dict[str, int] = field(default_factory=lambda: dict(ZERO3_DEFAULTS))
    preset_build: bool = False  # a preset base is built whole on each rank before the engine partitions it
    overhead_bytes: float = 0.0  # the framework's own memory (a measured constant on CPU; an assumption on GPU)
    images: int = 0
    image_size: int = 896
    kernels: str = "cpu"  # whose saved sets: the CPU's torch paths or the GPU kernels (ops.backend.planning_for)
    # context-parallel ranks per row (plan/context_parallel.py): each holds seq_len / context tokens of a row;
    # the world is data x context, and ZeRO-3 shards over all of it (so the shares below divide by the world)
    context: int = 1
    # the expert-parallel dispatch's overlapped chunks (parallel.moe_overlap_chunks): at most one chunk's
    # dispatch and one chunk's return are in flight at once, each a send and a receive buffer of rows / N
    overlap_chunks: int = 1
    # parallel.sharding: "zero3" (DeepSpeed, ``zero3`` says whether it partitions) or "fsdp2" (torch's
    # fully_shard per decoder layer and the root over every rank, the routed experts whole on their EP rank;
    # ``reshard_after_forward``: a layer's gathered parameters freed after its forward, else kept to its backward)
    sharding: str = "zero3"
    reshard_after_forward: bool = True


@dataclass
class MemoryPlan:
    base: Dict[str, float]  # at rest, per kind (experts, dense, embeddings, vision)
    adapters: Dict[str, float]  # weights, gradients, optimizer states
    gathered: float  # ZeRO-3 parameters gathered at once (current module, prefetch, kept for reuse)
    buckets: float  # gradient reduce bucket
    activations: float  # saved for backward over the whole micro-batch
    activations_by_segment: Dict[str, float]
    transient: float  # working tensors at the step's peak beyond the saved ones (a layer's forward, logit grads)
    dispatch: float  # expert-parallel all-to-all send and receive buffers in flight (per chunk: Layout)
    build_peak: float  # while the model is built and partitioned
    overhead: float
    step_peak: float
    peak: float
    context: Dict[str, float] = field(default_factory=dict)
    sharding: str = "zero3"

    def to_dict(self) -> dict:
        return asdict(self)

    def terms(self) -> Dict[str, float]:
        """The step peak's terms by the names the plan's table gives them: they add up to ``step_peak`` plus
        ``overhead``."""
        return {
            **{f"frozen base: {kind}": v for kind, v in self.base.items()},
            **{f"adapters: {kind}": v for kind, v in self.adapters.items()},
            GATHERED_TERM[self.sharding]: self.gathered,
            "gradient reduce bucket": self.buckets,
            **{f"activations: {segment}": v for segment, v in self.activations_by_segment.items()},
            "working tensors at the peak (forward / logits)": self.transient,
            "expert all-to-all buffers": self.dispatch,
            "framework overhead (constant)": self.overhead,
        }


# the gathered-parameters line of the plan's table, by engine
GATHERED_TERM = {
    "zero3": "ZeRO-3 gathered parameters (live + prefetch)",
    "fsdp2": "FSDP2 gathered parameters (root + layers in flight)",
}


def _local_full_numel(counts: ModelCounts, ep: int) -> float:
    """Elements of this rank's model gathered whole: every non-expert tensor and its own E / EP experts."""
    experts = counts.kinds["experts"].numel + counts.expert_adapter_numel
    return counts.total_numel - experts + experts / ep


def _local_full_bytes(counts: ModelCounts, ep: int, precision_bytes: int) -> float:
    rest = sum(c.nbytes for k, c in counts.kinds.items() if k not in ("experts", "adapters"))
    return (
        rest
        + counts.kinds["experts"].nbytes / ep
        + (counts.adapter_numel - counts.expert_adapter_numel + counts.expert_adapter_numel / ep) * precision_bytes
    )


def plan_memory(
    counts: ModelCounts, mc, activations_of: Callable[["Layout"], ActivationPlan], layout: Layout
) -> MemoryPlan:
    """The per-rank memory of ``layout`` (see ``MemoryPlan``'s fields); ``activations_of(layout)`` gives the
    meta-measured ``ActivationPlan`` of a layout (``activations.plan_activations``)."""
    L, pb = layout, layout.precision_bytes
    world, ep = L.devices, L.ep
    edp = world // ep
    z = L.zero
    fsdp2 = L.sharding == "fsdp2"
    share = rank_share(counts, world, ep, L.zero3 or fsdp2)
    if fsdp2:  # the routed experts are FSDP2's ignored_params: whole on their EP rank (training/engines/fsdp2.py)
        share["experts"] = counts.kinds["experts"].nbytes / ep
    base = {kind: share[kind] for kind in ("experts", "dense", "embeddings", "vision")}
    dense_ad = counts.adapter_numel - counts.expert_adapter_numel
    if fsdp2:
        ad_local = dense_ad / world + counts.expert_adapter_numel / ep
    elif L.zero3:
        ad_local = dense_ad / world + counts.expert_adapter_numel / ep / edp
    else:
        ad_local = dense_ad + counts.expert_adapter_numel / ep
    # an fp32 master copy beside bf16 weights (DeepSpeed's); FSDP2 stores the trainable shards fp32 and
    # gathers them in bf16 for compute (MixedPrecisionPolicy)
    master = 4 if pb == 2 and not fsdp2 else 0
    weights = ad_local * (4 if fsdp2 else pb)
    adapters = {"weights": weights, "gradients": ad_local * 4, "optimizer": ad_local * (8 + master)}
    full_local = _local_full_numel(counts, ep)
    if fsdp2:
        gathered, buckets = _fsdp2_gathered(counts, L)
    elif L.zero3:
        layer_max = max([n - e + e / ep for n, e in zip(counts.layer_numel, counts.layer_expert_numel)] or [0])
        if full_local <= z["stage3_max_reuse_distance"]:
            live = full_local  # every parameter is reused within the distance: all stay gathered after step 1
        else:
            live = min(
                full_local,
                layer_max
                + min(z["stage3_prefetch_bucket_size"], z["stage3_max_live_parameters"])
                + z["stage3_max_reuse_distance"],
            )
        full_bytes = _local_full_bytes(counts, ep, pb)
        if edp == 1:  # experts partitioned over one rank: DeepSpeed's NoGatherHandle uses the partition itself
            full_bytes -= counts.kinds["experts"].nbytes / ep + counts.expert_adapter_numel / ep * pb
        gathered = live / full_local * full_bytes
        # contiguous_gradients: one torch.empty(reduce_bucket_size) per trainable dtype, allocated when the
        # engine starts and kept (stage3.py); without it the bucket holds at most the trainable gradients
        trainable_local = dense_ad + counts.expert_adapter_numel / ep
        buckets = (
            z["reduce_bucket_size"] if z["contiguous_gradients"] else min(z["reduce_bucket_size"], trainable_local)
        ) * pb
    else:
        gathered, buckets = 0.0, 0.0
    act = activations_of(L)
    head_peak = act.total + act.head_working  # backward's start: everything saved, the logit gradients
    if L.checkpointing != "off":
        activations, by_segment, transient = _checkpointed(act, L.checkpointing)
    else:
        activations = act.total
        by_segment = dict(act.by_segment)
        # the step's peak is inside some layer's forward (what it and the layers before saved, plus its own
        # working tensors) or at the start of backward; past that start each layer's backward frees what it
        # saved as it makes its gradients (docs/planner.md)
        held = act.by_segment.get("vision", 0.0)  # the vision encoder runs first
        forward_peak = held + act.vision_working
        for saved, working in zip(act.per_layer, act.working):
            held += saved
            forward_peak = max(forward_peak, held + working)
        transient = max(forward_peak, head_peak) - activations
    n = L.micro_batch * L.seq_len // L.context  # this rank's tokens: its slice of each row
    rows = n * mc.moe.top_k * L.capacity  # the copies this rank's experts receive
    in_flight = min(1.0, 2.0 / L.overlap_chunks)  # N = 1: the whole send and receive; N >= 2: 2 chunks of 1 / N
    dispatch = (2 * rows * in_flight * mc.moe.expert_dim * pb) if ep > 1 else 0.0
    resting = sum(base.values()) + sum(adapters.values())
    step_peak = resting + gathered + buckets + activations + transient + dispatch
    build_peak = 0.0
    if L.preset_build:  # whole local model in the build dtype (fp32), plus the partitions the engine cuts
        build_peak = _local_full_bytes(counts, ep, pb) * (4 / pb) + resting
    overhead = L.overhead_bytes
    peak = max(step_peak, build_peak) + overhead
    context = {
        "tokens_per_rank_micro_batch": n,
        "local_experts": mc.moe.num_experts // ep,
        "edp": edp,
        "context_parallel": L.context,
        "data_parallel": world // L.context,
        "zero3_shards": world if L.zero3 or fsdp2 else 1,  # data x context (FSDP2's dense mesh too)
    }
    return MemoryPlan(
        base=base,
        adapters=adapters,
        gathered=gathered,
        buckets=buckets,
        activations=activations,
        activations_by_segment=by_segment,
        transient=transient,
        dispatch=dispatch,
        build_peak=build_peak,
        overhead=overhead,
        step_peak=step_peak,
        peak=peak,
        context=context,
        sharding=L.sharding,
    )


def _fsdp2_gathered(counts: ModelCounts, L: Layout) -> tuple:
    """FSDP2's parameters gathered at once and its reduce-scatter input, bytes: the root's own (embedding, final
    norm, output layer, vision tower: gathered from forward to backward) and, per decoder layer without its routed
    experts, the largest in use and the next one gathered ahead of it (``reshard_after_forward``), or every
    layer (kept from its forward to its backward otherwise), in the compute dtype; the largest layer's trainable
    gradient unsharded in fp32 before its reduce-scatter."""
    pb = L.precision_bytes
    layers = [n - e for n, e in zip(counts.layer_numel, counts.layer_expert_numel)]
    root = counts.total_numel - sum(counts.layer_numel)
    in_flight = (2 * max(layers or [0])) if L.reshard_after_forward else sum(layers)
    dense_trainable = counts.adapter_numel - counts.expert_adapter_numel
    if dense_trainable == 0:  # full training: every dense parameter
        dense_trainable = counts.total_numel - sum(counts.layer_expert_numel)
    per_layer = dense_trainable / max(1, len(layers))
    return (root + in_flight) * pb, per_layer * 4


def _checkpointed(act: ActivationPlan, mode: str):
    """(saved bytes, by segment, working bytes at the peak beyond them) with activation checkpointing in
    ``mode``: every layer keeps its input and what ``act.checkpointed`` (plan/checkpointing.py) says it keeps.
    The peak is at the backward's start (the logit gradients) or inside some layer's forward or backward (its
    own most at once, recomputes included, beside what the layers before it keep)."""
    ck = act.checkpointed
    if ck is None or ck.mode != mode:
        raise ValueError(
            f"checkpointing: the activations were planned for {getattr(ck, 'mode', 'off')!r}, not "
            f"{mode!r}; plan them with the layout's mode"
        )
    vision = act.by_segment.get("vision", 0.0)
    per_input = ck.layer_inputs / max(1, len(ck.kept))
    activations = vision + ck.layer_inputs + sum(ck.kept) + act.head
    by_segment = {"layer inputs": ck.layer_inputs, "kept by the layers": sum(ck.kept), "head": act.head}
    if vision:
        by_segment = {"vision": vision, **by_segment}
    held, peak = vision, max(vision + act.vision_working, activations + act.head_working)
    for kept, layer_peak in zip(ck.kept, ck.peaks):
        peak = max(peak, held + per_input + layer_peak)
        held += per_input + kept
    return activations, by_segment, peak - activations


def read_ds_config(path: Optional[str]) -> Optional[dict]:
    """The recipe's DeepSpeed config (``recipe.deepspeed``) as a dict, or None without one."""
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def devices_from_ds_config(ds: Optional[dict], micro_batch: int, accum: int) -> Optional[int]:
    """The device count a DeepSpeed config pins through ``train_batch_size`` (= micro x accum x world)."""
    tbs = (ds or {}).get("train_batch_size")
    if isinstance(tbs, int) and not isinstance(tbs, bool) and tbs % (micro_batch * accum) == 0:
        return tbs // (micro_batch * accum)
    return None


def zero3_at(ds_config: Optional[dict], devices: int, sharding: str = "zero3") -> bool:
    """Whether the trainer partitions with ZeRO-3 at ``devices`` ranks: the engine is DeepSpeed's
    (``parallel.sharding`` "zero3") and its config asks for stage 3, or there is more than one rank
    (``training.ds_config``: the default config is ZeRO-3 then, and a given one must be). The one rule for every
    device count the planner plans."""
    return sharding == "zero3" and (zero_stage(ds_config) == 3 or devices > 1)


def zero_settings(ds_config: Optional[dict]) -> Dict[str, int]:
    """The ZeRO-3 knobs the planner reads, from a DeepSpeed config dict (DeepSpeed's defaults otherwise)."""
    zero = dict(ZERO3_DEFAULTS)
    given = (ds_config or {}).get("zero_optimization", {}) or {}
    for key in zero:
        if isinstance(zero[key], bool):
            zero[key] = bool(given.get(key, zero[key]))
        elif isinstance(given.get(key), (int, float)) and not isinstance(given.get(key), bool):
            zero[key] = int(given[key])
    return zero


def min_devices(
    counts, mc, act, layout: Layout, device_memory: float, ds: Optional[dict], limit: int = 8192
) -> Optional[int]:
    """The fewest devices (a multiple of EP and CP) whose per-rank peak fits, the recipe's EP, CP and
    micro-batch kept, each planned as ``plan_recipe`` plans that count (``zero3_at``)."""
    step = math.lcm(layout.ep, layout.context)
    for d in range(step, limit + 1, step):
        at = replace(layout, devices=d, zero3=zero3_at(ds, d, layout.sharding))
        if plan_memory(counts, mc, act, at).peak <= device_memory:
            return d
    return None
