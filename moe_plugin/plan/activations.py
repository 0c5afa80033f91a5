"""Activation memory of one micro-batch: what autograd saves for backward, read off the model's own layers run
at the planned size on the ``meta`` device (docs/planner.md, "Activations").

For each kind of decoder layer the recipe's model has (KDA or gated MLA/DSA attention, latent MoE or dense
MLP) one layer is built on ``meta`` with the recipe's LoRA adapters and dtype, and run forward on meta
inputs ``[B, T, D]`` under ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's storage is
counted once (parameters excluded), attributed to the sublayer that saved it. Nothing is allocated, so the
full-size layer at 4096 or a million tokens costs seconds. The Attention-Residual mixing is run at every
layer's own number of candidates, and the head (the final mixing, norm, ``lm_head`` and the fp32 loss) once.
The routing is the planner's assumption (balanced, times a capacity factor) in the MoE layers' dispatch slot
(``plan/routing.py``); every op runs as it is, the project's own as ``torch.library`` custom ops with fake
kernels, a GPU kernel as its meta stand-in under ``ops.backend.planning_for("cuda")``. The same runs count
the working tensors (``_LiveBytes``, a dispatch mode): the most each layer's forward, and the head's forward +
backward, hold at once beyond what they leave for backward.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..compat.deepspeed import linear_as_trained
from ..ops.backend import planning_for
from .routing import BalancedDispatch, kernels_device, plan_routing
from .saved_bytes import _inputs, _LiveBytes, _run

__all__ = [
    "ActivationPlan",
    "attn_res_candidates",
    "final_candidates",
    "layer_kinds",
    "layer_saved_bytes",
    "packed_boundaries",
    "plan_activations",
]


def attn_res_candidates(layer: int, block_size: int) -> Tuple[int, int]:
    """Candidates at a layer's two mixing points: the embedding, the completed blocks, the partial sum."""
    done = layer // block_size
    starts = layer % block_size == 0
    return 1 + done + (0 if starts else 1), 2 + done


def final_candidates(num_layers: int, block_size: int) -> int:
    return 1 + num_layers // block_size + (1 if num_layers % block_size else 0)


def layer_kinds(mc) -> List[Tuple[str, bool]]:
    """Per decoder layer its kind: (attention type ``"kda"``/``"mla"``, whether its MLP is the MoE)."""
    return [(t, mc.is_moe_layer(i)) for i, t in enumerate(mc.layer_types)]


@dataclass
class ActivationPlan:
    """Saved-for-backward bytes of one micro-batch on one rank.

    per_layer: each decoder layer's bytes (its attention + MLP kind, and its AttnRes mixing); by_segment:
    the same summed by segment (``kda``, ``mla``, ``moe``, ``mlp``, ``attn_res``, ``head``); layer_input:
    bytes of one layer's input state (what activation checkpointing keeps per layer).
    """

    per_layer: List[float]
    by_segment: Dict[str, float]
    layer_inputs: float
    head: float
    kinds: Dict[str, float] = field(default_factory=dict)  # one layer of each kind, without mixing
    # beyond what it saves, the most a layer's forward holds at once (tensors it makes and drops), per layer;
    # and the head's forward + backward (the fp32 logit gradients) at the start of backward
    working: List[float] = field(default_factory=list)
    head_working: float = 0.0
    # the vision encoder's working tensors (its saved bytes are by_segment["vision"]); it runs before layer 0
    vision_working: float = 0.0
    checkpointed: Optional[object] = None  # a checkpointing mode's CheckpointedPlan (plan/checkpointing.py)

    @property
    def total(self) -> float:
        return sum(self.by_segment.values())

    @property
    def largest_layer(self) -> float:
        return max(self.per_layer or [0.0])


def _add_lora(module: nn.Module, lora_section) -> None:
    from ..lora import add_lora, lora_config

    for p in module.parameters():
        p.requires_grad_(False)
    if lora_section is not None:
        targets = [
            t
            for t in lora_section.target_modules
            if any(n.split(".")[-1] == t or n.endswith("." + t) for n, _ in module.named_modules())
        ]
        params = [t for t in lora_section.target_parameters if any(n.endswith(t) for n, _ in module.named_parameters())]
        if targets or params:
            # made where the layer is: on meta an adapter costs no allocation and no random draws
            with torch.device(next(module.parameters()).device):
                add_lora(
                    module,
                    lora_config(
                        lora_section.r,
                        lora_section.alpha,
                        targets or lora_section.target_modules,
                        params,
                        lora_section.dropout,
                    ),
                )


def layer_saved_bytes(
    mc,
    index: int,
    lora_section,
    shape,
    dtype,
    cands: int,
    device: str = "meta",
    cu_seqlens: Optional[torch.Tensor] = None,
    working: Optional[list] = None,
    mode: str = "off",
    peak: Optional[list] = None,
    context: Optional[Tuple[int, Tuple[int, ...]]] = None,
    routing: Optional[BalancedDispatch] = None,
) -> Dict[str, int]:
    """Saved-for-backward bytes of decoder layer ``index`` of ``mc`` (with the recipe's adapters) on ``cands`` input
    tensors of ``shape`` ``[B, T, D]``, per segment. ``device="cpu"`` runs it for real (the tests' reference for the
    meta run). ``routing``: the planner's dispatch (``plan/routing.py``) and this rank's experts, which a MoE layer on
    meta needs (it cannot route meta values); None: the layer's own routing. cu_seqlens ``[n+1]`` (a CPU tensor, batch
    1): the packed documents' boundaries, as the trainer passes them. ``working`` (a list): gets the forward's most
    bytes held beyond what it saved (``_run``). ``mode``: the layer's activation checkpointing (``layers.recompute``):
    what it keeps, its input tensors left out (checkpointing keeps them, counted apart); ``peak`` (a list): instead gets
    the most the layer's forward and backward (recomputes included) hold at once beyond its inputs and weights, and
    nothing is counted. ``context`` ``(CP, the row's global document offsets)``: a gated-MLA layer runs as the row's
    last context rank (``plan/context_parallel.py``), its attention on the gathered keys of the whole row, ``shape`` its
    slice."""
    from ..layers.decoder import DecoderLayer
    from ..layers.recompute import set_recompute
    from ..precision import apply_precision

    with torch.device(device):
        layer = DecoderLayer(mc, index)
    if routing is not None:
        plan_routing(layer, routing)
    _add_lora(layer, lora_section)
    # as the trainer holds it (docs/precision.md): everything in the run's dtype, adapters included, but the
    # frozen router and KDA's A_log, dt_bias stay fp32 buffers, so the router's weight.float() is the weight
    # itself and saves no fp32 copy (E x hidden x 4 bytes a MoE layer)
    apply_precision(layer, dtype)
    kind, moe = mc.layer_types[index], mc.is_moe_layer(index)
    tags = {
        layer.input_layernorm: kind,
        layer.self_attn: kind,
        layer.post_attention_layernorm: "moe" if moe else "mlp",
        getattr(layer, "block_sparse_moe", None) or layer.mlp: "moe" if moe else "mlp",
    }
    state = _inputs(shape, cands, dtype, device)
    set_recompute(layer, mode)
    with contextlib.ExitStack() as stack:
        if context is not None and context[0] > 1 and kind == "mla":
            from .context_parallel import context_attention, meta_slice

            cu_seqlens = stack.enter_context(context_attention(layer, meta_slice(*context)))
        return _layer_run(layer, state, cu_seqlens, tags, mc, kind, mode, working, peak)


def _layer_run(layer, state, cu_seqlens, tags, mc, kind, mode, working, peak) -> Dict[str, int]:
    run = lambda: layer(state, cu_seqlens=cu_seqlens)  # noqa: E731
    if peak is not None:  # forward and backward, the mode's recomputes included, as the step runs the layer
        live = _LiveBytes()
        with live:
            outs = [t for t in tree_leaves(run()) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            wrt = list(state) + [p for p in layer.parameters() if p.requires_grad]
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
        peak.append(live.peak)
        return {}
    exclude = state if mode != "off" else ()
    return _run(run, tags, "attn_res" if mc.attn_res and mode == "off" else kind, working, exclude=exclude)


def _mixing_bytes(mc, shape, dtype, cands: int) -> int:
    from ..layers.attn_res import attn_res_point, attn_res_read

    with torch.device("meta"):
        proj, norm = attn_res_point(mc.hidden_size, mc.rms_norm_eps)
    proj, norm = proj.to(dtype).requires_grad_(False), norm.to(dtype).requires_grad_(False)
    state = _inputs(shape, cands, dtype)
    return sum(_run(lambda: attn_res_read(list(state), proj, norm), {proj: "m", norm: "m"}, "m").values())


def _head_bytes(mc, shape, dtype, lora_section) -> Tuple[int, int]:
    """The head's saved bytes, and the most its forward and backward hold beyond them (the backward starts
    here: the loss's fp32 logit gradients)."""
    from ..layers.norm import RMSNorm
    from ..ops.losses import causal_lm_loss

    with torch.device("meta"):
        norm, head = RMSNorm(mc.hidden_size, mc.rms_norm_eps), nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
    module = nn.ModuleDict({"norm": norm, "lm_head": head}).to(dtype)
    _add_lora(module, lora_section)
    hidden = _inputs(shape, 1, dtype)[0]
    labels = torch.zeros(shape[:2], dtype=torch.long, device="meta")

    def fn():
        causal_lm_loss(module["lm_head"](module["norm"](hidden)), labels).backward()
        hidden.grad = None

    working: list = []
    saved = sum(_run(fn, {module: "head"}, "head", working).values())
    return saved, working[0]


# Above this many tokens the meta forward's Python loops (KDA's chunks, attention's query blocks) take minutes:
# two runs at RUN_TOKENS and 2 x RUN_TOKENS are extended linearly (every saved tensor is O(T): see docs)
RUN_TOKENS = 4096


def linear_run_tokens(mc) -> int:
    """The shorter of the two run lengths a long micro-batch is extended from (the longer is twice it): about
    ``RUN_TOKENS``, whole KDA chunks and 64-token blocks, and past twice the indexer's top-k, where every query
    keeps k keys and the saved sets grow linearly."""
    step = math.lcm(mc.kda.chunk_size, 64)
    t1 = max(RUN_TOKENS // step, 1) * step
    if mc.mla.use_indexer:
        t1 = max(t1, -(-2 * mc.mla.index_topk // step) * step)
    return t1


def packed_boundaries(batch: int, seq_len: int, documents: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
    """The ``cu_seqlens`` of a micro-batch as the trainer feeds it (``batch`` rows of ``seq_len`` packed into one
    row ``[1, batch * seq_len]``): each row filled with the recipe's document lengths in order, cycled, the
    last one cut at the row's end. None (no documents given): one sequence per row."""
    bounds, lengths = [0], list(documents or [seq_len])
    j = 0
    for _ in range(batch):
        end = bounds[-1] + seq_len
        while bounds[-1] < end:
            bounds.append(min(end, bounds[-1] + max(1, int(lengths[j % len(lengths)]))))
            j += 1
    return torch.tensor(bounds, dtype=torch.int64)


def plan_activations(
    mc,
    lora_section,
    batch: int,
    seq_len: int,
    local_experts: int,
    capacity: float,
    dtype: torch.dtype = torch.bfloat16,
    cache: Optional[dict] = None,
    documents: Optional[Sequence[int]] = None,
    kernels: str = "cpu",
    context: int = 1,
    linear: str = "torch",
) -> ActivationPlan:
    """The ``ActivationPlan`` of ``mc`` (a ``ModelConfig``) for ``batch`` rows of ``seq_len`` tokens on a rank
    holding ``local_experts`` experts, with the recipe's ``lora_section`` (None: no adapters) in ``dtype``.
    documents: the recipe's document lengths in packing order (KDA and the short convolution restart at each
    document and pad it to whole chunks, so short documents cost more); None: one document per row.
    kernels: ``"cpu"`` (the torch paths, as the CPU runs them) or ``"gpu"`` (the KDA kernel CUDA picks,
    ``ops.backend.META_KERNELS``). context: the context-parallel size; ``seq_len`` is then one rank's slice of each
    row, and the gated-MLA layers run as the row's last rank (``plan/context_parallel.py``). linear: ``"zero3"``
    runs the layers with DeepSpeed's ``F.linear`` as a ZeRO-3 run trains them (``compat.deepspeed.linear_as_trained``),
    ``"torch"`` with torch's."""
    cache = {} if cache is None else cache
    documents = tuple(documents) if documents else None
    if batch * seq_len <= 2 * RUN_TOKENS:
        return _plan_activations(
            mc, lora_section, batch, seq_len, local_experts, capacity, dtype, cache, documents, kernels, context, linear
        )
    t1 = linear_run_tokens(mc)
    args = (local_experts, capacity, dtype, cache, documents, kernels, context, linear)
    # under CP the MLA layers' gathered keys are CP x the slice: linear in the slice at a fixed CP too
    a = _plan_activations(mc, lora_section, 1, t1, *args)
    b = _plan_activations(mc, lora_section, 1, 2 * t1, *args)
    f = (batch * seq_len - t1) / t1

    def ext(x, y):
        return x + (y - x) * f

    return ActivationPlan(
        per_layer=[ext(x, y) for x, y in zip(a.per_layer, b.per_layer)],
        by_segment={k: ext(v, b.by_segment[k]) for k, v in a.by_segment.items()},
        layer_inputs=ext(a.layer_inputs, b.layer_inputs),
        head=ext(a.head, b.head),
        kinds={k: ext(v, b.kinds[k]) for k, v in a.kinds.items()},
        working=[ext(x, y) for x, y in zip(a.working, b.working)],
        head_working=ext(a.head_working, b.head_working),
    )


def _plan_activations(
    mc,
    lora_section,
    batch,
    seq_len,
    local_experts,
    capacity,
    dtype,
    cache,
    documents,
    kernels,
    context=1,
    linear="torch",
) -> ActivationPlan:
    cu = packed_boundaries(batch, seq_len, documents)
    shape = (1, batch * seq_len, mc.hidden_size)
    bs = mc.attn_res_block_size
    kinds = layer_kinds(mc)
    per_kind: Dict[Tuple[str, bool], Dict[str, int]] = {}
    work_of: Dict[Tuple[str, bool], int] = {}
    config = _built_from(mc)
    routing = BalancedDispatch(local_experts, capacity)
    with planning_for(kernels_device(kernels)), linear_as_trained(linear == "zero3"):
        for kind in dict.fromkeys(kinds):
            index = kinds.index(kind)
            # a dense-MLP layer is the same at any EP, capacity or expert format: keyed without them; the rows'
            # split (batch, seq_len) places the documents' cuts
            routed = (config, local_experts, capacity) if kind[1] else _built_from(mc, routed=False)
            cp = context if kind[0] == "mla" and context > 1 else 1  # only MLA layers see the whole row
            key = ("layer", kind, routed, batch, seq_len, dtype, repr(lora_section), documents, kernels, cp, linear)
            if key not in cache:
                # the layer's own mixing is measured apart (it depends on the layer's place in the stream)
                cands = len(_state_shape(index, mc))
                working: list = []
                whole = (cp, context_offsets(batch, seq_len, cp, documents)) if cp > 1 else None
                run = dict(cu_seqlens=cu, working=working, context=whole, routing=routing)
                measured = layer_saved_bytes(mc, index, lora_section, shape, dtype, cands, **run)
                measured.pop("attn_res", None)
                cache[key] = measured, working[0]
            per_kind[kind], work_of[kind] = cache[key]
        mixing: Dict[int, int] = {}
        if mc.attn_res:
            counts = {c for i in range(mc.num_layers) for c in attn_res_candidates(i, bs)}
            counts.add(final_candidates(mc.num_layers, bs))
            for c in sorted(counts):
                key = ("mix", c, shape, dtype, mc.hidden_size, mc.rms_norm_eps)
                if key not in cache:
                    cache[key] = _mixing_bytes(mc, shape, dtype, c)
                mixing[c] = cache[key]
        key = ("head", shape, dtype, config, repr(lora_section), linear)
        if key not in cache:
            cache[key] = _head_bytes(mc, shape, dtype, lora_section)
        head, head_working = cache[key]
    by_segment: Dict[str, float] = collections.Counter()
    per_layer = []
    for i, kind in enumerate(kinds):
        layer = 0.0
        for seg, v in per_kind[kind].items():
            by_segment[seg] += v
            layer += v
        if mc.attn_res:
            v = sum(mixing[c] for c in attn_res_candidates(i, bs))
            by_segment["attn_res"] += v
            layer += v
        per_layer.append(layer)
    if mc.attn_res:
        head += mixing[final_candidates(mc.num_layers, bs)]
    by_segment["head"] = head
    itemsize = torch.empty(0, dtype=dtype).element_size()
    # checkpointing keeps each layer's input state: the block values are shared, a partial sum is new per layer
    inputs = batch * seq_len * mc.hidden_size * itemsize * mc.num_layers
    names = {
        ("kda", True): "KDA + MoE",
        ("kda", False): "KDA + dense MLP",
        ("mla", True): "MLA + MoE",
        ("mla", False): "MLA + dense MLP",
    }
    return ActivationPlan(
        per_layer=per_layer,
        by_segment=dict(by_segment),
        layer_inputs=inputs,
        head=head,
        kinds={names[k]: float(sum(v.values())) for k, v in per_kind.items()},
        working=[float(work_of[k]) for k in kinds],
        head_working=float(head_working),
    )


def context_offsets(batch: int, seq_len: int, cp: int, documents: Optional[Sequence[int]]) -> Tuple[int, ...]:
    """The global document offsets of the packed row whose last of ``cp`` ranks holds ``batch x seq_len``
    tokens (the row's ``batch`` rows of ``seq_len x cp`` tokens, packed as the trainer packs them)."""
    return tuple(packed_boundaries(batch, seq_len * cp, documents).tolist())


def _built_from(mc, routed: bool = True) -> str:
    """What a layer of ``mc`` is built from, as a cache key; ``routed=False``: without the routed experts (a
    dense-MLP layer reads only the MoE config's activation)."""
    parts = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
    if not routed:
        moe = mc.moe
        parts["moe"] = (moe.activation, moe.situ_beta, moe.situ_linear_beta)
    return repr(sorted(parts.items()))


def _state_shape(index: int, mc) -> Sequence[int]:
    """The number of tensors in the stream's state before layer ``index`` (1 without AttnRes)."""
    if not mc.attn_res:
        return [0]
    bs = mc.attn_res_block_size
    return [0] * (1 + index // bs + (1 if index % bs else 0))
