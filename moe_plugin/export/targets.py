"""Which base tensor each adapter of a PEFT state adapts, and whether an adapter covers what was trained.

The map comes from peft itself: the Hugging Face model is built on the ``meta`` device (no memory), peft puts
the adapters on it exactly as ``PeftModel.from_pretrained`` would, and every adapted module says what it adapts.
That matters for the stacked experts: peft nests one ``ParamWrapper`` per targeted parameter, so the key
``...experts.lora_A.weight`` belongs to whichever of ``w1``/``w2``/``w3`` ended up outermost (``w2`` here, as
peft sorts the targets and walks the parameters in registration order); reading the key would guess wrong.

An image run's adapter (the trainer's image+text model, ``MoEPluginForConditionalGeneration``) names its text
adapters under ``language_model.``; its targets are then mapped on that model (``image=True``), so that every
name (``Target.weight``, ``Target.module``) is the image model's own. A text-only run over a base with a
vision tower trains the text model, and its adapter is moved onto the image model (``onto_image_model``): the
base loads as that model (its ``architectures``, ``AutoModelForCausalLM``), so that is what its exports adapt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from ..compat.peft import quiet_wrapping
from ..config import require
from ..weights.names import TEXT_PREFIX, VISION_PREFIXES, base_name, k3_expert_name, strip_text_prefix

__all__ = [
    "Target",
    "adapter_targets",
    "check_state_covers",
    "select_targets",
    "per_expert_key",
    "PEFT_PREFIX",
    "is_image_adapter",
    "on_image_model",
    "onto_image_model",
]

PEFT_PREFIX = "base_model.model."  # what peft's wrapper puts in front of the model's own names
# peft's exclude_modules as a pattern (matched in full against each module name): the vision tower and projector
VISION_MODULES = "(" + "|".join(p.rstrip(".") for p in VISION_PREFIXES) + r")(\..*)?"


@dataclass(frozen=True)
class Target:
    """One adapted base tensor. weight: its name in the Hugging Face model the adapter is on
    (``model.layers.0.self_attn.q_proj.weight``, ``model.layers.1.block_sparse_moe.experts.w2``; on the image
    model ``language_model.model.layers...`` or ``vision_tower...``); module: the PEFT key prefix of its adapter
    (``lora_A`` / ``lora_B`` follow); experts: E for a stacked expert parameter ``[E, out, in]``, 0 for a dense Linear;
    scaling: peft's ``alpha / r`` (or its rsLoRA form)."""

    weight: str
    module: str
    experts: int
    scaling: float

    @property
    def key_a(self) -> str:
        return f"{self.module}.lora_A.weight"

    @property
    def key_b(self) -> str:
        return f"{self.module}.lora_B.weight"

    @property
    def stream_name(self) -> str:
        """The name ``base_stream.base_tensors`` streams this tensor under (the text model's, or a vision name)."""
        return strip_text_prefix(self.weight)

    def describe(self, expert: Optional[int] = None) -> str:
        return self.weight if expert is None else f"{self.weight} expert {expert}"


def _innermost(module):
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def is_image_adapter(keys: Iterable[str]) -> bool:
    """Whether PEFT keys are the image+text model's (its text model nested under ``language_model.``)."""
    return any(
        k.startswith((PEFT_PREFIX + TEXT_PREFIX,) + tuple(PEFT_PREFIX + p for p in VISION_PREFIXES)) for k in keys
    )


def on_image_model(targets: Mapping[str, Target]) -> bool:
    """Whether ``targets`` were mapped on the image+text model (``adapter_targets(..., image=True)``)."""
    return any(t.weight.startswith((TEXT_PREFIX,) + VISION_PREFIXES) for t in targets.values())


def onto_image_model(
    state: Mapping[str, torch.Tensor], hf_config, lora_config
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Target], object]:
    """A text model's adapter (PEFT keys ``base_model.model.model.layers...``) put on the image+text model:
    (the state under that model's names, ``base_model.model.language_model.model.layers...``, the same tensors;
    its targets, those of the LoRA config in the language model; the LoRA config, which when its target list
    also names modules of the vision tower or projector now excludes them, as the text run never had them)."""
    import copy

    moved = {
        PEFT_PREFIX + TEXT_PREFIX + k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k: v
        for k, v in state.items()
    }
    image_targets = adapter_targets(hf_config, lora_config, image=True)
    targets = {n: t for n, t in image_targets.items() if n.startswith(TEXT_PREFIX)}
    if len(targets) < len(image_targets):  # peft would otherwise put fresh adapters on the tower's modules
        lora_config = copy.deepcopy(lora_config)
        lora_config.exclude_modules = VISION_MODULES
    return moved, targets, lora_config


def adapter_targets(hf_config, lora_config, image: bool = False) -> Dict[str, Target]:
    """``{weight name: Target}`` of every tensor ``lora_config`` adapts in ``MoEPluginForCausalLM(hf_config)``,
    or with ``image`` in ``MoEPluginForConditionalGeneration(hf_config)`` (an image run's adapter)."""
    import copy

    from peft import get_peft_model

    from ..models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration

    config = copy.deepcopy(lora_config)
    config.inference_mode = False
    config.base_model_name_or_path = None  # an internal copy: peft would warn that it renames the base
    cls = MoEPluginForConditionalGeneration if image else MoEPluginForCausalLM
    with torch.device("meta"), quiet_wrapping():
        model = get_peft_model(cls(hf_config), config)
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        plain = base_name(name)[len(PEFT_PREFIX) :]  # the module's name before LoRA was added
        parameter = getattr(module, "parameter_name", None)
        if parameter is not None:
            stem = plain.rsplit(".", 1)[0] if plain.endswith(".base_layer") else plain
            weight, experts = f"{stem}.{parameter}", int(module.num_experts)
        else:
            weight, experts = f"{plain}.weight", 0
        out[weight] = Target(weight, name, experts if experts > 1 else 0, float(module.scaling["default"]))
    return out


def per_expert_key(target: Target, expert: int, which: str) -> str:
    """The published per-expert adapter name: ``base_model.model.model.layers.1.block_sparse_moe.experts.5.w1
    .lora_A.weight`` for expert 5 of ``...experts.w1`` (which: "A" or "B"); ``language_model.`` stays in front
    on the image model, as in K3's published multimodal checkpoint."""
    prefix = TEXT_PREFIX if target.weight.startswith(TEXT_PREFIX) else ""
    stem = k3_expert_name(target.stream_name, expert)[: -len(".weight")]
    return f"{PEFT_PREFIX}{prefix}{stem}.lora_{which}.weight"


def check_state_covers(targets: Mapping[str, Target], state: Mapping[str, torch.Tensor], what: str) -> None:
    """ValueError naming every target of ``targets`` whose ``lora_A``/``lora_B`` is not in ``state`` (the
    adapter lacks a trained delta), and every state key no target owns (``what`` names the adapter)."""
    missing = sorted(t.weight for t in targets.values() if t.key_a not in state or t.key_b not in state)
    owned = {k for t in targets.values() for k in (t.key_a, t.key_b)}
    unknown = sorted(k for k in state if k not in owned)
    problems = []
    if missing:
        problems.append(f"the deltas of {len(missing)} trained target(s) are missing: {missing[:20]}")
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) belong to no target of the run's LoRA config: {unknown[:20]}")
    require(
        not problems,
        what,
        "; ".join(problems) + " (was this adapter written by this run? export from its "
        "output_dir, or pass --step N to read a checkpoint)",
    )


def _matches(weight: str, entry: str) -> bool:
    stem = weight[: -len(".weight")] if weight.endswith(".weight") else weight
    return entry in (weight, stem) or stem.endswith("." + entry)


def select_targets(
    targets: Mapping[str, Target], wanted: Optional[Sequence[str]], active: Iterable[str]
) -> Dict[str, Target]:
    """The targets an export writes. wanted: module or parameter names (``q_proj``, ``experts.w1``, a full
    name) or None for all; ``active``: the targets that were trained. Refuses (ValueError naming them) a list
    that leaves a trained target out, or an entry that matches nothing."""
    if wanted is None:
        return dict(targets)
    entries: List[str] = [w.strip() for w in wanted if w.strip()]
    unmatched = [e for e in entries if not any(_matches(name, e) for name in targets)]
    require(
        not unmatched,
        "targets",
        f"{unmatched} match no adapted tensor of this run; its targets are "
        f"{sorted({n.rsplit('.', 2)[-2] if n.endswith('.weight') else n.rsplit('.', 1)[-1] for n in targets})}",
    )
    left_out = sorted(n for n in active if not any(_matches(n, e) for e in entries))
    require(
        not left_out,
        "targets",
        f"the list {entries} does not cover what was trained: {len(left_out)} trained "
        f"target(s) would lose their delta, e.g. {left_out[:10]}; add them to --targets (e.g. "
        "experts.w1,experts.w2,experts.w3 for the expert adapters) or leave --targets out",
    )
    return {n: t for n, t in targets.items() if any(_matches(n, e) for e in entries)}
