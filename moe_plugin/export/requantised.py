"""The self-check of a requantised merged export (docs/exports.md "Packed bases"): the written packed experts
against the requantisation of the adapted model's own merged weights.

For a targeted stack the reference merged weight is ``m = decode(base) + delta`` (``delta``: peft's
``get_delta_weight`` on the reference, fp32). The export computed its own delta (``export/deltas.py``); the
two agree to rounding, far inside ``eps = DELTA_RTOL x`` the expert's largest delta element (the tolerance the
delta check of every other export uses). A value close to a rounding boundary of the quantiser can therefore
land on either side, and that is the only freedom allowed: a written expert passes when it is the
requantisation of *some* weight within ``eps`` of ``m``, element by element. Both halves of the encoder are
monotone, so that is two bounds each:

* every group's written scale lies between the scales the encoder picks for a group maximum of
  ``amax(|m|) - eps`` and ``amax(|m|) + eps`` (``ops.quant.group_scales``);
* with that scale, every written value lies between ``round_to_grid(m - eps)`` and ``round_to_grid(m + eps)``.

A dropped expert delta (written = the base) or any other change fails these bounds unless the delta was below
the quantisation step everywhere, in which case the requantisation loses it whatever the export does (the
export's changed-value count shows it). Values that differ from the reference's own requantisation
``decode(encode(m))`` are counted as ties and reported.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from ..compat.peft import quiet_wrapping
from ..ops.quant import decode, encode, group_scales, groups, round_to_grid, scale_values
from ..weights.names import TEXT_PREFIX
from .packed import PackedStack
from .targets import Target, on_image_model
from .verify import DELTA_RTOL, CheckResult

__all__ = ["check_requantised_stack", "requantised_differences", "requantised_check"]


@torch.no_grad()
def check_requantised_stack(
    stack: PackedStack,
    target: Target,
    base: torch.Tensor,
    delta: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    result: CheckResult,
) -> int:
    """Record in ``result`` every expert whose written ``codes``/``scales`` are not a requantisation of
    ``base + delta`` (``[E, out, in]`` fp32) within the tolerance above; returns the number of tie values."""
    fmt = stack.format
    merged = base + delta
    eps = DELTA_RTOL * delta.abs().amax(dim=(1, 2), keepdim=True)  # [E, 1, 1]
    amax = groups(merged.abs()).amax(-1)  # [E, out, groups]
    got_scale = scale_values(fmt, scales)
    scale_ok = (got_scale >= group_scales(fmt, amax - eps)) & (got_scale <= group_scales(fmt, amax + eps))
    got = decode(fmt, codes, scales, stack.in_features, torch.float32)
    low, high = round_to_grid(fmt, merged - eps, got_scale), round_to_grid(fmt, merged + eps, got_scale)
    value_ok = (got >= low) & (got <= high)
    ok = scale_ok.flatten(1).all(1) & value_ok.flatten(1).all(1)
    own_codes, own_scales = encode(fmt, merged, scale_bits=True)
    own = decode(fmt, own_codes, own_scales, stack.in_features, torch.float32)
    missing, wrong = [], []
    for e in range(base.shape[0]):
        result.deltas_checked += 1
        if bool(ok[e]):
            continue
        lost = torch.equal(got[e], base[e]) and not torch.equal(own[e], base[e])
        (missing if lost else wrong).append(target.describe(e))
    if missing:
        result.problems.append(f"delta missing for {missing} (the requantised experts equal the base's)")
    if wrong:
        result.problems.append(f"delta wrong for {wrong} (not the requantisation of the merged weights)")
    return int((got != own).sum())


def requantised_differences(
    base: Iterable[Tuple[str, torch.Tensor, Optional[tuple]]],
    written: Iterable[Tuple[str, torch.Tensor, Optional[tuple]]],
    targets: Mapping[str, Target],
    expected: Mapping[str, torch.Tensor],
    stacks: Dict[str, PackedStack],
    result: CheckResult,
) -> int:
    """Stream a packed base and a requantised export side by side (``packed.decoded`` with ``keep_packed``):
    targeted stacks through ``check_requantised_stack``, other stacks bit for bit, dense targets' written minus
    base against their deltas, every other tensor unchanged. Returns the tie count."""
    from .verify import compare_deltas

    written, ties = iter(written), 0
    streamed = {t.stream_name: t for t in targets.values()}  # the streams name tensors as the text model does
    for name, base_tensor, base_packed in base:
        got_name, got, got_packed = next(written, (None, None, None))
        if got_name != name:
            result.problems.append(f"the export's tensors do not follow the base's at {name} (found {got_name})")
            return ties
        target = streamed.get(name)
        if name in stacks and target is not None:
            ties += check_requantised_stack(
                stacks[name], target, base_tensor, expected[target.weight], *got_packed, result
            )
        elif name in stacks:
            if not all(torch.equal(a, b) for a, b in zip(got_packed, base_packed)):
                result.problems.append(f"{name}: not a target, yet its packed values differ from the base's")
        elif target is not None:
            eps = torch.finfo(got.dtype).eps
            atol = 4 * eps * max(float(base_tensor.float().abs().max()), float(got.float().abs().max()))
            compare_deltas(result, target, got.float() - base_tensor.float(), expected[target.weight], atol)
        elif not torch.equal(got, base_tensor.to(got.dtype)):
            result.problems.append(f"{name}: not a target, yet it differs from the base")
    return ties


def requantised_check(
    source, targets: Mapping[str, Target], directory: str, expected: Mapping[str, torch.Tensor], result: CheckResult
) -> torch.Tensor:
    """Check the requantised export in ``directory`` against ``source``'s base (streamed, into ``result``) and
    return the logits it is to reproduce: the reference model (packed base, the run's adapters) with its
    targeted expert stacks holding the checked written codes and its expert adapters switched off, so
    that everything but the requantised experts is still the reference's own."""
    import copy

    from peft import get_peft_model, set_peft_model_state_dict

    from ..weights.packed import stack_of
    from .base_stream import base_tensors
    from .packed import decoded, packed_stacks
    from .verify import base_model, logits_of

    config = source.hf_config
    stacks = packed_stacks(config)
    base = decoded(base_tensors(source.base_path, config), stacks, keep_packed=True)
    written = decoded(base_tensors(directory, config), stacks, keep_packed=True)
    result.requantised_ties = requantised_differences(base, written, targets, expected, stacks, result)
    model = base_model(source)
    params = dict(model.named_parameters())
    streamed = {t.stream_name for t in targets.values()}
    prefix = TEXT_PREFIX if on_image_model(targets) else ""  # the image model nests the text model's names
    with torch.no_grad():
        for name, tensor in base_tensors(directory, config):
            found = stack_of(name)
            if found and f"{found[0]}.{found[1]}" in stacks and f"{found[0]}.{found[1]}" in streamed:
                params[prefix + name].copy_(tensor)
    lora = copy.deepcopy(source.lora_config)
    lora.inference_mode = True
    with quiet_wrapping():
        model = get_peft_model(model, lora)
    state = {k: v.float() for k, v in source.state.items()}
    for target in targets.values():
        if target.stream_name in stacks:  # that delta is in the codes now
            state[target.key_b] = torch.zeros_like(state[target.key_b])
    set_peft_model_state_dict(model, state)
    return logits_of(model.eval(), config.vocab_size)
