"""``plan_recipe``: a recipe and a layout in, one rank's memory, the step's tokens, FLOPs and all-to-all bytes,
and the answers to "does it fit", "how few devices" and "which knob buys how much" out (docs/planner.md)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Optional

from ..config import require
from ..layers.recompute import MODES, check_mode
from .layout_activations import activations_of
from .counts import ModelCounts, count_model
from ..limits import LIMITS, check_limit, parse_bytes  # noqa: F401 - parse_bytes: where callers found it
from .packing import document_lengths
from .memory import (
    Layout,
    MemoryPlan,
    devices_from_ds_config,
    min_devices,
    plan_memory,
    read_ds_config,
    zero3_at,
    zero_settings,
)
from .vision import image_grid
from .context_parallel import check_context_parallel, kda_exchange, smallest_context

__all__ = ["Plan", "plan_recipe", "devices_from_ds_config", "CPU_OVERHEAD_BYTES", "GPU_OVERHEAD_BYTES", "parse_bytes"]

# the framework's own memory, by the kernels planned (not by the device's size: a small GPU has a CUDA context too)
GPU_OVERHEAD_BYTES = 3 * 2**30  # CUDA context, NCCL buffers, allocator fragmentation: an assumption
CPU_OVERHEAD_BYTES = 0.0  # measured per launch by moe_plugin.testing.plan_measure (the calibration layout)
MILLION_CONTEXT = 1 << 20


@dataclass
class Plan:
    recipe: str
    layout: Layout
    memory: MemoryPlan
    device_memory: Optional[float]
    fits: Optional[bool]
    counts: Dict[str, dict]
    tokens_per_step: int
    flops_per_step: float
    all_to_all_bytes_per_layer_step: float
    million_context: Dict[str, float]
    knobs: Dict[str, float] = field(default_factory=dict)
    min_devices: Optional[int] = None
    kinds_per_layer: Dict[str, float] = field(default_factory=dict)  # saved bytes of one layer of each kind
    modes: Dict[str, float] = field(default_factory=dict)  # the peak with each activation checkpointing mode
    # per layer per rank under context parallelism: KDA's exchange (sent, held), MLA's gathered keys
    context_exchange: Dict[str, float] = field(default_factory=dict)
    context_search: Dict[str, object] = field(default_factory=dict)  # context_parallel="auto": the search

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        return d


def _flops(counts: ModelCounts, mc, layout: Layout, tokens: int) -> float:
    """Matrix FLOPs of one step: 2 per active weight per token forward, 2 more backward for the activation
    gradients (the frozen base computes no weight gradients), 2 more with recomputation; attention's own
    products (KDA's chunk and state terms, MLA's scores) likewise."""
    experts = counts.kinds["experts"].numel
    active = counts.total_numel - experts - counts.kinds["vision"].numel + experts * mc.moe.top_k / mc.moe.num_experts
    active -= counts.kinds["embeddings"].numel / 2  # the input embedding is a lookup
    passes = 4 + (2 if layout.checkpointing != "off" else 0)
    k, m = mc.kda, mc.mla
    kda_layers = sum(t == "kda" for t in mc.layer_types)
    mla_layers = len(mc.layer_types) - kda_layers
    keys = min(m.index_topk, layout.seq_len / 2) if m.use_indexer else layout.seq_len / 2
    attn = kda_layers * 4 * k.num_heads * k.head_dim * (
        k.chunk_size + k.head_dim
    ) + mla_layers * 2 * keys * m.num_heads * (m.qk_head_dim + m.v_head_dim)
    return tokens * (active * passes + attn * passes / 2)


def plan_recipe(
    recipe,
    devices: Optional[int] = None,
    device_memory: Optional[float] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    checkpointing: Optional[str] = None,
    expert_format: Optional[str] = None,
    capacity: Optional[float] = None,
    overhead_bytes: Optional[float] = None,
    cache: Optional[dict] = None,
    knobs: bool = False,
    images: Optional[int] = None,
    image_size: int = 896,
    kernels: str = "cpu",
    from_checkpoint: Optional[bool] = None,
    context_parallel=None,
    summaries: bool = True,
    sharding: Optional[str] = None,
) -> Plan:
    """Plan ``recipe`` (a validated ``Recipe``) at a layout; arguments left ``None`` come from the recipe and
    its DeepSpeed config (``devices`` from its ``train_batch_size``; ``images``, pictures per micro-batch
    through the vision tower: one per row when the recipe trains on images, else none; ``kernels``: whose
    saved sets, ``"cpu"`` as this machine runs or ``"gpu"`` as CUDA would (``ops.backend.planning_for``);
    ``checkpointing``: the activation checkpointing mode (``layers.recompute.MODES``), by default the recipe's
    ``schedule.activation_checkpointing``; ``capacity``: the dispatch's capacity factor, by default the
    recipe's ``parallel.capacity_factor`` (the
    factor the trainer compares each EP rank's measured load with); ``from_checkpoint``: the base streams in per
    rank, as a ``from_pretrained`` base does, even when the recipe
    names a preset, whose whole-rank build is otherwise planned; ``overhead_bytes``: the framework's own
    memory, by default ``GPU_OVERHEAD_BYTES`` with GPU kernels and ``CPU_OVERHEAD_BYTES`` with CPU ones;
    ``context_parallel``: ranks per row, by default the recipe's ``parallel.context_parallel_size``
    (plan/context_parallel.py), or ``"auto"``: the smallest power of two dividing the devices and the row at
    which the plan fits ``device_memory``, planned at it, the search in ``Plan.context_search``).
    ``cache`` keeps counts and meta-measured activation models between calls (keyed by the model's
    structure). ``summaries``: also plan one 1 M-token row and every checkpointing mode (``Plan.million_context``,
    ``Plan.modes``); False plans the layout alone, the same peak in a fraction of the time. ``sharding``: the
    engine, ``"zero3"`` or ``"fsdp2"`` (by default the recipe's ``parallel.sharding``; FSDP2 reads nothing of the
    DeepSpeed config but its ``train_batch_size``)."""
    return _plan(
        recipe,
        devices,
        device_memory,
        micro_batch,
        seq_len,
        checkpointing,
        expert_format,
        capacity,
        overhead_bytes,
        cache,
        knobs,
        images,
        image_size,
        kernels,
        from_checkpoint,
        context=summaries,
        context_parallel=context_parallel,
        sharding=sharding,
    )


def _plan(
    recipe,
    devices,
    device_memory,
    micro_batch,
    seq_len,
    checkpointing,
    expert_format,
    capacity,
    overhead_bytes,
    cache,
    knobs,
    images,
    image_size,
    kernels,
    from_checkpoint,
    context: bool,
    context_parallel=None,
    sharding=None,
) -> Plan:
    """``plan_recipe``; ``context=False`` leaves out the 1M-token context (``million_context`` empty), which
    costs two meta forwards of every layer kind at 8k and 16k tokens, for a plan read only for its peak."""
    from ..recipe.resolved_model import base_hf_config
    from ..training.backends.images import wants_images

    s = recipe.schedule
    if checkpointing is None:
        checkpointing = s.activation_checkpointing
    check_mode(checkpointing, "--checkpointing")
    # a size given here is named as its flag; one left to the recipe, as the recipe's field
    micro_field = "--micro-batch" if micro_batch is not None else "schedule.micro_batch_size"
    seq_len_field = "--seq-len" if seq_len is not None else "data.seq_len"
    micro_batch = s.micro_batch_size if micro_batch is None else micro_batch
    seq_len = recipe.data.seq_len if seq_len is None else seq_len
    check_limit(micro_batch, "micro_batch", micro_field)
    check_limit(seq_len, "seq_len", seq_len_field, least=2)
    check_limit(s.gradient_accumulation_steps, "grad_accum", "schedule.gradient_accumulation_steps")
    ds = read_ds_config(recipe.deepspeed)
    devices_field = "--devices" if devices is not None else "train_batch_size of the recipe's DeepSpeed config"
    if devices is None:
        devices = devices_from_ds_config(ds, micro_batch, s.gradient_accumulation_steps)
    require(
        devices is not None,
        "--devices",
        "the recipe's DeepSpeed config pins no train_batch_size; give the device count, e.g. --devices 128",
    )
    check_limit(devices, "devices", devices_field)
    if device_memory is not None:
        check_limit(device_memory, "device_memory", "--device-memory")
    capacity_field = "--capacity" if capacity is not None else "parallel.capacity_factor"
    capacity = recipe.parallel.capacity_factor if capacity is None else capacity
    check_limit(capacity, "capacity", capacity_field)
    check_limit(image_size, "image_size", "--image-size")
    ep = recipe.parallel.expert_parallel_size
    require(
        devices % ep == 0,
        "--devices",
        f"{devices} is not a multiple of parallel.expert_parallel_size ({ep}); use a multiple of {ep}",
    )
    require(images is None or isinstance(images, int), "--images", f"must be a whole number, got {images!r}")
    require(kernels in ("cpu", "gpu"), "--kernels", f"must be 'cpu' or 'gpu', got {kernels!r}")
    cp_field = "--context-parallel" if context_parallel is not None else "parallel.context_parallel_size"
    cp = recipe.parallel.context_parallel_size if context_parallel is None else context_parallel
    auto = cp == "auto"
    require(
        not auto or device_memory is not None,
        "--context-parallel",
        "auto picks the smallest size that fits the device: give --device-memory, e.g. 141GB",
    )
    if not auto:
        check_context_parallel(cp, devices, seq_len, cp_field, devices_field, seq_len_field)
    overrides = dict(recipe.model.overrides)
    if expert_format is not None:
        overrides["expert_format"] = expert_format
    section = recipe.model.model_copy(update={"overrides": overrides})
    cfg = base_hf_config(section)
    mc = cfg.to_model_config()
    require(
        mc.moe.num_experts % ep == 0,
        "parallel.expert_parallel_size",
        f"{ep} does not divide the model's {mc.moe.num_experts} experts",
    )
    sharding = recipe.parallel.sharding if sharding is None else sharding
    require(sharding in ("zero3", "fsdp2"), "--sharding", f"must be 'zero3' or 'fsdp2', got {sharding!r}")
    zero3 = zero3_at(ds, devices, sharding)
    pb = 2 if s.precision == "bf16" else 4
    if images is None:
        images = micro_batch if wants_images(recipe, mc) else 0
    check_limit(images, "images", "--images", least=0)
    require(
        images == 0 or mc.vision is not None,
        "--images",
        f"the model has no vision tower, so it takes no pictures; drop --images (got {images})",
    )
    if images:
        h, w = image_grid(image_size, mc.vision.patch_size, mc.vision.merge_size, mc.vision.kind)
        per_image = h * w // mc.vision.merge_size**2
        require(
            images * per_image <= micro_batch * seq_len,
            "--images",
            f"{images} pictures of {image_size} px fill {images * per_image} image tokens, more than the "
            f"micro-batch's {micro_batch} x {seq_len}; use fewer or smaller pictures (--image-size) or "
            "longer rows",
        )
    cache = {} if cache is None else cache
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), repr(recipe.lora), pb, images > 0)
    if ("counts",) + key not in cache:
        cache[("counts",) + key] = count_model(cfg, recipe.lora, precision_bytes=pb, images=images > 0)
    counts = cache[("counts",) + key]
    docs_key = ("documents", repr(recipe.data), recipe.seed, seq_len)
    if docs_key not in cache:
        cache[docs_key] = document_lengths(recipe, seq_len, seq_len_field)
    act = activations_of(
        mc, recipe.lora, cache.setdefault(("meta",) + key, {}), cache[docs_key], cache.setdefault(("layers",), {})
    )
    if overhead_bytes is None:
        overhead_bytes = GPU_OVERHEAD_BYTES if kernels == "gpu" else CPU_OVERHEAD_BYTES
    layout = Layout(
        devices=devices,
        ep=ep,
        zero3=zero3,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_accum=s.gradient_accumulation_steps,
        checkpointing=checkpointing,
        capacity=capacity,
        precision_bytes=pb,
        zero=zero_settings(ds),
        preset_build=not from_checkpoint and recipe.model.from_pretrained is None,
        overhead_bytes=overhead_bytes,
        images=images,
        image_size=image_size,
        kernels=kernels,
        context=1 if auto else cp,
        overlap_chunks=recipe.parallel.moe_overlap_chunks,
        sharding=sharding,
        reshard_after_forward=recipe.parallel.reshard_after_forward,
    )
    search: Dict[str, object] = {}
    if auto:
        # full that does not fit may fit keeping only the MoE's routing (full_routing: the same recompute of
        # everything else), which the search then names for the recipe to set
        modes = [checkpointing] + (["full_routing"] if checkpointing == "full" else [])
        search = smallest_context(
            lambda c, d, mode: (
                plan_memory(counts, mc, act, replace(_at_devices(layout, d, c, ds), checkpointing=mode)).peak
            ),
            devices,
            seq_len,
            ep,
            device_memory,
            LIMITS["devices"],
            modes,
        )
        search.update(seq_len=seq_len, device_memory=device_memory, modes=modes)
        if search["cp"] is not None:
            layout = replace(_at_devices(layout, search["devices"], search["cp"], ds), checkpointing=search["mode"])
        # none fitting, the table shows the lowest peak the search found, and the search names its largest term
        if search["cp"] is None and search["floor"] is not None:
            floor_cp, floor_devices = search["floor"]
            floor_mode = search["tried"][floor_cp][1]
            layout = replace(_at_devices(layout, floor_devices, floor_cp, ds), checkpointing=floor_mode)
            search["stopped_by"] = max(plan_memory(counts, mc, act, layout).terms().items(), key=lambda t: t[1])
    memory = plan_memory(counts, mc, act, layout)
    devices, cp = layout.devices, layout.context
    tokens = devices * micro_batch * s.gradient_accumulation_steps * seq_len // cp  # CP ranks share rows
    n = micro_batch * seq_len // cp
    a2a = (
        (4 * n * mc.moe.top_k * capacity * mc.moe.expert_dim * pb * (ep - 1) / ep * s.gradient_accumulation_steps)
        if ep > 1
        else 0.0
    )
    million = _million_context(counts, mc, act, layout) if context else {}
    kinds = {k: {"parameters": c.numel, "bytes": c.nbytes} for k, c in counts.kinds.items()}
    plan = Plan(
        recipe=getattr(recipe, "source", "") or "",
        layout=layout,
        memory=memory,
        device_memory=device_memory,
        fits=None if device_memory is None else memory.peak <= device_memory,
        counts=kinds,
        tokens_per_step=tokens,
        flops_per_step=_flops(counts, mc, layout, tokens),
        all_to_all_bytes_per_layer_step=a2a,
        million_context=million,
        kinds_per_layer=act(layout).kinds,
        context_exchange=_exchange(mc, layout),
        context_search=search,
    )
    if context:  # the step peak of every checkpointing mode: which one fits
        plan.modes = {mode: plan_memory(counts, mc, act, replace(layout, checkpointing=mode)).peak for mode in MODES}
    if knobs:
        plan.knobs = _knobs(recipe, plan, counts, mc, act, cache, capacity, checkpointing, expert_format, ds)
        if device_memory:
            plan.min_devices = min_devices(counts, mc, act, layout, device_memory, ds)
    return plan


def _at_devices(layout: Layout, devices: int, cp: int, ds) -> Layout:
    return replace(layout, devices=devices, context=cp, zero3=zero3_at(ds, devices, layout.sharding))


def _exchange(mc, layout: Layout) -> Dict[str, float]:
    """Per layer per rank under CP: KDA's exchange, and the gated-MLA keys the last rank gathers (the latent
    and the index keys of the whole row; the one chunk of keys and values it expands at a time is in its
    activations)."""
    cp = layout.context
    if cp <= 1:
        return {}
    m, pb = mc.mla, layout.precision_bytes
    kda = kda_exchange(mc, cp, pb)
    width = m.kv_lora_rank + m.qk_rope_head_dim + (m.index_head_dim if m.use_indexer else 0)
    rows = layout.micro_batch * layout.seq_len
    return {
        "KDA exchange sent per layer": kda["sent"],
        "KDA exchange held per layer (own pair)": kda["held"],
        "MLA gathered latent + index keys per layer (last rank)": float(rows * width * pb),
    }


def _million_context(counts, mc, act, layout: Layout) -> Dict[str, float]:
    million = {}
    cp = layout.context if MILLION_CONTEXT % layout.context == 0 else 1
    for mode in MODES:
        big = replace(layout, micro_batch=1, seq_len=MILLION_CONTEXT, checkpointing=mode, context=cp)
        million[f"checkpointing {mode}"] = plan_memory(counts, mc, act, big).peak
    kda_state = sum(t == "kda" for t in mc.layer_types) * mc.kda.num_heads * mc.kda.head_dim**2 * 4
    million["KDA state per sequence (all layers, fp32)"] = float(kda_state)
    one_row = replace(layout, micro_batch=1, checkpointing="off", context=1)
    million["activations per token (no checkpointing)"] = act(one_row).total / (layout.seq_len)
    return million


def _knobs(recipe, plan, counts, mc, act, cache, capacity, checkpointing, expert_format, ds) -> Dict[str, float]:
    """Peak bytes saved (positive) or added (negative) by one change at a time."""
    layout, base = plan.layout, plan.memory.peak
    out: Dict[str, float] = {}
    knob_modes = [mode for mode in MODES if mode != checkpointing]
    variants = {f"checkpointing {mode}": replace(layout, checkpointing=mode) for mode in knob_modes}
    variants.update(
        {
            "micro-batch 1": replace(layout, micro_batch=1),
            f"micro-batch {layout.micro_batch * 2}": replace(layout, micro_batch=layout.micro_batch * 2),
        }
    )
    e = mc.moe.num_experts
    for ep in (layout.ep // 2, layout.ep * 2):
        if ep >= 1 and e % ep == 0 and layout.devices % ep == 0 and ep != layout.ep:
            variants[f"EP {ep}"] = replace(layout, ep=ep)
    variants[f"{layout.devices * 2} devices"] = replace(
        layout, devices=layout.devices * 2, zero3=zero3_at(ds, layout.devices * 2, layout.sharding)
    )
    for name, variant in variants.items():
        out[name] = base - plan_memory(counts, mc, act, variant).peak
    other = "dense" if (expert_format or mc.moe.expert_format) != "dense" else "mxfp4"
    alt = _plan(
        recipe,
        layout.devices,
        None,
        layout.micro_batch,
        layout.seq_len,
        checkpointing,
        other,
        capacity,
        layout.overhead_bytes,
        cache,
        False,
        layout.images,
        layout.image_size,
        layout.kernels,
        not layout.preset_build,
        context=False,
        context_parallel=layout.context,
        sharding=layout.sharding,
    )
    out[f"experts {other}"] = base - alt.memory.peak
    return out
