"""K3-format checkpoints with packed routed experts, as the published release stores them
(docs/packed-experts.md): the packed bases the tests load. The product reads packed bases but never writes one
(its requantised export writes only its experts, through the same ``weights.packed_tensors``).

``save_packed_k3_checkpoint(model, path)`` writes a model whose experts are packed (``expert_format`` "mxfp4" or
"int4") in the published layout: the multimodal form ``{"model_type": "kimi_k3", "text_config": {...,
"quantization_config": ...}}`` with the text tensors under ``language_model.``, and per expert
``...experts.{e}.w1.weight_packed`` / ``.weight_scale`` (INT4: the bf16 scale as published, plus
``.weight_shape``). ``naming="k2"`` writes the K2 family's names instead (INT4 releases: the MoE block under
``mlp.``, experts ``...mlp.experts.{e}.{gate,up,down}_proj.weight_packed``), and ``text_prefix=False`` the
text-only form (K2-Thinking: a top-level text config, no ``language_model.``; K2.5/K2.6 keep the prefix).
``write_tiny_packed_checkpoint`` generates the tiny one the tests use, and optionally its twin with the same
experts dequantised once into fp32 (the reference a packed run must equal).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Union

import torch
from safetensors.torch import save_file

from ..config import K3_VL_MODEL_TYPE
from ..fileio import SAFETENSORS_SINGLE, atomic_directory
from ..models.k3_config import config_to_k3
from ..models.k3_format import CONFIG_NAME, save_k3_checkpoint, state_dict_to_k3
from ..models.modeling import MoEPluginForCausalLM
from ..models.presets import preset_config
from ..ops.quant import decode
from ..weights.packed import EXPERT_NAMINGS, k2_block_name, stack_of
from ..weights.packed_tensors import per_expert_tensors

__all__ = ["packed_k3_tensors", "save_packed_k3_checkpoint", "dequantized_state_dict", "write_tiny_packed_checkpoint"]

TEXT_PREFIX = "language_model."


def _packed_stacks(model) -> Dict[str, object]:
    """``{state-dict prefix of an experts module: the PackedStackedExperts}``."""
    return {name: m for name, m in model.named_modules() if getattr(m, "is_packed", False)}


def packed_k3_tensors(model, naming: str = "k3", text_prefix: bool = True) -> Dict[str, torch.Tensor]:
    """The published tensors of ``model`` (a text model with packed experts) in ``naming`` ("k3" or "k2"),
    names under ``language_model.`` when ``text_prefix``; the experts by ``weights.packed_tensors``."""
    if naming not in EXPERT_NAMINGS:
        raise ValueError(f"naming: must be one of {EXPERT_NAMINGS}, got {naming!r}")
    head = TEXT_PREFIX if text_prefix else ""
    rename = k2_block_name if naming == "k2" else (lambda n: n)
    state = model.state_dict()
    stacks = _packed_stacks(model)
    packed_names = {f"{p}.{k}" for p in stacks for k in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale")}
    out = {
        head + rename(n): t.contiguous().clone()
        for n, t in state_dict_to_k3({n: t for n, t in state.items() if n not in packed_names}, model.config).items()
    }
    for prefix, experts in stacks.items():
        for kind, shape in experts.logical_shapes.items():
            stacked = f"{prefix}.{kind}"
            out.update(
                (head + n, t)
                for n, t in per_expert_tensors(
                    stacked, experts.expert_format, state[stacked], state[stacked + "_scale"], shape, naming
                )
            )
    return out


def save_packed_k3_checkpoint(
    model, path: Union[str, os.PathLike], naming: str = "k3", text_prefix: bool = True
) -> None:
    """Write ``model`` (packed experts) as a published-layout directory (one shard; see the module doc)."""
    tensors = packed_k3_tensors(model, naming, text_prefix)
    text = config_to_k3(model.config)
    text["torch_dtype"] = str(model.get_input_embeddings().weight.dtype).replace("torch.", "")
    config = {
        "model_type": K3_VL_MODEL_TYPE,
        "text_config": text,
        "tie_word_embeddings": model.config.tie_word_embeddings,
    }
    if not text_prefix:
        config = {**text, "tie_word_embeddings": model.config.tie_word_embeddings}
    with atomic_directory(path) as tmp:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(tensors, os.path.join(tmp, SAFETENSORS_SINGLE), metadata={"format": "pt"})


def dequantized_state_dict(model, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """``model``'s state dict with every packed expert stack decoded once into ``dtype`` (scales dropped): what
    the same model with ``expert_format="dense"`` loads."""
    stacks = _packed_stacks(model)
    out = {}
    for name, t in model.state_dict().items():
        found = stack_of(name)
        owner = found and found[0] in stacks
        if owner and found[2]:
            continue
        if owner:
            experts = stacks[found[0]]
            t = decode(
                experts.expert_format,
                t,
                getattr(experts, f"{found[1]}_scale"),
                experts.logical_shapes[found[1]][2],
                dtype,
            )
        out[name] = t
    return out


def write_tiny_packed_checkpoint(
    path: Union[str, os.PathLike],
    expert_format: str = "mxfp4",
    seed: int = 0,
    dequantized_path: Optional[Union[str, os.PathLike]] = None,
    naming: str = "k3",
    text_prefix: bool = True,
    **overrides,
) -> None:
    """Generate the ``tiny`` preset (``overrides`` applied) with packed experts drawn from ``seed`` and write it
    in the published layout (``naming``, ``text_prefix``: see ``save_packed_k3_checkpoint``) to ``path``; with
    ``dequantized_path``, also the same model with the experts dequantised once into fp32, as a dense
    K3-format checkpoint."""
    torch.manual_seed(seed)
    model = MoEPluginForCausalLM(preset_config("tiny", expert_format=expert_format, **overrides))
    save_packed_k3_checkpoint(model, path, naming, text_prefix)
    if dequantized_path is not None:
        dense = MoEPluginForCausalLM(preset_config("tiny", **overrides))
        dense.load_state_dict(dequantized_state_dict(model), strict=True)
        save_k3_checkpoint(dense, dequantized_path)
