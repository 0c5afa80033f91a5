"""Tensor names and layouts of the three state dicts, and the rules between them (strings and shapes only).

- Hugging Face (this project's models and their ``save_pretrained``): ``model.layers.{i}.self_attn.q_proj.weight``;
  routed experts stacked as ``model.layers.{i}.block_sparse_moe.experts.w1`` ``[E, F, L]`` (``w3`` the same,
  ``w2`` ``[E, L, F]``); the image+text model puts the text model under ``language_model.`` beside
  ``vision_tower.*`` and ``mm_projector.*``.
- megatron ``GPTModel`` (``moe_plugin.megatron.specs``): the same names under other prefixes, ``NAME_TABLE``;
  ``vision_tower.*`` / ``mm_projector.*`` (``moe_plugin.megatron.multimodal``) are named alike on both faces;
  an expert-parallel rank holds ``decoder.layers.{i}.mlp.experts.w1`` ``[E_local, F, L]``, the contiguous
  experts ``[first, last)``.
- K3 published: the Hugging Face names, except one tensor per expert ``...experts.{e}.w1.weight`` ``[F, L]``;
  ``self_attn.A_log`` padded to a multiple of ``A_LOG_PAD_MULTIPLE`` entries (any shape with one
  non-singleton dim: ``[P]``, ``[1, 1, P, 1]``); KDA convs ``{q,k,v}_conv1d.weight`` ``[C, 1, K]`` (a layer
  may keep ``[C, K]``: the same elements in the same order); a tied embedding stored once; no DSA indexer
  (``self_attn.indexer.*``); multi-token-prediction layers numbered after the decoder's.

Nothing here imports megatron or DeepSpeed; the planner (``weights.plan``) and the loader (``weights.loader``)
build on these rules.
"""

from __future__ import annotations

import math
import re
from typing import List, Mapping, Optional, Tuple

import torch

from ..config import ModelConfig, require
from ..fileio import safetensors_weight_map

__all__ = [
    "NAME_TABLE",
    "TEXT_PREFIX",
    "VISION_PREFIXES",
    "A_LOG_PAD_MULTIPLE",
    "NAMINGS",
    "hf_to_megatron_name",
    "megatron_to_hf_name",
    "to_hf_name",
    "base_name",
    "is_expert_tensor",
    "expert_layer",
    "is_stacked_expert",
    "k3_tensor_names",
    "k3_expert_name",
    "parse_k3_expert",
    "is_indexer_tensor",
    "strip_text_prefix",
    "is_mtp",
    "a_log_padded_length",
    "k3_shape_fits",
    "needs_k3_conversion",
    "tensor_from_k3",
    "tensor_to_k3",
    "quantised_tensors",
]

# (Hugging Face prefix, megatron prefix, layers the row applies to: None = every layer, "moe" or "dense").
# "{i}" is the 0-based layer index on both sides; the rest of a name is the same on both sides because the
# megatron submodules are the single-device layers.
NAME_TABLE: Tuple[Tuple[str, str, Optional[str]], ...] = (
    ("model.embed_tokens.", "embedding.word_embeddings.", None),
    ("model.layers.{i}.input_layernorm.", "decoder.layers.{i}.input_layernorm.", None),
    ("model.layers.{i}.self_attn.", "decoder.layers.{i}.self_attention.", None),
    ("model.layers.{i}.post_attention_layernorm.", "decoder.layers.{i}.pre_mlp_layernorm.", None),
    ("model.layers.{i}.block_sparse_moe.", "decoder.layers.{i}.mlp.", "moe"),
    ("model.layers.{i}.mlp.", "decoder.layers.{i}.mlp.", "dense"),
    ("model.layers.{i}.self_attention_res_", "decoder.layers.{i}.self_attention_res_", None),  # AttnRes points
    ("model.layers.{i}.mlp_res_", "decoder.layers.{i}.mlp_res_", None),
    ("model.output_attn_res_", "decoder.output_attn_res_", None),
    ("model.norm.", "decoder.final_layernorm.", None),
    ("lm_head.", "output_layer.", None),
)
NAMINGS = ("hf", "megatron")  # the target model's naming: this project's Hugging Face classes, or GPTModel
TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def has_vision(base_path: str) -> bool:
    """Whether the checkpoint at ``base_path`` is an image+text one (vision tower and projector tensors)."""
    return any(n.startswith(VISION_PREFIXES) for n in safetensors_weight_map(base_path))


def stores_stacked_experts(base_path: str) -> bool:
    """Whether the checkpoint at ``base_path`` holds its routed experts stacked (``...experts.w1``: this project's
    ``save_pretrained``, whatever its config.json's layout) rather than one tensor per expert (K3's published
    layout). False when it has no readable safetensors (the loader then says why)."""
    try:
        return any(_STACKED.match(n) for n in safetensors_weight_map(base_path))
    except ValueError:
        return False


A_LOG_PAD_MULTIPLE = 128  # K3: 96 heads stored as 128 entries

_MEGATRON_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.w[123]$")
_STACKED = re.compile(r"^(?P<prefix>.*\.block_sparse_moe\.experts)\.(?P<kind>w[123])$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.block_sparse_moe\.experts)\.(?P<index>\d+)\.(?P<kind>w[123])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_INDEXER = ".self_attn.indexer."
_PEFT_WRAPPER = ".base_layer."  # peft's wrappers insert this segment before the wrapped module's names
# compressed-tensors' packed FP4 (``weight_packed`` + e8m0 ``weight_scale``) and gpt-oss' ``_blocks``/``_scales``
_QUANTISED_SUFFIXES = ("_blocks", "_scales", ".weight_packed", ".weight_scale", ".weight_global_scale")
_QUANTISED_DTYPES = ("uint8", "float4_e2m1fn_x2", "float8_e8m0fnu")


def _compile(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(re.escape("{i}"), r"(?P<i>\d+)"))


_ROWS = [(_compile(hf), hf, _compile(mg), mg, when) for hf, mg, when in NAME_TABLE]


def _translate(name: str, config: Optional[ModelConfig], to_megatron: bool) -> str:
    if name.startswith(VISION_PREFIXES):  # the image model's tower and projector: one name on both faces
        return name
    for hf_re, hf, mg_re, mg, when in _ROWS:
        src_re, dst = (hf_re, mg) if to_megatron else (mg_re, hf)
        m = src_re.match(name)
        if m is None:
            continue
        i = m.groupdict().get("i")
        if when is not None and config is not None and ("moe" if config.is_moe_layer(int(i)) else "dense") != when:
            continue
        return dst.replace("{i}", i or "") + name[m.end() :]
    side = "Hugging Face" if to_megatron else "megatron"
    raise ValueError(f"name: {name!r} matches no {side} prefix of NAME_TABLE")


def hf_to_megatron_name(name: str, config: Optional[ModelConfig] = None) -> str:
    """``model.layers.1.block_sparse_moe.gate.weight`` -> ``decoder.layers.1.mlp.gate.weight``.

    With ``config`` a dense/MoE name must agree with the layer's kind."""
    return _translate(name, config, to_megatron=True)


def megatron_to_hf_name(name: str, config: ModelConfig) -> str:
    """``decoder.layers.1.mlp.gate.weight`` -> ``model.layers.1.block_sparse_moe.gate.weight``; ``config`` says
    whether ``mlp`` is the MoE (``block_sparse_moe``) or the dense MLP (``mlp``) of that layer."""
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    return _translate(name, config, to_megatron=False)


def to_hf_name(name: str, names: str, config: ModelConfig) -> str:
    """A target model's tensor name as the text model's Hugging Face name (``language_model.`` stripped;
    vision tensors unchanged)."""
    if names == "megatron":
        return megatron_to_hf_name(name, config)
    return strip_text_prefix(name)


def base_name(name: str) -> str:
    """A model entry's name without peft's ``base_layer.`` segments: ``...mlp.experts.base_layer.base_layer.w1``
    -> ``...mlp.experts.w1`` (what the name was before LoRA was added)."""
    while _PEFT_WRAPPER in name:
        name = name.replace(_PEFT_WRAPPER, ".")
    return name


def is_expert_tensor(megatron_name: str) -> bool:
    """Whether the megatron tensor is a routed-expert stack ``[E(_local), ...]``."""
    return _MEGATRON_EXPERT.match(megatron_name) is not None


def expert_layer(megatron_name: str) -> int:
    """The layer index of a megatron routed-expert stack ``decoder.layers.{i}.mlp.experts.w[123]``."""
    match = _MEGATRON_EXPERT.match(megatron_name)
    require(match is not None, "name", f"{megatron_name!r} is not a megatron routed-expert stack")
    return int(match.group(1))


def is_stacked_expert(hf_name: str) -> bool:
    """Whether the Hugging Face name is a stacked routed-expert tensor ``...block_sparse_moe.experts.w[123]``."""
    return _STACKED.match(hf_name) is not None


def k3_expert_name(stacked_name: str, expert: int) -> str:
    """``...experts.w1`` and expert 5 -> K3's ``...experts.5.w1.weight``."""
    match = _STACKED.match(stacked_name)
    require(match is not None, "name", f"{stacked_name!r} is not a stacked expert tensor (...experts.w[123])")
    return f"{match['prefix']}.{expert}.{match['kind']}.weight"


def parse_k3_expert(name: str) -> Optional[Tuple[str, int]]:
    """K3's ``...experts.5.w1.weight`` -> (``...experts.w1``, 5); None for any other name."""
    match = _PER_EXPERT.match(name)
    return (f"{match['prefix']}.{match['kind']}", int(match["index"])) if match else None


def k3_tensor_names(name: str, shape: Tuple[int, ...], experts: Optional[range] = None) -> List[str]:
    """The K3 tensor names that hold the model tensor ``name`` of ``shape``.

    For a stacked expert tensor ``[E, ...]`` that is one name per expert, of ``experts`` (default
    ``range(E)``; an expert-parallel rank passes its own ``range(first, last)``)."""
    if is_stacked_expert(name) and len(shape) == 3:
        experts = range(shape[0]) if experts is None else experts
        return [k3_expert_name(name, e) for e in experts]
    return [name]


def is_indexer_tensor(name: str) -> bool:
    """Whether ``name`` belongs to the DSA indexer, which K3 checkpoints do not have."""
    return _INDEXER in name


def strip_text_prefix(name: str) -> str:
    """``language_model.model.norm.weight`` -> ``model.norm.weight``; other names unchanged."""
    return name[len(TEXT_PREFIX) :] if name.startswith(TEXT_PREFIX) else name


def is_mtp(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (K3 numbers them after the
    decoder's ``num_layers``)."""
    layer = _LAYER.match(strip_text_prefix(name))
    return bool(layer) and int(layer.group(1)) >= num_layers


def a_log_padded_length(num_heads: int) -> int:
    """Length K3 stores ``A_log`` at: ``num_heads`` rounded up to ``A_LOG_PAD_MULTIPLE`` (96 -> 128)."""
    return -(-num_heads // A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE


def _is_a_log(name: str) -> bool:
    return name.endswith(".A_log")


def _is_conv(name: str) -> bool:
    return name.endswith("_conv1d.weight")


def k3_shape_fits(name: str, stored: Tuple[int, ...], shape: Tuple[int, ...]) -> Optional[str]:
    """None if a K3 tensor ``name`` of shape ``stored`` loads into a model tensor of ``shape``, else what the
    model needs, for the error message ("" where the shapes must simply be equal). A_log: a vector (one non-singleton
    dim) of at least as many entries; convs: the same channels and elements (``[C, 1, K]`` vs ``[C, K]``); anything
    else: the same shape."""
    if _is_a_log(name):
        numel = math.prod(stored)
        if numel == max(stored, default=1) and numel >= math.prod(shape):
            return None
        return (
            f"a padded vector of at least {math.prod(shape)} entries ([P] or with singleton dims such as [1, 1, P, 1])"
        )
    if _is_conv(name) and stored[:1] == shape[:1] and math.prod(stored) == math.prod(shape):
        return None
    return None if tuple(stored) == tuple(shape) else ""


def needs_k3_conversion(name: str, stored: Tuple[int, ...], shape: Tuple[int, ...]) -> bool:
    """Whether ``tensor_from_k3`` changes the stored elements (an A_log with padding to drop); a conv stored
    ``[C, 1, K]`` for a ``[C, K]`` layer has the same elements in the same order and needs none."""
    return _is_a_log(name) and tuple(stored) != tuple(shape)


def tensor_from_k3(name: str, stored: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """One K3 tensor in the model's layout (A_log unpadded, conv weights reshaped); shape left to the check."""
    if _is_a_log(name):
        reason = k3_shape_fits(name, tuple(stored.shape), tuple(shape))
        if reason is not None:
            raise ValueError(f"{name}: expected {reason}, got shape {list(stored.shape)}")
        return stored.reshape(-1)[: math.prod(shape)].reshape(shape)
    if _is_conv(name) and stored.numel() == math.prod(shape) and stored.shape[0] == shape[0]:
        return stored.reshape(shape)  # K3's [C, 1, K] into a layer that keeps [C, K], or the reverse
    return stored


def tensor_to_k3(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One non-expert model tensor as K3 stores it: A_log zero-padded to ``a_log_padded_length`` entries
    (a new tensor), a ``[C, K]`` conv as ``[C, 1, K]`` (a view); anything else unchanged."""
    if _is_a_log(name):
        flat = tensor.reshape(-1)
        padded = flat.new_zeros(a_log_padded_length(flat.numel()))
        padded[: flat.numel()] = flat
        return padded
    if _is_conv(name) and tensor.dim() == 2:
        return tensor.unsqueeze(1)
    return tensor


def quantised_tensors(dtypes: Mapping[str, str]) -> List[str]:
    """The names, of ``{name: torch dtype name}``, that hold MXFP4-quantised data (packed FP4 blocks, e8m0
    scales, or uint8 storage), which the loaders refuse."""
    return sorted(
        name for name, dtype in dtypes.items() if name.endswith(_QUANTISED_SUFFIXES) or dtype in _QUANTISED_DTYPES
    )
