"""An export's self-check: reload what was written, compare it with the adapted model, name what is missing.

The reference is the adapted model: the base (loaded strictly) with the run's adapter put on by peft, in
fp32. Two comparisons, both before the export is published:

* deltas, target by target and for expert targets expert by expert: the delta the written files carry
  (an adapter's ``scaling * B @ A``, or merged minus base, streamed one tensor at a time) against peft's own
  ``get_delta_weight`` on the reference. A delta that is absent or wrong is named (``...experts.w2 expert 5``):
  a dropped expert delta changes logits only for tokens routed to that expert, so logits alone cannot show it;
* logits on a fixed batch (``FIXED_BATCH`` tokens from a seeded generator): the reloaded export against the
  reference, ``max|a - b| / max|b|`` at most ``LOGITS_RTOL`` (fp32 outputs; ``LOW_PRECISION_RTOL`` when a
  merged export is written in bf16/fp16, whose rounding of the weights is larger than that).

An image run's adapter (targets on the image+text model), and a text run's over a base with a vision tower
(moved onto that model, ``targets.onto_image_model``), are checked on that model: the reference is
``MoEPluginForConditionalGeneration`` with the base's vision tower, and the fixed batch holds one seeded
picture (``FIXED_IMAGE_GRID`` patches) among its tokens, so the logits cover the image path too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ..compat.peft import quiet_wrapping
from .targets import Target, on_image_model

__all__ = [
    "ExportCheckError",
    "CheckResult",
    "reference",
    "base_model",
    "logits_of",
    "rounded_reference_logits",
    "compare_deltas",
    "LOGITS_RTOL",
    "LOW_PRECISION_RTOL",
    "ROUNDED_RTOL",
    "FIXED_BATCH",
]

LOGITS_RTOL = 1e-5
LOW_PRECISION_RTOL = 2e-2
# a low-precision merge against the reference rounded as it is written (rounded_reference_logits): fp32 rounding
# of the forward pass, plus the odd merged value on the other side of a bf16 rounding tie (the export's delta and
# peft's are computed in another order)
ROUNDED_RTOL = 1e-3
DELTA_RTOL = 1e-4  # of the largest element of an expert's (or a dense target's) delta
FIXED_BATCH = (2, 24)  # rows x tokens
FIXED_IMAGE_GRID = (4, 6)  # patch rows x columns of the image model's fixed picture (in row 0)
SEED = 0


class ExportCheckError(ValueError):
    """The export did not reproduce the adapted model; nothing was published."""


@dataclass
class CheckResult:
    logits_rel_diff: float = float("nan")
    tolerance: float = LOGITS_RTOL
    deltas_checked: int = 0  # dense targets + expert deltas compared
    problems: List[str] = field(default_factory=list)
    requantised_ties: Optional[int] = None  # requantised exports: values on the other side of a rounding tie
    rounded_to: Optional[str] = None  # low-precision merges: the dtype the reference's merged tensors are rounded to

    def raise_if_failed(self, what: str) -> None:
        if self.logits_rel_diff > self.tolerance:
            self.problems.append(
                f"logits on the fixed batch differ from the adapted model's by "
                f"{self.logits_rel_diff:.3g} (relative; allowed {self.tolerance:g})"
            )
        if self.problems:
            raise ExportCheckError(f"export {what}: the check failed, nothing was written: " + "; ".join(self.problems))


def base_model(source):
    """The base model of ``source`` (a ``RunSource``) the adapter is on, loaded strictly, fp32, eval mode: the
    text model, or the image+text model for an image run's adapter."""
    from ..models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
    from ..weights.loader import load_state

    image = on_image_model(source.targets)
    model = (MoEPluginForConditionalGeneration if image else MoEPluginForCausalLM)(source.hf_config).float()
    # a text adapter's model has no vision tower: the base's is no part of it
    load_state(model, source.base_path, names="hf", config=source.model_config, strict=True, ignore_vision=not image)
    return model.eval()


def reference(source) -> Tuple[object, torch.Tensor, Dict[str, torch.Tensor]]:
    """(the adapted peft model, its logits on the fixed batch, ``{weight: peft's delta}`` of every target)."""
    import copy

    from peft import get_peft_model, set_peft_model_state_dict

    config = copy.deepcopy(source.lora_config)
    config.inference_mode = True
    config.base_model_name_or_path = None  # an internal copy: peft would warn that it renames the base
    with quiet_wrapping():
        model = get_peft_model(base_model(source), config)
    result = set_peft_model_state_dict(model, {k: v.float() for k, v in source.state.items()})
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing:
        raise ExportCheckError(f"adapter: peft left {len(missing)} adapter tensors unloaded, e.g. {missing[:5]}")
    model.eval()
    deltas = {}
    with torch.no_grad():
        for name, target in source.targets.items():
            deltas[name] = model.get_submodule(target.module).get_delta_weight("default").float()
    return model, logits_of(model, source.hf_config.vocab_size), deltas


def _image_config(model):
    """The image model's config (through peft's wrappers), None for a text model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.config if hasattr(inner, "vision_tower") else None


@torch.no_grad()
def logits_of(model, vocab_size: int) -> torch.Tensor:
    """Logits ``[rows, tokens, vocab]`` of ``model`` on the fixed batch (the same tokens every call); an image
    model's row 0 holds the fixed picture's placeholders (random patches, seeded), so its tower is used."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, FIXED_BATCH, generator=g)
    config = _image_config(model)
    if config is None:
        return model(input_ids=ids).logits.float()
    vision = config.to_model_config().vision
    ids[ids == config.image_token_id] = 0  # the picture's placeholders are the only ones
    rows, cols = FIXED_IMAGE_GRID
    tokens = rows * cols // vision.merge_size**2
    ids[0, 2 : 2 + tokens] = config.image_token_id
    patches = torch.randn(rows * cols, vision.patch_dim, generator=g)
    return model(input_ids=ids, pixel_patches=patches, grid_hw=torch.tensor([[rows, cols]])).logits.float()


@torch.no_grad()
def rounded_reference_logits(
    model, targets: Mapping[str, Target], deltas: Mapping[str, torch.Tensor], dtype: torch.dtype, vocab_size: int
) -> torch.Tensor:
    """Logits on the fixed batch of the adapted model as a merge written in ``dtype`` holds it: ``model`` (the
    base, fp32, changed in place) with each target's delta ``deltas[name]`` added in fp32 and the sum rounded
    to ``dtype`` once, as ``merge._merged`` writes it (a tensor the model keeps in fp32, the router, stays
    fp32). Against this reference a low-precision merge differs only by what it got wrong, not by its rounding,
    which in a small MoE can move expert choices and the logits by tens of percent."""
    import re

    from ..precision import FP32_TENSORS

    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in targets:
        tensor = tensors[name]
        merged = tensor.float() + deltas[name].to(tensor.device)
        if not any(re.search(pattern, name) for pattern in FP32_TENSORS):
            merged = merged.to(dtype).float()
        tensor.copy_(merged)
    return logits_of(model.eval(), vocab_size)


def relative_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)


def _pieces(target: Target, delta: torch.Tensor) -> Iterable[Tuple[Optional[int], torch.Tensor]]:
    if target.experts:
        return ((e, delta[e]) for e in range(delta.shape[0]))
    return ((None, delta),)


def compare_deltas(
    result: CheckResult, target: Target, got: Optional[torch.Tensor], expected: torch.Tensor, atol: float = 0.0
) -> None:
    """Record in ``result`` every expert (or the dense target) whose delta ``got`` lacks or gets wrong.
    got: ``[out, in]`` / ``[E, out, in]``, None when the export holds nothing for the target at all."""
    if got is None:
        result.problems.append(f"{target.weight}: no delta in the export")
        return
    if tuple(got.shape) != tuple(expected.shape):
        result.problems.append(f"{target.weight}: delta of shape {list(got.shape)}, expected {list(expected.shape)}")
        return
    bad_missing, bad_wrong = [], []
    for (index, want), (_, have) in zip(_pieces(target, expected), _pieces(target, got)):
        result.deltas_checked += 1
        scale = float(want.abs().max())
        err = float((have.float() - want).abs().max())
        if err <= DELTA_RTOL * scale + atol:
            continue
        (bad_missing if float(have.abs().max()) <= 0.1 * scale else bad_wrong).append(target.describe(index))
    if bad_missing:
        result.problems.append(f"delta missing for {bad_missing}")
    if bad_wrong:
        result.problems.append(f"delta wrong for {bad_wrong}")


def merged_differences(
    base: Iterable[Tuple[str, torch.Tensor]],
    written: Iterable[Tuple[str, torch.Tensor]],
    targets: Mapping[str, Target],
    expected: Mapping[str, torch.Tensor],
    result: CheckResult,
) -> None:
    """Stream the base and the merged export side by side (the same names in the same order): a target's
    written-minus-base is its delta; every other tensor must be the base's, unchanged."""
    written = iter(written)
    streamed = {t.stream_name: t for t in targets.values()}  # the streams name tensors as the text model does
    for name, base_tensor in base:
        got_name, got = next(written, (None, None))
        if got_name != name:
            result.problems.append(f"the export's tensors do not follow the base's at {name} (found {got_name})")
            return
        if name in streamed:
            target = streamed[name]
            eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
            atol = 4 * eps * max(float(base_tensor.float().abs().max()), float(got.float().abs().max()))
            compare_deltas(result, target, got.float() - base_tensor.float(), expected[target.weight], atol)
        # a packed base's experts, decoded, may be written in bf16
        elif not torch.equal(got, base_tensor.to(got.dtype)):
            result.problems.append(f"{name}: not a target, yet it differs from the base")
