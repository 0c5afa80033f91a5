"""Strict loading for the model classes: a checkpoint whose tensors do not fit the config is named in one
ValueError (``check_loading_info``), the tensors a checkpoint left unloaded are initialised without
overwriting the loaded ones (``reset_unloaded``), and ``from_pretrained`` of a directory in K3's published
layout (``is_k3_layout``: per-expert, possibly MXFP4 tensors, padded ``A_log``, the release's config.json)
streams it through the project's read planner instead of transformers' loader (``load_k3_layout``)."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from transformers import GenerationConfig

from ..config import K3_TEXT_MODEL_TYPE, K3_VL_MODEL_TYPE
from ..weights.checks import config_dtype, read_config_file
from ..weights.loader import load_state
from ..weights.names import stores_stacked_experts

from ..layers.attn_res import AttnResProjection
from ..layers.kda import KDAAttention, ShortConvolution
from ..layers.stacked_experts import StackedExperts
from ..layers.vision import VisionTower

__all__ = [
    "check_loading_info",
    "reset_unloaded",
    "SELF_INITIALISED",
    "is_k3_layout",
    "read_k3_config",
    "load_k3_layout",
]


# The DSA indexer is optional on both sides: a checkpoint without it (K3 ships none) loads into a model with
# it (the indexer starts fresh), and a model without it loads a checkpoint that has one (dense attention).
_INDEXER = re.compile(r"\.self_attn\.indexer\.")
LISTED = 10  # tensor names shown per kind in a load error


def check_loading_info(info: dict, model_order: List[str], ignore_mismatched_sizes: bool = False) -> None:
    """Raise ValueError naming the first tensors whose names or shapes differ between checkpoint and model.

    info: transformers' loading info (``missing_keys``, ``unexpected_keys``, ``mismatched_keys`` as
    ``(name, checkpoint_shape, model_shape)``); model_order: the model's tensor names in state-dict order,
    which is the order names are listed in. Indexer tensors may be missing or extra (see ``_INDEXER``).
    """
    rank = {name: i for i, name in enumerate(model_order)}
    first = lambda name: (rank.get(name, len(rank)), name)  # noqa: E731
    problems: List[str] = []
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda item: first(item[0]))
    if mismatched and not ignore_mismatched_sizes:
        listed = ", ".join(
            f"{name} (checkpoint {tuple(ckpt)}, model {tuple(model)})" for name, ckpt, model in mismatched[:LISTED]
        )
        problems.append(f"{len(mismatched)} with other shapes: {listed}")
    missing = sorted((k for k in info.get("missing_keys") or () if not _INDEXER.search(k)), key=first)
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint: {', '.join(missing[:LISTED])}")
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not _INDEXER.search(k))
    if unexpected:
        problems.append(f"{len(unexpected)} the model does not have: {', '.join(unexpected[:LISTED])}")
    if problems:
        raise ValueError(
            "checkpoint: its tensors do not match the config; "
            + "; ".join(problems)
            + " (pass strict=False to load anyway)"
        )


# Modules whose reset_parameters() initialises their own tensors that are not plain Linear/Embedding/norm
# weights (decay parameters, convolutions, stacked experts, position table) or that must not be drawn like
# a Linear (the AttnRes projections start at zero).
SELF_INITIALISED = (AttnResProjection, KDAAttention, ShortConvolution, StackedExperts, VisionTower)


@torch.no_grad()
def reset_unloaded(module: nn.Module) -> None:
    """``module.reset_parameters()`` for the module's own tensors, keeping those transformers has loaded.

    transformers marks loaded tensors ``_is_hf_initialized`` and guards ``nn.init`` with it, but the layers'
    init also uses plain tensor ops (``log_``, ``copy_``), so loaded values are saved and put back here.
    """
    own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
    loaded = [(t, t.detach().clone()) for t in own if getattr(t, "_is_hf_initialized", False)]
    if len(loaded) == len(own):
        return
    module.reset_parameters()
    for tensor, value in loaded:
        tensor.detach().copy_(value)


CONFIG_NAME = "config.json"
# from_pretrained keywords that mean nothing for a local K3 directory (the Hub's, and what the Auto classes and
# peft pass along with their defaults); they are accepted and ignored
_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
    "code_revision",
    "_commit_hash",
    "trust_remote_code",
    "adapter_kwargs",
    "use_safetensors",
    "low_cpu_mem_usage",
    "attn_implementation",
)


def read_k3_config(path: Any) -> Optional[Dict[str, Any]]:
    """The ``config.json`` of a local directory in K3's layout (``model_type`` "kimi_k3" or "kimi_linear"),
    or None for anything else (a Hub name, a file, this project's own layout)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    file = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.isfile(file):
        return None
    config = read_config_file(file)
    if not isinstance(config, dict) or config.get("model_type") not in (K3_TEXT_MODEL_TYPE, K3_VL_MODEL_TYPE):
        return None
    return config


def is_k3_layout(path: Any) -> bool:
    # a K3 config.json over stacked experts is a K3 base saved by save_pretrained: this project's own tensor names
    return read_k3_config(path) is not None and not stores_stacked_experts(os.fspath(path))


def _dtype(value: Any, path: str) -> torch.dtype:
    """from_pretrained's ``dtype``: a torch dtype, its name, or "auto"/None for the dtype the checkpoint's
    config declares (``dtype`` / ``torch_dtype``; fp32 when it declares none), as transformers 5 defaults."""
    if value in (None, "auto"):
        value = config_dtype(path) or "float32"
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    if value not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: must be torch.float32, torch.bfloat16, torch.float16 or 'auto', got {value!r}")
    return value


def load_k3_weights(
    model: nn.Module, path: str, dtype: Optional[torch.dtype], strict: bool, ignore_vision: bool, ignore_mtp: bool
):
    """Cast a model built from a K3-layout directory's config to ``dtype`` (the policy's fp32 tensors stay fp32:
    ``MoEPluginPreTrainedModel._apply``), stream the directory's tensors into it (``weights.load_state``) and put
    it in eval mode; the load's stats. The one loading step of ``load_k3_layout`` and ``load_k3_checkpoint``."""
    if dtype is not None and dtype != torch.float32:
        model.to(dtype)
    stats = load_state(
        model,
        path,
        names="hf",
        config=model.config.to_model_config(),
        strict=strict,
        layout="k3",
        ignore_vision=ignore_vision,
        ignore_mtp=ignore_mtp,
    )
    model.eval()
    return stats


def load_k3_layout(cls: type, path: Any, strict: bool = True, **kwargs: Any):
    """``cls.from_pretrained(path, **kwargs)`` for a directory in K3's layout: the model built from the
    release's ``config.json`` (``k3_config.config_from_k3``, or the ``config`` passed) and its tensors streamed
    in by ``weights.load_state`` (per-expert and packed experts, padded ``A_log``, the fp32 families by
    ``precision.STORED_FP32``). ``cls`` is the text model (an image base's tower is then left in the checkpoint)
    or the image+text model. kwargs: ``config``, ``dtype``/``torch_dtype`` (default "auto": the config's),
    ``output_loading_info``, ``device_map`` ("cpu" or None) and the Hub's keywords, which a local directory
    ignores; any other keyword is refused by name. Returned in eval mode, as transformers does."""
    from .k3_config import config_from_k3  # imported late: k3_config imports configuration, which is cheap

    path = os.fspath(path)
    config = kwargs.pop("config", None)
    dtype = _dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)), path)
    want_info = kwargs.pop("output_loading_info", False)
    device_map = kwargs.pop("device_map", None)
    if device_map not in (None, "cpu"):
        raise ValueError(
            f"device_map: a K3-layout checkpoint loads on the CPU here (got {device_map!r}); load it, then .to() it"
        )
    for key in _HUB_KWARGS:
        kwargs.pop(key, None)
    if kwargs:
        raise ValueError(
            f"{sorted(kwargs)[0]}: not an option of from_pretrained for a K3-layout checkpoint ({path}); "
            f"the options are config, dtype, output_loading_info, device_map and strict"
        )
    if config is None or isinstance(config, (str, os.PathLike)):
        config = config_from_k3(read_k3_config(path))
    model = cls(config)
    text_only = not any(n.startswith(("vision_tower.", "mm_projector.")) for n, _ in model.named_parameters())
    stats = load_k3_weights(model, path, dtype, strict=strict, ignore_vision=text_only, ignore_mtp=True)
    if os.path.isfile(os.path.join(path, "generation_config.json")) and model.can_generate():
        # as transformers' from_pretrained does: the release's stop ids (eos <|end_of_msg|>) and defaults
        model.generation_config = GenerationConfig.from_pretrained(path)
    if not want_info:
        return model
    info = {"missing_keys": list(stats.fresh), "unexpected_keys": list(stats.unknown), "mismatched_keys": []}
    return model, info
