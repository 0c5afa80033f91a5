"""K3's ``config.json`` as published, read as it is (docs/k3-formats.md, "The release as downloaded: config").

``KimiK3Config`` is the config of the published multimodal layout, ``model_type`` "kimi_k3": the outer keys
(``media_placeholder_token_id``, ``image_placeholder``, token ids, ``auto_map``, ...), a ``text_config``
(``model_type`` "kimi_linear", read by ``k3_keys``, its ``quantization_config`` by ``k3_quant``) and a
``vision_config`` (``vt_*`` / ``mm_*`` keys, read by ``k3_vision``). It is a ``MoEPluginConfig``, so the
models take it as it is; it is registered with ``AutoConfig`` for "kimi_k3" (``moe_plugin.models``), so
``AutoConfig.from_pretrained`` reads a downloaded K3 directory without its remote code.

What is read, refused and kept:

- every key the model needs is read; a value this project does not build is a ValueError naming the key
  (``text_config.moe_router_activation_func``, ``vision_config.norm_type``, ...);
- the image token is ``media_placeholder_token_id`` (``<|media_pad|>``), also reachable as ``image_token_id``;
  ``image_placeholder`` is a string the processor replaces, not a token, and stays an attribute;
- every other key, known or not, is kept and written back unchanged by ``to_dict`` / ``save_pretrained``; a key
  the config changed since it was read (``hidden_size`` set, an override) is written with its new value.

``config_from_k3`` reads either layout (the multimodal one above, or a bare "kimi_linear" text config, which
gives a plain ``MoEPluginConfig``); ``config_to_k3`` writes it.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Dict, Mapping, Optional

from ..config import K3_VL_MODEL_TYPE
from .configuration import MoEPluginConfig
from .k3_keys import text_config_of, text_kwargs
from .k3_vision import vision_config_to_k3, vision_kwargs

__all__ = ["KimiK3Config", "config_from_k3", "config_to_k3"]

# MoEPluginConfig's own keys: given to KimiK3Config beside the published ones, they are overrides
_MODEL_KEYS = frozenset(inspect.signature(MoEPluginConfig.__init__).parameters) - {"self", "kwargs"}
# MoEPluginConfig keys the published layout also has at its outer level (they are outer keys when given there)
_OUTER_TOO = frozenset(("tie_word_embeddings", "image_token_id"))
# what transformers passes into a config besides the file's keys; never written back as the release's
_RUNTIME_KEYS = frozenset(
    (
        "model_type",
        "transformers_version",
        "name_or_path",
        "_name_or_path",
        "attn_implementation",
        "experts_implementation",
        "num_labels",
        "torch_dtype",
        "_commit_hash",
        "output_attentions",
    )
)


def _merged(original: Mapping[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]) -> Dict[str, Any]:
    """``original`` (a section as read) with what changed from ``before`` to ``after`` (the section as this
    project writes it, when read and now) applied: unchanged keys keep their original values and order."""
    out = copy.deepcopy(dict(original))
    for key, value in after.items():
        if key in before and before[key] == value:
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict) and isinstance(before.get(key), dict):
            out[key] = _merged(out[key], before[key], value)
        else:
            out[key] = copy.deepcopy(value)
    for key in before:
        if key not in after:
            out.pop(key, None)
    return out


class KimiK3Config(MoEPluginConfig):
    """The published Kimi K3 ``config.json`` (see the module doc). ``text_config``: K3's text config;
    ``vision_config``: K3's (``vt_*`` keys) or this project's (``VisionConfig`` field names), or None;
    other keyword arguments: the published outer keys, or ``MoEPluginConfig`` keys as overrides.
    Without a ``text_config`` it is ``MoEPluginConfig``'s defaults in this layout."""

    model_type = K3_VL_MODEL_TYPE
    attribute_map = {"media_placeholder_token_id": "image_token_id"}

    def __init__(
        self,
        text_config: Optional[Mapping[str, Any]] = None,
        vision_config: Optional[Mapping[str, Any]] = None,
        **kwargs,
    ):
        outer = [k for k in kwargs if k not in _RUNTIME_KEYS and (k not in _MODEL_KEYS or k in _OUTER_TOO)]
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _MODEL_KEYS and k not in outer}
        read: Dict[str, Any] = {}
        if text_config is not None:
            read = text_kwargs(text_config, "text_config.")
        if vision_config is not None:
            read["vision_config"] = vision_kwargs(vision_config, "vision_config.")  # engineer C's mapping
        token_key = next((k for k in ("media_placeholder_token_id", "image_token_id") if k in kwargs), None)
        token = kwargs.pop(token_key) if token_key is not None else None
        kwargs.pop("image_token_id", None)  # given beside media_placeholder_token_id: the K3 key wins
        if token is None and text_config is not None and "image_token_id" in text_config:
            token_key, token = "text_config.image_token_id", text_config["image_token_id"]
        _check_image_token(token_key or "media_placeholder_token_id", token, read)
        if token is not None:
            read["image_token_id"] = token
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key in kwargs:  # the outer value is the model's (the text config's copy is written back beside it)
                read[key] = kwargs.pop(key)
        # the sections as read, and as this project writes them for what was read (to see later changes)
        self._k3_outer = outer
        self._k3_text = copy.deepcopy(dict(text_config)) if text_config is not None else None
        self._k3_vision = copy.deepcopy(dict(vision_config)) if vision_config is not None else None
        as_read = MoEPluginConfig(**read) if read else None
        self._k3_read = _sections(as_read) if as_read is not None else None
        super().__init__(**{**read, **overrides}, **kwargs)

    def to_dict(self) -> Dict[str, Any]:
        """The published layout: the outer keys as read (current values), ``model_type`` "kimi_k3",
        ``text_config`` and ``vision_config`` with every key read and what changed since."""
        flat = super().to_dict()
        out: Dict[str, Any] = {}
        for key in self._k3_outer:
            if key == "media_placeholder_token_id":
                out[key] = self.image_token_id
            elif key in flat:
                out[key] = flat[key]
        out["model_type"] = self.model_type
        text, vision = _sections(self)
        read_text, read_vision = self._k3_read if self._k3_read is not None else ({}, None)
        out["text_config"] = _merged(self._k3_text or {}, read_text, text)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in out and key in out["text_config"]:
                out["text_config"][key] = out[key]
        if vision is not None:
            out["vision_config"] = _merged(self._k3_vision or {}, read_vision or {}, vision)
        if "media_placeholder_token_id" not in self._k3_outer and self.image_token_id is not None:
            out["image_token_id"] = self.image_token_id
        if "tie_word_embeddings" not in out:
            out["tie_word_embeddings"] = self.tie_word_embeddings
        return out

    def to_diff_dict(self) -> Dict[str, Any]:
        # every key, not a diff against KimiK3Config(): the release's keys are written back whatever they hold
        return self.to_dict()


def _check_image_token(key: str, token: Any, read: Mapping[str, Any]) -> None:
    """ValueError naming ``key`` (K3's ``media_placeholder_token_id``) unless the image token is an id of the
    vocabulary, or absent without a vision tower."""
    if token is None:
        if read.get("vision_config") is not None:
            raise ValueError(
                f"{key}: required with a vision_config (the id of the image placeholder token, <|media_pad|> "
                "in K3); add it to config.json"
            )
        return
    vocab = read.get("vocab_size")
    if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (vocab is not None and token >= vocab):
        raise ValueError(
            f"{key}: must be a token id below text_config.vocab_size ({vocab}), got {token!r} (K3's is the id of "
            "<|media_pad|>; image_placeholder is a string the processor replaces, not a token)"
        )


def _sections(config: MoEPluginConfig):
    """(K3 text config, K3 vision config or None) of ``config`` as this project writes them."""
    vision = config.to_model_config().vision
    return text_config_of(config), (vision_config_to_k3(vision) if vision is not None else None)


# a MoEPluginConfig.from_pretrained of a K3 directory reads it as the published layout
MoEPluginConfig.LAYOUTS[K3_VL_MODEL_TYPE] = KimiK3Config


def config_from_k3(k3: Mapping[str, Any], **overrides: Any) -> MoEPluginConfig:
    """The config of K3's ``config.json``: a ``KimiK3Config`` for the published layout (``text_config`` +
    ``vision_config``), a plain ``MoEPluginConfig`` for a bare "kimi_linear" text config.

    ``overrides`` are ``MoEPluginConfig`` keys applied last, e.g. ``use_dsa_indexer=True`` to add a fresh DSA
    indexer to the full-attention layers. Unsupported or missing values raise ValueError naming the K3 key
    (prefixed ``text_config.`` / ``vision_config.`` inside a multimodal config).
    """
    if "text_config" in k3:
        return KimiK3Config(**{k: v for k, v in k3.items() if k != "model_type"}, **overrides)
    return MoEPluginConfig(**{**text_kwargs(k3, ""), "vision_config": None, **overrides})


def config_to_k3(config: MoEPluginConfig, multimodal: bool = False) -> Dict[str, Any]:
    """K3's ``config.json`` for ``config``; with ``multimodal`` the ``text_config`` + ``vision_config`` form.

    A ``KimiK3Config`` gives the keys it was read with (every one), changed where the config changed.
    ``config_from_k3(config_to_k3(c))`` rebuilds ``c``: this project's knobs that K3 lacks (the DSA indexer,
    ``gate_rank``, ``chunk_size``) are written as extra keys, which K3 readers ignore.
    """
    if isinstance(config, KimiK3Config):
        published = config.to_dict()
        return published if multimodal else published["text_config"]
    text = text_config_of(config)
    if not multimodal:
        return text
    mc = config.to_model_config()
    if mc.vision is None:
        raise ValueError("vision_config: a multimodal K3 config needs the model's vision_config")
    return {
        "model_type": K3_VL_MODEL_TYPE,
        "text_config": text,
        "vision_config": vision_config_to_k3(mc.vision),
        "image_token_id": config.image_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
