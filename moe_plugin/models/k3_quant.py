"""K3's ``quantization_config`` <-> this project's ``expert_format`` (docs/k3-formats.md, docs/packed-experts.md).

Kimi K3 nests ``quantization_config`` in ``text_config`` with the format under ``config_groups.group_0``
(compressed-tensors ``mxfp4-pack-quantized``: FP4 weights, E8M0 scales per 32 inputs); the K2 family uses
``pack-quantized`` (symmetric INT4, bf16 scales per 32 inputs). The values are checked rather than assumed
(no official config was at hand): 4 bits, groups of 32, symmetric, and for MXFP4 floating-point codes. Only the
routed experts are quantised in these releases; ``ignore`` lists are not read.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

__all__ = ["FORMAT_NAMES", "expert_format_from_k3", "quantization_config_for"]

# compressed-tensors format name -> expert_format, and the weights' "type" each needs
FORMAT_NAMES = {"mxfp4-pack-quantized": ("mxfp4", "float"), "pack-quantized": ("int4", "int")}
_GROUP = 32


def expert_format_from_k3(text: Mapping[str, Any], where: str = "") -> str:
    """The ``expert_format`` a K3 text config's ``quantization_config`` describes ("dense" without one);
    ValueError naming the key (``text_config.quantization_config.config_groups.group_0.format``) otherwise."""
    qc = text.get("quantization_config")
    if qc is None:
        return "dense"
    base = f"{where}quantization_config"
    if not isinstance(qc, Mapping):
        raise ValueError(f"{base}: expected a mapping, got {type(qc).__name__}")
    groups = qc.get("config_groups") or {}
    if len(groups) > 1:
        raise ValueError(f"{base}.config_groups: one group (the routed experts) is supported, got {sorted(groups)}")
    name, group = next(iter(groups.items())) if groups else ("group_0", {})
    at = f"{base}.config_groups.{name}"
    fmt = group.get("format", qc.get("format"))
    if fmt not in FORMAT_NAMES:
        raise ValueError(
            f"{at}.format: unknown expert format {fmt!r}; supported: {sorted(FORMAT_NAMES)} "
            "(or remove quantization_config for BF16 experts)"
        )
    expert_format, kind = FORMAT_NAMES[fmt]
    weights = group.get("weights") or {}
    for key, want in (("num_bits", 4), ("group_size", _GROUP), ("symmetric", True), ("type", kind)):
        got = weights.get(key, want)
        if got != want:
            raise ValueError(f"{at}.weights.{key}: {fmt} is read with {key} = {want!r}, got {got!r}")
    return expert_format


def quantization_config_for(expert_format: str) -> Optional[Dict[str, Any]]:
    """The ``quantization_config`` a K3 text config carries for ``expert_format`` (None for "dense")."""
    if expert_format == "dense":
        return None
    name = next(n for n, (f, _) in FORMAT_NAMES.items() if f == expert_format)
    kind = FORMAT_NAMES[name][1]
    weights = {
        "num_bits": 4,
        "type": kind,
        "symmetric": True,
        "group_size": _GROUP,
        "strategy": "group",
        "dynamic": False,
    }
    if expert_format == "mxfp4":
        weights["scale_dtype"] = "torch.uint8"
    return {
        "quant_method": "compressed-tensors",
        "format": name,
        "config_groups": {
            "group_0": {"format": name, "targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj.*",
            "re:.*block_sparse_moe\\.gate$",
            "re:.*routed_expert_.*",
            "lm_head",
        ],
    }
