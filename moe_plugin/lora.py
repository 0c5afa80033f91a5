"""The one LoRA entry point, for the Hugging Face model and the megatron-core model alike (through peft).

The adapted modules are the single-device layers on both faces: plain ``nn.Linear`` (``q_proj``, ``k_proj``,
the router ``gate``, ...) and the stacked routed experts (``experts.w1/w2/w3``, peft ``target_parameters``:
one adapter per expert, stacked ``lora_A [r * E, in]``, ``lora_B [out, r * E]``). peft's own megatron path is
not used (it is broken in peft 0.21, see docs/cpu.md) and not needed.

Expert adapters carry megatron's expert mark ``allreduce = False`` like the experts themselves, so every
gradient reduction (megatron's, ``moe_plugin.parallel.grad_reduce``, DeepSpeed ZeRO-3 through
``moe_plugin.parallel.layout``) treats them as expert parameters. ``init_expert_adapters`` draws each expert's
``lora_A`` by its global index, so an expert-parallel run starts as one process does. The stacked layout itself
(split, stack, slice, stitch of the EP ranks' local stacks back into the full ``E``) is
``moe_plugin.expert_adapters``.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Iterable, Optional, Sequence

import torch
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from torch import nn

from .compat.deepspeed import full_numel, full_shape
from .compat.peft import quiet_wrapping, register_custom_module
from .config import require
from .expert_adapters import slice_experts
from .layers.gated_dsa import GatedMLAAttention
from .layers.kda import KDAAttention
from .layers.packed_experts import PackedStackedExperts
from .layers.stacked_experts import StackedExperts
from .lora_packed import PackedParamWrapper

__all__ = [
    "SEED_TARGET_MODULES",
    "lora_config",
    "add_lora",
    "mark_expert_adapters",
    "init_expert_adapters",
    "count_parameters",
    "targets_by_layer_kind",
    "REPORT_ATTRIBUTE",
]

# The seed's LoRA targets: the attention query/key projections and the router.
SEED_TARGET_MODULES = ("q_proj", "k_proj", "gate")


def lora_config(
    r: int = 8,
    alpha: float = 16,
    target_modules: Iterable[str] = SEED_TARGET_MODULES,
    target_parameters: Iterable[str] = (),
    dropout: float = 0.0,
) -> LoraConfig:
    """peft's ``LoraConfig`` for these targets; ValueError naming the argument that cannot work."""
    require(isinstance(r, int) and not isinstance(r, bool) and r > 0, "r", f"must be a positive integer, got {r!r}")
    require(alpha > 0, "alpha", f"must be positive (0 makes the adapter a no-op), got {alpha!r}")
    modules, params = list(target_modules), list(target_parameters)
    require(bool(modules or params), "target_modules", "name at least one module or parameter to adapt")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules or None, target_parameters=params or None
    )
    # packed experts take their adapters through their own peft layer, in peft's layout (moe_plugin.lora_packed)
    register_custom_module(config, {PackedStackedExperts: PackedParamWrapper})
    return config


# where add_lora leaves its targets report on the model it returns (the trainer prints it at start)
REPORT_ATTRIBUTE = "lora_targets_report"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# the attention kinds of a decoder layer, by the layer class that owns them (megatron's subclasses included)
_ATTENTION_KINDS = ((KDAAttention, "KDA"), (GatedMLAAttention, "MLA"))


def _matches(name: str, keys: Sequence[str]) -> set:
    """The keys of ``keys`` that ``name`` ends with, as peft matches a target list (whole dotted parts)."""
    return {k for k in keys if name == k or name.endswith("." + k)}


def _layer_kinds(model: nn.Module) -> dict:
    """``{layer index: (kind, [the attention's nn.Linear names, in module order])}`` of the decoder layers of
    ``model`` (an image+text model's language model, either face), by the attention module each layer holds."""
    kinds: dict = {}
    for name, module in model.named_modules():
        for cls, kind in _ATTENTION_KINDS:
            layer = _LAYER.search(name + ".")
            if isinstance(module, cls) and layer and int(layer.group(1)) not in kinds:
                # the projections a user would target: the DSA indexer (this project's, frozen) is left out
                linears = [
                    n.rsplit(".", 1)[-1]
                    for n, m in module.named_modules()
                    if isinstance(m, nn.Linear) and "indexer" not in n.split(".")
                ]
                kinds[int(layer.group(1))] = (kind, [n for n in dict.fromkeys(linears) if "lora_" not in n])
    return kinds


def targets_by_layer_kind(model: nn.Module, config: LoraConfig) -> str:
    """One line saying in which decoder layers of each attention kind (KDA, MLA) each LoRA target of ``config``
    matched, before the adapters go on. Targets that match alike are named together; a kind a target misses in
    full names that kind's attention projections, e.g. ``q_proj, k_proj matched in 3 of 3 KDA layers; 0 of 1
    MLA layers (MLA has q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj)``: K3's MLA layers
    have no ``q_proj``/``k_proj``, so those targets leave a quarter of its layers' attention unadapted."""
    modules = sorted(config.target_modules or ()) if not isinstance(config.target_modules, str) else []
    params = list(config.target_parameters or ())
    kinds = _layer_kinds(model)
    if not kinds:
        return ""
    totals: dict = {}
    for kind, _ in kinds.values():
        totals[kind] = totals.get(kind, 0) + 1
    hits: dict = {t: {} for t in modules + params}  # target -> {kind: set of layers}
    for name, module in model.named_modules():
        layer = _LAYER.search(name + ".")
        if layer is None or int(layer.group(1)) not in kinds or "lora_" in name:
            continue
        index = int(layer.group(1))
        kind = kinds[index][0]
        found = _matches(name, modules) | {
            k for p, _ in module.named_parameters(recurse=False) for k in _matches(f"{name}.{p}", params)
        }
        for target in found:
            hits[target].setdefault(kind, set()).add(index)
    if isinstance(config.target_modules, str):
        return f"LoRA targets: the pattern {config.target_modules!r} (not reported by layer kind)"
    groups: dict = {}
    for target, found in hits.items():
        groups.setdefault(tuple((kind, len(found.get(kind, ()))) for kind in totals), []).append(target)
    phrases = []
    for counts, targets in groups.items():
        parts = []
        for kind, n in counts:
            part = f"{n} of {totals[kind]} {kind} layers"
            if n == 0:
                names = next(linears for k, linears in kinds.values() if k == kind)
                part += f" ({kind} has {', '.join(names)})"
            parts.append(part)
        phrases.append(f"{', '.join(targets)} matched in " + "; ".join(parts))
    return "LoRA targets by layer kind: " + " | ".join(phrases)


def add_lora(model: nn.Module, config: LoraConfig, wrap: bool = False):
    """Put LoRA adapters on ``model`` (base frozen, adapters trainable) and mark the expert adapters.

    wrap: return a peft ``PeftModel`` (what ``save_pretrained`` writes as a PEFT adapter directory; the
    Hugging Face face); False injects in place and returns ``model`` itself, keeping parameter names and
    module paths (the megatron face, whose names map through ``moe_plugin.megatron.weights``). The returned
    model carries ``targets_by_layer_kind``'s line as ``lora_targets_report`` (``REPORT_ATTRIBUTE``).
    """
    report = targets_by_layer_kind(model, config)
    if wrap:
        with quiet_wrapping():
            model = get_peft_model(model, config)
    else:
        inject_adapter_in_model(config, model)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
    mark_expert_adapters(model)
    object.__setattr__(model, REPORT_ATTRIBUTE, report)  # a plain attribute, not a module or buffer
    return model


def _innermost(module: nn.Module) -> nn.Module:
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def mark_expert_adapters(model: nn.Module) -> int:
    """Set megatron's expert mark ``allreduce = False`` on every adapter parameter of a routed-expert stack;
    returns how many were marked."""
    marked = 0
    for module in model.modules():
        if hasattr(module, "lora_A") and isinstance(_innermost(module), StackedExperts):
            for adapters in (module.lora_A, module.lora_B):
                for p in adapters.parameters():
                    p.allreduce = False
                    marked += 1
    return marked


@torch.no_grad()
def init_expert_adapters(model: nn.Module, seed: int) -> int:
    """Draw every routed-expert ``lora_A`` block from a generator seeded by (seed, layer index, adapted
    parameter, global expert), so that an expert's adapter starts the same whichever expert-parallel rank
    holds it, and on both faces (the key uses no module path, which differs between them; peft draws the
    stacked ``[r * E_local, in]`` from the global generator, which would give each EP rank the same numbers
    for different experts). The bound is peft's (kaiming-uniform with a = sqrt(5): 1/sqrt(in)). ``lora_B``
    starts at zero as in peft. Returns the number of expert blocks drawn."""
    drawn = 0
    for name, module in model.named_modules():
        experts = _innermost(module)
        if not (hasattr(module, "lora_A") and isinstance(experts, StackedExperts)):
            continue
        local = full_shape(experts.w1)[0]
        layer = re.search(r"layers\.(\d+)\.", name)
        key = zlib.crc32(f"{layer.group(1) if layer else name}/{getattr(module, 'parameter_name', '')}".encode())
        for lora_a in module.lora_A.values():
            w = lora_a.weight
            bound = 1.0 / math.sqrt(w.shape[1])
            for j in range(local):
                g = torch.Generator(device=w.device)
                g.manual_seed((seed * 1_000_003 + key) * 4099 + experts.first_expert + j)
                slice_experts(w, "A", j, j + 1, local).uniform_(-bound, bound, generator=g)  # a view of w
                drawn += 1
    return drawn


def count_parameters(model: nn.Module, params: Optional[Sequence] = None):
    """(trainable, total) element counts; ZeRO-3 partitioned parameters count their full size."""
    params = list(model.parameters()) if params is None else list(params)
    numel = [full_numel(p) for p in params]
    return sum(n for n, p in zip(numel, params) if p.requires_grad), sum(numel)
