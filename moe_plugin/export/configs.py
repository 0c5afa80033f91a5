"""The config a merged export writes. merged-k3 over a K3-layout base: the base's own ``config.json``, every key
kept (the release's ``architectures``, ``auto_map``, ``media_placeholder_token_id``, vision keys), so the export
is the base with the adapter in it (``base_k3_config``); merged-hf: this project's ``MoEPluginConfig`` whatever
layout the base was read from, its ``architectures`` naming the class the Auto classes should build
(``plain_config``). docs/exports.md, "The formats"."""

from __future__ import annotations

from typing import Optional


def plain_config(config):
    """``config`` as this project's own ``MoEPluginConfig`` (the Hugging Face layout a merged-hf export is in),
    also when it was read from a K3 directory (``k3_config.KimiK3Config`` writes the release's form)."""
    from ..models.configuration import MoEPluginConfig

    if type(config) is not MoEPluginConfig:
        values = MoEPluginConfig.to_dict(config)
        values.pop("model_type", None)
        config = MoEPluginConfig(**{k: v for k, v in values.items() if not k.startswith("_k3")})
    # the Auto classes pick the model by architectures: the image+text model for a base with a vision tower
    image = config.to_model_config().vision is not None
    config.architectures = ["MoEPluginForConditionalGeneration" if image else "MoEPluginForCausalLM"]
    return config


def base_k3_config(base_path: str, written: dict, requantise: bool) -> Optional[dict]:
    """The base's own ``config.json`` when the base at ``base_path`` is in K3's layout (None otherwise), for a
    merged-k3 export: every key kept (architectures, auto_map, media_placeholder_token_id, the vision keys, its
    dtype: the merge writes each tensor in the dtype the base stores it in); a packed base merged to dense
    experts drops its ``quantization_config`` (``written``: ``merge.write_merged``'s record), since the
    experts are no longer packed."""
    import copy

    from ..models.loading import read_k3_config

    base = read_k3_config(base_path)
    if base is None:
        return None
    config = copy.deepcopy(base)
    if written.get("expert_format") is not None and not requantise:
        for section in (config, config.get("text_config")):
            if isinstance(section, dict):
                section.pop("quantization_config", None)
    return config
