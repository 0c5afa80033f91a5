"""K3's ``vision_config`` (its ``vt_*`` / ``mm_*`` keys) to ``VisionConfig`` and back (docs/multimodal.md 7).

Every key of the published ``vision_config`` is either mapped to a ``VisionConfig`` field or has one supported
value (the release's), checked here; any other value, and any key this module does not know, is a ValueError
naming ``vision_config.<key>`` and what is supported. So a base whose tower this project does not build (another
``mm_projector_type``, ``merge_type``, ``norm_type``, activation, biases, ...) is refused by name, never built as
something else. The result is the ``moonvit3d`` kind (``moe_plugin.layers.moonvit``).

A ``vision_config`` without ``vt_*`` keys is this project's own form (``VisionConfig`` field names, as
``MoEPluginConfig`` saves it; also ``num_hidden_layers``, ``num_attention_heads``, ``merge_kernel_size``,
``pos_emb_height``), read as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

from ..config import VisionConfig

# K3 key -> VisionConfig field
_MAPPED = {
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_layers",
    "vt_num_attention_heads": "num_heads",
    "vt_intermediate_size": "intermediate_size",
    "qkv_hidden_size": "qkv_hidden_size",
    "patch_size": "patch_size",
    "init_pos_emb_time": "pos_emb_time",
    "text_hidden_size": "out_hidden_size",
    "projector_ln_eps": "projector_eps",
}
# K3 key -> the one value this project builds (the release's)
_FIXED = {
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
}
# read below with their own rules
_SHAPED = ("init_pos_emb_height", "init_pos_emb_width", "merge_kernel_size", "mm_hidden_size")
# the attention kernel is a runtime choice, not the model: the tower attends with SDPA whatever this says
_RUNTIME = {"_attn_implementation": ("flash_attention_2", "sdpa", "eager", None)}
# keys transformers' PretrainedConfig writes into any sub-config it saves
_GENERIC = ("model_type", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures")
_REQUIRED = ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size")

# this project's own form: K3-style alias -> VisionConfig field
_OWN_ALIASES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}
_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(VisionConfig))

# The published vision_config of moonshotai/Kimi-K3, every key (docs/multimodal.md 7; the k3 preset's tower).
K3_VISION_CONFIG: Dict[str, Any] = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_height": 64,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 64,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "qkv_hidden_size": 1536,
    "text_hidden_size": 7168,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
}


def is_k3_vision_config(vision: Mapping[str, Any]) -> bool:
    """Whether ``vision`` is K3's form (it has ``vt_*`` keys) rather than this project's."""
    return any(str(key).startswith("vt_") for key in vision)


def vision_config_from_k3(vision: Mapping[str, Any], where: str = "vision_config.") -> VisionConfig:
    """``VisionConfig`` (kind ``moonvit3d``) of K3's ``vision_config``; ValueError naming ``<where><key>`` for a
    missing, unknown or unsupported key."""
    for key in _REQUIRED:
        if key not in vision:
            raise ValueError(f"{where}{key}: required in K3's vision_config, but it is missing")
    known = set(_MAPPED) | set(_FIXED) | set(_SHAPED) | set(_RUNTIME) | set(_GENERIC)
    unknown = sorted(str(k) for k in vision if k not in known)
    if unknown:
        raise ValueError(
            f"{where}{unknown[0]}: not a key of K3's MoonViT-3D vision_config (unknown: {unknown}); this project "
            f"builds the release's tower only, whose keys are {sorted(set(_MAPPED) | set(_FIXED) | set(_SHAPED))}"
        )
    for key, supported in _FIXED.items():
        if key in vision and vision[key] != supported:
            raise ValueError(
                f"{where}{key}: only {supported!r} (K3's MoonViT-3D) is supported, got {vision[key]!r}; this project "
                "does not build such a tower (a recipe trains the base text-only with model.ignore_vision: true)"
            )
    for key, allowed in _RUNTIME.items():
        if vision.get(key) not in allowed:
            raise ValueError(f"{where}{key}: expected one of {allowed}, got {vision[key]!r}")
    fields: Dict[str, Any] = {_MAPPED[k]: v for k, v in vision.items() if k in _MAPPED}
    height = vision.get("init_pos_emb_height", 64)
    width = vision.get("init_pos_emb_width", height)
    if width != height:
        raise ValueError(
            f"{where}init_pos_emb_width: only a square position table is supported (init_pos_emb_height "
            f"{height}), got {width}"
        )
    fields["max_grid"] = height
    merge = vision.get("merge_kernel_size", [2, 2])
    merge = list(merge) if isinstance(merge, (list, tuple)) else [merge, merge]
    if len(merge) != 2 or merge[0] != merge[1]:
        raise ValueError(f"{where}merge_kernel_size: only a square merge [m, m] is supported, got {merge}")
    fields["merge_size"] = merge[0]
    mm = vision.get("mm_hidden_size", fields["hidden_size"])
    if mm != fields["hidden_size"]:
        raise ValueError(
            f"{where}mm_hidden_size: the projector reads the tower's output, so it must equal vt_hidden_size "
            f"({fields['hidden_size']}), got {mm}"
        )
    try:
        return VisionConfig(kind="moonvit3d", norm_eps=None, **fields)
    except ValueError as e:  # name K3's key, not the dataclass field
        field = str(e).split(":")[0].split(".")[-1]
        key = next((k for k, f in _MAPPED.items() if f == field), field)
        raise ValueError(f"{where}{key}: {str(e).split(': ', 1)[-1]}") from None


def vision_kwargs(vision: Mapping[str, Any], where: str = "vision_config.") -> Dict[str, Any]:
    """``MoEPluginConfig``'s ``vision_config`` (``VisionConfig`` fields) from either form of a vision_config."""
    if is_k3_vision_config(vision):
        return dataclasses.asdict(vision_config_from_k3(vision, where))
    out: Dict[str, Any] = {}
    for key, value in vision.items():
        field = _OWN_ALIASES.get(key, key)
        if field in _OWN_FIELDS:
            out[field] = value
    merge = vision.get("merge_kernel_size")
    if merge is not None:
        merge = list(merge) if isinstance(merge, (list, tuple)) else [merge, merge]
        if len(merge) != 2 or merge[0] != merge[1]:
            raise ValueError(f"{where}merge_kernel_size: only a square merge is supported, got {merge}")
        out["merge_size"] = merge[0]
    if "pos_emb_height" in vision:
        if vision.get("pos_emb_width", vision["pos_emb_height"]) != vision["pos_emb_height"]:
            raise ValueError(f"{where}pos_emb_width: must equal pos_emb_height (a square position table)")
        out["max_grid"] = vision["pos_emb_height"]
    return out


def vision_config_to_k3(config: VisionConfig) -> Dict[str, Any]:
    """The vision_config a checkpoint of ``config`` carries: K3's keys, every one, for ``moonvit3d`` (so
    ``vision_config_from_k3`` reads it back); this project's field names for its own ``vit``."""
    if config.kind != "moonvit3d":
        return {f: getattr(config, f) for f in _OWN_FIELDS}
    out: Dict[str, Any] = {"_attn_implementation": "flash_attention_2", **_FIXED}
    out.update({key: getattr(config, field) for key, field in _MAPPED.items()})
    out.update(
        init_pos_emb_height=config.max_grid,
        init_pos_emb_width=config.max_grid,
        merge_kernel_size=[config.merge_size, config.merge_size],
        mm_hidden_size=config.hidden_size,
    )
    return dict(sorted(out.items()))
