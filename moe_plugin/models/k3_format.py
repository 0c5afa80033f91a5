"""K3-format checkpoints: read the published Kimi K3 layout into this project's models and write it back.

Tensor names are K3's already, so most tensors map one to one. The differences (``moe_plugin.weights.names``
holds the rules; loading streams through ``moe_plugin.weights.load_state``):

- routed experts: K3 stores one tensor per expert, ``...block_sparse_moe.experts.{e}.w1.weight`` ``[F, L]``
  (``w3`` the same, ``w2`` ``[L, F]``); the model stacks them, ``experts.w1`` ``[E, F, L]``, ``w2`` ``[E, L, F]``;
- ``self_attn.A_log``: K3 stores it padded to a fixed length (128 entries for 96 heads; only the first
  ``num_heads`` are real). Any shape with one non-singleton dim is read (``[P]``, ``[1, 1, P, 1]``, ...);
  written back as ``[P]`` with P = num_heads rounded up to ``A_LOG_PAD_MULTIPLE``, zero padding;
- KDA conv weights ``{q,k,v}_conv1d.weight``: K3 stores ``[C, 1, K]``; reshaped to whatever the layer holds;
- the multimodal checkpoint puts the text model under ``language_model.`` beside ``vision_tower.*`` and
  ``mm_projector.*``, exactly as ``MoEPluginForConditionalGeneration`` names them; loading it into the text
  model strips the prefix (and drops the vision tensors with ``ignore_vision=True``);
- the DSA indexer (``self_attn.indexer.*``) is not in K3: a model with the indexer on loads a K3 checkpoint
  with a fresh indexer; its tensors are written back (under DeepSeek-V3.2's names) so this project reloads them;
- multi-token-prediction layers (``model.layers.{i}`` with i >= num_hidden_layers) are not supported:
  unknown tensors unless ``ignore_mtp=True`` drops them;
- routed experts ship in MXFP4 in the real K3 release: such tensors are detected and refused (dequantise
  them to bf16 first).

Every name and shape problem is reported in one ValueError (unknown, missing and misshapen tensors, in K3's
names) before anything is loaded.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Type, Union

import torch
from safetensors.torch import save_file
from torch import nn

from ..compat.transformers import convert_file_size_to_int
from ..fileio import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, atomic_directory
from ..weights.loader import state_from_tensors
from ..weights.names import (
    A_LOG_PAD_MULTIPLE,
    TEXT_PREFIX,
    VISION_PREFIXES,
    a_log_padded_length,
    is_indexer_tensor,
    is_stacked_expert,
    k3_expert_name,
    k3_tensor_names,
    strip_text_prefix,
    tensor_from_k3,
    tensor_to_k3,
)
from .configuration import MoEPluginConfig
from .k3_config import config_from_k3, config_to_k3
from .loading import load_k3_weights
from .modeling import MoEPluginForCausalLM
from .modeling_vl import MoEPluginForConditionalGeneration

__all__ = [
    "A_LOG_PAD_MULTIPLE",
    "TEXT_PREFIX",
    "VISION_PREFIXES",
    "config_from_k3",
    "config_to_k3",
    "state_dict_from_k3",
    "state_dict_to_k3",
    "load_k3_checkpoint",
    "save_k3_checkpoint",
    "a_log_padded_length",
    "k3_tensor_names",
    "tensor_from_k3",
    "strip_text_prefix",
    "is_indexer_tensor",
    "expected_shapes",
]

CONFIG_NAME = "config.json"

Shapes = Dict[str, Tuple[int, ...]]


def expected_shapes(config: MoEPluginConfig, model_cls: Type[nn.Module] = MoEPluginForCausalLM) -> Shapes:
    """Names and shapes of ``model_cls(config)``'s state dict, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def state_dict_from_k3(
    tensors: Mapping[str, torch.Tensor],
    config: MoEPluginConfig,
    model_cls: Type[nn.Module] = MoEPluginForCausalLM,
    ignore_mtp: bool = False,
    ignore_vision: bool = False,
    strict: bool = True,
) -> Dict[str, torch.Tensor]:
    """K3-named tensors -> a state dict for ``model_cls(config)`` (text model, or image+text model).

    tensors: name -> tensor as stored in a K3 checkpoint (per-expert ``[F, L]``/``[L, F]``, padded ``A_log``,
    ``[C, 1, K]`` conv weights, optional ``language_model.`` prefix). Returns stacked experts ``[E, F, L]`` /
    ``[E, L, F]``, ``A_log`` ``[num_heads]``-sized, in the checkpoint's dtypes. The indexer of a model with
    ``use_dsa_indexer`` may be absent (it is then left out: keep the model's fresh one). strict=False skips
    tensors the model lacks. Raises one ValueError listing unknown, missing and misshapen tensors.
    """
    return state_from_tensors(
        tensors,
        expected_shapes(config, model_cls),
        config=config.to_model_config(),
        layout="k3",
        strict=strict,
        ignore_vision=ignore_vision,
        ignore_mtp=ignore_mtp,
    )


def _k3_items(state_dict: Mapping[str, torch.Tensor], config: MoEPluginConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """(K3 name, tensor) pairs; experts are views into the stacked tensors, A_log a new padded vector."""
    embeddings = {t.data_ptr() for n, t in state_dict.items() if n.endswith("model.embed_tokens.weight")}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if is_stacked_expert(name) and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield k3_expert_name(name, e), tensor[e]
        elif config.tie_word_embeddings and name.endswith("lm_head.weight") and tensor.data_ptr() in embeddings:
            continue  # tied: K3 stores the embedding only
        else:
            yield name, tensor_to_k3(name, tensor)


def state_dict_to_k3(state_dict: Mapping[str, torch.Tensor], config: MoEPluginConfig) -> Dict[str, torch.Tensor]:
    """A model's state dict -> K3-named tensors (inverse of ``state_dict_from_k3``).

    The image+text model's state dict already carries the ``language_model.`` prefix K3 uses. Per-expert
    tensors are views of the stacked ones: clone them before handing them to ``safetensors``.
    """
    return dict(_k3_items(state_dict, config))


def load_k3_checkpoint(
    path: Union[str, os.PathLike],
    model_cls: Type[nn.Module] = MoEPluginForCausalLM,
    ignore_mtp: bool = False,
    ignore_vision: bool = False,
    dtype: Optional[torch.dtype] = None,
    strict: bool = True,
    **config_overrides,
) -> nn.Module:
    """The model of a K3-format directory (``config.json`` + ``model.safetensors`` or index + shards).

    model_cls: ``MoEPluginForCausalLM`` or ``MoEPluginForConditionalGeneration``. config_overrides are
    ``MoEPluginConfig`` keys (``use_dsa_indexer=True`` adds a fresh indexer). dtype: the model's dtype before
    loading (the router stays fp32). The tensors stream into the built model one at a time
    (``weights.load_state``); strict=False skips checkpoint tensors the model lacks. Returned in eval mode.
    """
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"path: {path} has no {CONFIG_NAME}")
    with open(config_path) as f:
        config = config_from_k3(json.load(f), **config_overrides)
    model = model_cls(config)
    load_k3_weights(model, path, dtype, strict=strict, ignore_vision=ignore_vision, ignore_mtp=ignore_mtp)
    return model


def _shard_plan(items: List[Tuple[str, torch.Tensor]], max_bytes: int) -> List[List[Tuple[str, torch.Tensor]]]:
    shards: List[List[Tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def save_k3_checkpoint(
    model: nn.Module, path: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB"
) -> List[str]:
    """Write ``model`` in K3's layout: ``config.json`` and safetensors shards of at most ``max_shard_size``
    (bytes, or a string such as "5GB"; a tensor larger than that gets a shard of its own), with
    ``model.safetensors.index.json`` when there is more than one shard. Returns the files written.

    ``path`` is replaced as a whole and only once every file is written (``fileio.atomic_directory``): a
    failed save leaves the previous checkpoint there intact, and no stale shard of it survives.
    """
    with atomic_directory(path) as tmp:
        return _write_k3_checkpoint(model, tmp, max_shard_size)


def _write_k3_checkpoint(model: nn.Module, path: str, max_shard_size: Union[int, str]) -> List[str]:
    multimodal = isinstance(model, MoEPluginForConditionalGeneration)
    k3_config = config_to_k3(model.config, multimodal=multimodal)
    k3_config["torch_dtype"] = str(model.get_input_embeddings().weight.dtype).replace("torch.", "")
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(k3_config, f, indent=2, sort_keys=True)
    items = list(_k3_items(model.state_dict(), model.config))
    shards = _shard_plan(items, convert_file_size_to_int(max_shard_size))
    written = [CONFIG_NAME]
    weight_map: Dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        # clone: safetensors refuses tensors that share storage, as the per-expert views do
        save_file(
            {name: t.contiguous().clone() for name, t in shard},
            os.path.join(path, file_name),
            metadata={"format": "pt"},
        )
        weight_map.update((name, file_name) for name, _ in shard)
        written.append(file_name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for _, t in items)
        with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        written.append(SAFETENSORS_INDEX)
    return written
