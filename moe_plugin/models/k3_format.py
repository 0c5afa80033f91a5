"""K3-format checkpoints: read the published Kimi K3 layout into this project's models and write it back.

Tensor names are K3's already (ARCHITECTURE.md 7), so most tensors map one to one. The differences:

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

Every name problem is reported in one ValueError (unknown and missing tensors, in K3's names), every shape
problem in another, before anything is loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Type, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.utils.hub import convert_file_size_to_int

from ..fileio import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, atomic_directory, safetensors_weight_map
from .configuration import MoEPluginConfig
from .k3_config import config_from_k3, config_to_k3
from .modeling import MoEPluginForCausalLM
from .modeling_vl import MoEPluginForConditionalGeneration

__all__ = ["A_LOG_PAD_MULTIPLE", "config_from_k3", "config_to_k3", "state_dict_from_k3", "state_dict_to_k3",
           "load_k3_checkpoint", "save_k3_checkpoint", "a_log_padded_length", "k3_tensor_names",
           "tensor_from_k3", "strip_text_prefix", "is_indexer_tensor"]

A_LOG_PAD_MULTIPLE = 128  # K3: 96 heads stored as 128 entries
TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
CONFIG_NAME = "config.json"

LISTED = 20  # names shown per category in an error

_EXPERT_K3 = re.compile(r"^(?P<prefix>.*\.block_sparse_moe\.experts)\.(?P<index>\d+)\.(?P<kind>w[123])\.weight$")
_EXPERT_OURS = re.compile(r"^(?P<prefix>.*\.block_sparse_moe\.experts)\.(?P<kind>w[123])$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_INDEXER = ".self_attn.indexer."
# compressed-tensors' packed FP4 (``weight_packed`` + e8m0 ``weight_scale``) and gpt-oss' ``_blocks``/``_scales``
_MXFP4_SUFFIXES = ("_blocks", "_scales", ".weight_packed", ".weight_scale", ".weight_global_scale")
_MXFP4_DTYPES = tuple(getattr(torch, name) for name in ("uint8", "float4_e2m1fn_x2", "float8_e8m0fnu")
                      if hasattr(torch, name))

Shapes = Dict[str, Tuple[int, ...]]


def a_log_padded_length(num_heads: int) -> int:
    """Length K3 stores ``A_log`` at: ``num_heads`` rounded up to ``A_LOG_PAD_MULTIPLE`` (96 -> 128)."""
    return -(-num_heads // A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE


def _listing(kind: str, names: List[str]) -> str:
    shown = ", ".join(names[:LISTED])
    more = f", ... ({len(names) - LISTED} more)" if len(names) > LISTED else ""
    return f"{len(names)} {kind} tensor(s): {shown}{more}"


def _check_not_mxfp4(tensors: Mapping[str, torch.Tensor]) -> None:
    quantised = sorted(name for name, t in tensors.items()
                       if name.endswith(_MXFP4_SUFFIXES) or t.dtype in _MXFP4_DTYPES)
    if quantised:
        raise ValueError(
            "tensors: the checkpoint holds MXFP4-quantised tensors (FP4 e2m1 blocks with e8m0 scales); MXFP4 "
            "dequantisation is not supported yet: dequantise the routed experts to bf16 first. "
            + _listing("quantised", quantised))


def _is_multimodal(model_cls: Type[nn.Module]) -> bool:
    return issubclass(model_cls, MoEPluginForConditionalGeneration)


def expected_shapes(config: MoEPluginConfig, model_cls: Type[nn.Module] = MoEPluginForCausalLM) -> Shapes:
    """Names and shapes of ``model_cls(config)``'s state dict, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def k3_tensor_names(name: str, shape: Tuple[int, ...], experts: Optional[range] = None) -> List[str]:
    """The K3 tensor names that hold the model tensor ``name`` of ``shape``.

    For a stacked expert tensor ``[E, ...]`` that is one name per expert, of ``experts`` (default
    ``range(E)``; an expert-parallel rank passes its own ``range(first, last)``)."""
    match = _EXPERT_OURS.match(name)
    if match and len(shape) == 3:
        experts = range(shape[0]) if experts is None else experts
        return [f"{match['prefix']}.{e}.{match['kind']}.weight" for e in experts]
    return [name]


def is_indexer_tensor(name: str) -> bool:
    """Whether ``name`` belongs to the DSA indexer, which K3 checkpoints do not have."""
    return _INDEXER in name


def _a_log_from_k3(name: str, stored: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    heads = math.prod(shape)
    if stored.numel() != max(stored.shape, default=1) or stored.numel() < heads:
        raise ValueError(f"{name}: expected a padded vector of at least {heads} entries ([P] or with singleton "
                         f"dims such as [1, 1, P, 1]), got shape {list(stored.shape)}")
    return stored.reshape(-1)[:heads].reshape(shape)


def tensor_from_k3(name: str, stored: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """One K3 tensor in the model's layout (A_log unpadded, conv weights reshaped); shape left to the check."""
    if name.endswith(".A_log"):
        return _a_log_from_k3(name, stored, shape)
    if name.endswith("_conv1d.weight") and stored.numel() == math.prod(shape) and stored.shape[0] == shape[0]:
        return stored.reshape(shape)  # K3's [C, 1, K] into a layer that keeps [C, K], or the reverse
    return stored


def _convert_from_k3(tensors: Mapping[str, torch.Tensor], config: MoEPluginConfig, shapes: Shapes,
                     multimodal: bool, ignore_mtp: bool, ignore_vision: bool) -> Dict[str, torch.Tensor]:
    _check_not_mxfp4(tensors)
    prefix = TEXT_PREFIX if multimodal else ""
    num_layers = config.num_hidden_layers
    out: Dict[str, torch.Tensor] = {}
    source: Dict[str, str] = {}  # model name -> checkpoint name, for messages
    experts: Dict[str, Dict[int, Tuple[str, torch.Tensor]]] = defaultdict(dict)
    unknown: List[str] = []
    for k3_name, tensor in tensors.items():
        if k3_name.startswith(VISION_PREFIXES):
            if not multimodal and ignore_vision:
                continue
            name = k3_name
        else:
            if ignore_mtp and _is_mtp(k3_name, num_layers):
                continue
            name = prefix + strip_text_prefix(k3_name)
        match = _EXPERT_K3.match(name)
        if match and f"{match['prefix']}.{match['kind']}" in shapes:
            experts[f"{match['prefix']}.{match['kind']}"][int(match["index"])] = (k3_name, tensor)
            continue
        if name not in shapes:
            unknown.append(k3_name)
            continue
        out[name] = tensor_from_k3(k3_name, tensor, shapes[name])
        source[name] = k3_name

    missing: List[str] = []
    for name, per_expert in experts.items():
        count = shapes[name][0]
        unknown += [k3 for e, (k3, _) in per_expert.items() if e >= count]
        missing += [n for e, n in enumerate(k3_tensor_names(name, shapes[name])) if e not in per_expert]
    if config.tie_word_embeddings and prefix + "lm_head.weight" not in out:
        embed = out.get(prefix + "model.embed_tokens.weight")
        if embed is not None:
            out[prefix + "lm_head.weight"] = embed
            source[prefix + "lm_head.weight"] = source[prefix + "model.embed_tokens.weight"]
    has_indexer = any(_INDEXER in name for name in out)
    for name, shape in shapes.items():
        if name in out or name in experts or (_INDEXER in name and not has_indexer):
            continue  # a K3 checkpoint has no indexer: it stays freshly initialised
        missing += k3_tensor_names(name, shape)
    if unknown or missing:
        raise ValueError("tensors: the checkpoint does not match the model: "
                         + "; ".join(_listing(kind, sorted(names)) for kind, names in
                                     (("unknown", unknown), ("missing", missing)) if names)
                         + ("; multi-token-prediction layers are not supported: pass ignore_mtp=True to drop them"
                            if any(_is_mtp(n, num_layers) for n in unknown) else ""))

    mismatched = []
    for name, per_expert in experts.items():
        want = shapes[name][1:]
        mismatched += [f"{k3}: checkpoint {list(t.shape)}, model {list(want)} (one expert of {name})"
                       for _, (k3, t) in sorted(per_expert.items()) if tuple(t.shape) != want]
    mismatched += [f"{source[name]}: checkpoint {list(t.shape)}, model {list(shapes[name])}"
                   for name, t in out.items() if tuple(t.shape) != shapes[name]]
    if mismatched:
        raise ValueError(f"tensors: {len(mismatched)} tensor(s) differ in shape from the model: "
                         + "; ".join(mismatched[:LISTED]))
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[e][1] for e in range(shapes[name][0])])
    return out


def strip_text_prefix(k3_name: str) -> str:
    return k3_name[len(TEXT_PREFIX):] if k3_name.startswith(TEXT_PREFIX) else k3_name


def _is_mtp(k3_name: str, num_layers: int) -> bool:
    """Whether ``k3_name`` belongs to a multi-token-prediction layer (K3 numbers them after the decoder's)."""
    layer = _LAYER.match(strip_text_prefix(k3_name))
    return bool(layer) and int(layer.group(1)) >= num_layers


def state_dict_from_k3(tensors: Mapping[str, torch.Tensor], config: MoEPluginConfig,
                       model_cls: Type[nn.Module] = MoEPluginForCausalLM, ignore_mtp: bool = False,
                       ignore_vision: bool = False) -> Dict[str, torch.Tensor]:
    """K3-named tensors -> a state dict for ``model_cls(config)`` (text model, or image+text model).

    tensors: name -> tensor as stored in a K3 checkpoint (per-expert ``[F, L]``/``[L, F]``, padded ``A_log``,
    ``[C, 1, K]`` conv weights, optional ``language_model.`` prefix). Returns stacked experts ``[E, F, L]`` /
    ``[E, L, F]``, ``A_log`` ``[num_heads]``-sized, in the checkpoint's dtypes. The indexer of a model with
    ``use_dsa_indexer`` may be absent (it is then left out: keep the model's fresh one).
    Raises ValueError listing unknown and missing tensors, or naming the tensors whose shapes differ.
    """
    return _convert_from_k3(tensors, config, expected_shapes(config, model_cls), _is_multimodal(model_cls),
                            ignore_mtp, ignore_vision)


def _k3_items(state_dict: Mapping[str, torch.Tensor], config: MoEPluginConfig
              ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(K3 name, tensor) pairs; experts are views into the stacked tensors, A_log a new padded vector."""
    embeddings = {t.data_ptr() for n, t in state_dict.items() if n.endswith("model.embed_tokens.weight")}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        match = _EXPERT_OURS.match(name)
        if match and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield f"{match['prefix']}.{e}.{match['kind']}.weight", tensor[e]
        elif name.endswith(".A_log"):
            flat = tensor.reshape(-1)
            padded = flat.new_zeros(a_log_padded_length(flat.numel()))
            padded[: flat.numel()] = flat
            yield name, padded
        elif name.endswith("_conv1d.weight") and tensor.dim() == 2:
            yield name, tensor.unsqueeze(1)  # K3 keeps nn.Conv1d's [C, 1, K]
        elif config.tie_word_embeddings and name.endswith("lm_head.weight") and tensor.data_ptr() in embeddings:
            continue  # tied: K3 stores the embedding only
        else:
            yield name, tensor


def state_dict_to_k3(state_dict: Mapping[str, torch.Tensor], config: MoEPluginConfig) -> Dict[str, torch.Tensor]:
    """A model's state dict -> K3-named tensors (inverse of ``state_dict_from_k3``).

    The image+text model's state dict already carries the ``language_model.`` prefix K3 uses. Per-expert
    tensors are views of the stacked ones: clone them before handing them to ``safetensors``.
    """
    return dict(_k3_items(state_dict, config))


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    weight_map = safetensors_weight_map(path)
    tensors: Dict[str, torch.Tensor] = {}
    for file_path in sorted(set(weight_map.values())):
        with safe_open(file_path, framework="pt") as shard:
            for name in shard.keys():
                if weight_map.get(name) != file_path:
                    raise ValueError(f"path: tensor {name} is in {os.path.basename(file_path)} but {SAFETENSORS_INDEX} "
                                     f"maps it to {weight_map.get(name)}")
                tensors[name] = shard.get_tensor(name)
    not_found = sorted(set(weight_map) - set(tensors))
    if not_found:
        raise ValueError(f"path: {SAFETENSORS_INDEX} lists tensors no shard holds: " + _listing("absent", not_found))
    return tensors


def load_k3_checkpoint(path: Union[str, os.PathLike], model_cls: Type[nn.Module] = MoEPluginForCausalLM,
                       ignore_mtp: bool = False, ignore_vision: bool = False,
                       dtype: Optional[torch.dtype] = None, **config_overrides) -> nn.Module:
    """The model of a K3-format directory (``config.json`` + ``model.safetensors`` or index + shards).

    model_cls: ``MoEPluginForCausalLM`` or ``MoEPluginForConditionalGeneration``. config_overrides are
    ``MoEPluginConfig`` keys (``use_dsa_indexer=True`` adds a fresh indexer). dtype: the model's dtype before
    loading (the router stays fp32). The load is strict; the model is returned in eval mode.
    """
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"path: {path} has no {CONFIG_NAME}")
    with open(config_path) as f:
        config = config_from_k3(json.load(f), **config_overrides)
    tensors = _read_tensors(path)
    model = model_cls(config)
    if dtype is not None:
        model.to(dtype)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = _convert_from_k3(tensors, config, shapes, _is_multimodal(model_cls), ignore_mtp, ignore_vision)
    result = model.load_state_dict(state, strict=False)
    fresh = [name for name in result.missing_keys if _INDEXER not in name]
    if fresh or result.unexpected_keys:  # _convert_from_k3 already checked names: this is a safety net
        raise ValueError(f"tensors: loading left {fresh[:LISTED]} missing and {result.unexpected_keys[:LISTED]} "
                         "unexpected")
    return model.eval()


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


def save_k3_checkpoint(model: nn.Module, path: Union[str, os.PathLike],
                       max_shard_size: Union[int, str] = "5GB") -> List[str]:
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
        save_file({name: t.contiguous().clone() for name, t in shard}, os.path.join(path, file_name),
                  metadata={"format": "pt"})
        weight_map.update((name, file_name) for name, _ in shard)
        written.append(file_name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for _, t in items)
        with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        written.append(SAFETENSORS_INDEX)
    return written
