"""A tiny Kimi K3 base in the release's exact format, written from the published facts (docs/k3-formats.md,
"The release as downloaded"): what the tests of the published layout load.

``write_k3_release(path)`` writes:

- ``config.json``: the published ``config.json`` (``tests/fixtures/k3/config.json``, every key) shrunk by
  ``shrink_k3_config``: only sizes change, every key is kept; the vocabulary is ``n_base`` ordinary ids followed
  by the release's 256 special ids by position (``[BOS]`` = n_base, ``<|end_of_msg|>`` = n_base + 2,
  ``<|media_pad|>`` = n_base + 21, ``[PAD]`` = n_base + 255, ...), and the config's token ids follow them;
- ``generation_config.json`` (eos = ``<|end_of_msg|>``, as the release's);
- the tensors of ``release_tensor_specs``: the release's names (``language_model.model.layers.N...``,
  ``language_model.lm_head``, ``mm_projector.*``, ``vision_tower.*``) and dtypes (bf16, with the families the
  release keeps in fp32 in fp32; ``A_log`` padded to 128 entries as the release pads it; routed experts MXFP4 as
  per-expert ``weight_packed`` / ``weight_scale`` uint8), in safetensors shards named as the release names them
  (``model-00001-of-000007.safetensors``) with ``model.safetensors.index.json``;
- ``preprocessor_config.json`` with the release's processor keys (``media_proc_cfg``);
- every file of ``tokenizer_dir`` (the K3-style tokenizer fixture, tests/fixtures/k3_tokenizer/), copied in.

Values are random but deterministic from ``seed``, at a scale that gives a sane forward (linear weights
``N(0, 1/in)``, norms 1: a loss near ln(vocab)). The whole base is about 0.8 MB, written in about a second. This
module is harness code: it computes the tensor names and shapes from the config's keys by itself, not through the
package's model, so that the package's reading of the release is checked against it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from safetensors.torch import save_file

from ..fileio import SAFETENSORS_INDEX, atomic_directory
from ..ops.quant import encode

__all__ = [
    "PUBLISHED_CONFIG",
    "SPECIAL_OFFSETS",
    "TINY_SIZES",
    "TensorSpec",
    "read_published_config",
    "release_tensor_specs",
    "shrink_k3_config",
    "special_token_ids",
    "write_k3_release",
]

# the published config.json, kept as data beside the tests that read it
PUBLISHED_CONFIG = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "k3" / "config.json"
NUM_SPECIAL = 256  # the release's special ids: 163584..163839 after 163,584 ordinary ones
# the named special tokens by their offset after the ordinary vocabulary, as the release places them
SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}
A_LOG_STORED = 128  # the release stores A_log padded to a multiple of 128 entries (96 real heads -> 128)
DEFAULT_N_BASE = 512  # the K3 tokenizer fixture's ordinary vocabulary (256 bytes + 256 merges)
# The shrunk sizes: 4 layers in the published pattern (layers 1-3 KDA, 4 MLA, 1-based; layer 0 dense, the rest
# MoE), Attention Residuals blocks of 2 layers, 8 experts top-2 over a latent of 32 (MXFP4 needs multiples of
# 32), two shared experts as published. text: keys of text_config, linear: of its linear_attn_config, vision:
# of vision_config. The tower's qkv width (48 = 2 heads x 24) differs from its hidden width (32), as published.
TINY_SIZES: Dict[str, Dict[str, Any]] = {
    "text": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "attn_res_block_size": 2,
    },
    "linear": {"num_heads": 2, "head_dim": 16, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    "vision": {
        "vt_hidden_size": 32,
        "vt_intermediate_size": 64,
        "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 2,
        "qkv_hidden_size": 48,
        "mm_hidden_size": 32,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
    },
}
# families the release stores in fp32 under its bf16 dtype (docs/k3-formats.md)
_FP32_SUFFIXES = (
    ".A_log",
    ".dt_bias",
    ".q_conv1d.weight",
    ".k_conv1d.weight",
    ".v_conv1d.weight",
    ".o_norm.weight",
    ".e_score_correction_bias",
)
# preprocessor_config.json as the release writes it (kimi_k3_vision_processing.KimiK3VisionProcessor's keys)
_MEDIA_PROC_CFG = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "in_patch_limit_each_frame": 16384,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "transparent_bg_config": {"pattern": "chessboard"},
    "transparent_bg_fill_stage": "after_resize",
}
_PREPROCESSOR = {
    "auto_map": {
        "AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor",
        "AutoProcessor": "kimi_k3_processor.KimiK3Processor",
    },
    "image_processor_type": "KimiK3VisionProcessor",
    "processor_class": "KimiK3Processor",
    "media_proc_cfg": _MEDIA_PROC_CFG,
}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: its name in the release, its shape and its dtype as stored."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


def read_published_config(path: Union[str, os.PathLike, None] = None) -> Dict[str, Any]:
    """The published ``config.json`` (default ``PUBLISHED_CONFIG``), every key."""
    path = Path(path) if path is not None else PUBLISHED_CONFIG
    if not path.is_file():
        raise ValueError(
            f"published_config: {path} is not a file; give the published K3 config.json "
            f"(the repository keeps it at tests/fixtures/k3/config.json)"
        )
    return json.loads(path.read_text())


def special_token_ids(n_base: int) -> Dict[str, int]:
    """The named special tokens' ids after ``n_base`` ordinary ids, placed as the release places them."""
    return {token: n_base + offset for token, offset in SPECIAL_OFFSETS.items()}


def _set(section: Dict[str, Any], key: str, value: Any, where: str) -> None:
    if key not in section:  # shrinking changes sizes only: a key the release lacks is a bug here
        raise KeyError(f"{where}{key}: not in the published config, so it cannot be shrunk")
    section[key] = value


def shrink_k3_config(
    published: Mapping[str, Any], n_base: int = DEFAULT_N_BASE, sizes: Optional[Mapping[str, Mapping]] = None
) -> Dict[str, Any]:
    """A deep copy of the published ``config.json`` with only its sizes changed (``TINY_SIZES``, or ``sizes``
    with the same sections) and its vocabulary ``n_base + 256`` with the token ids the release's layout gives
    (bos ``[BOS]``, eos ``<|end_of_msg|>``, pad ``[PAD]``, ``media_placeholder_token_id`` ``<|media_pad|>``).
    Every key of the published config is kept; nothing is added."""
    sizes = sizes if sizes is not None else TINY_SIZES
    cfg = copy.deepcopy(dict(published))
    text, vision = cfg["text_config"], cfg["vision_config"]
    lin = text["linear_attn_config"]
    for key, value in sizes.get("text", {}).items():
        _set(text, key, value, "text_config.")
    for key, value in sizes.get("linear", {}).items():
        _set(lin, key, value, "text_config.linear_attn_config.")
    for key, value in sizes.get("vision", {}).items():
        _set(vision, key, value, "vision_config.")
    _set(vision, "text_hidden_size", text["hidden_size"], "vision_config.")
    ids = special_token_ids(n_base)
    tokens = {
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["<|end_of_msg|>"],
        "pad_token_id": ids["[PAD]"],
    }
    for section, where in ((cfg, ""), (text, "text_config.")):
        for key, value in tokens.items():
            _set(section, key, value, where)
    _set(text, "vocab_size", n_base + NUM_SPECIAL, "text_config.")
    _set(cfg, "media_placeholder_token_id", ids["<|media_pad|>"], "")
    return cfg


def _expert_specs(prefix: str, num_experts: int, f: int, latent: int) -> Iterator[TensorSpec]:
    # MXFP4: two codes a byte, one E8M0 scale per 32 inputs; w1/w3 [F, L], w2 [L, F] logically
    for e in range(num_experts):
        for w, (out, inp) in (("w1", (f, latent)), ("w2", (latent, f)), ("w3", (f, latent))):
            yield TensorSpec(f"{prefix}experts.{e}.{w}.weight_packed", (out, inp // 2), torch.uint8)
            yield TensorSpec(f"{prefix}experts.{e}.{w}.weight_scale", (out, math.ceil(inp / 32)), torch.uint8)


def _layer_specs(text: Mapping[str, Any], i: int) -> Iterator[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of decoder layer ``i`` (0-based) in the release, without the ``language_model.`` prefix."""
    d = text["hidden_size"]
    lin = text["linear_attn_config"]
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    yield from ((p + n, (d,)) for n in ("input_layernorm.weight", "post_attention_layernorm.weight"))
    if text.get("attn_res_block_size") is not None:
        for point in ("self_attention_res", "mlp_res"):
            yield p + f"{point}_proj.weight", (1, d)  # nn.Linear(d, 1)
            yield p + f"{point}_norm.weight", (d,)
    if i + 1 in lin["full_attn_layers"]:  # the lists are 1-based
        h, qr, kvr = text["num_attention_heads"], text["q_lora_rank"], text["kv_lora_rank"]
        nope, rope, vd = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
        yield a + "q_a_proj.weight", (qr, d)
        yield a + "q_a_layernorm.weight", (qr,)
        yield a + "q_b_proj.weight", (h * (nope + rope), qr)
        yield a + "kv_a_proj_with_mqa.weight", (kvr + rope, d)
        yield a + "kv_a_layernorm.weight", (kvr,)
        yield a + "kv_b_proj.weight", (h * (nope + vd), kvr)
        yield a + "g_proj.weight", (h * vd, d)
        yield a + "o_proj.weight", (d, h * vd)
    else:
        h, k, conv = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
        hk = h * k
        for name in ("q", "k", "v"):
            yield a + f"{name}_proj.weight", (hk, d)
            yield a + f"{name}_conv1d.weight", (hk, 1, conv)
        yield a + "f_a_proj.weight", (k, d)  # the decay gate's rank is the head dim
        yield a + "f_b_proj.weight", (hk, k)
        yield a + "b_proj.weight", (h, d)
        yield a + "g_proj.weight", (hk, d)
        yield a + "A_log", (-(-h // A_LOG_STORED) * A_LOG_STORED,)  # padded: 96 -> 128, 2 -> 128
        yield a + "dt_bias", (hk,)
        yield a + "o_norm.weight", (k,)
        yield a + "o_proj.weight", (d, hk)
    if i < text["first_k_dense_replace"]:
        inter = text["intermediate_size"]
        yield p + "mlp.gate_proj.weight", (inter, d)
        yield p + "mlp.up_proj.weight", (inter, d)
        yield p + "mlp.down_proj.weight", (d, inter)
        return
    m = p + "block_sparse_moe."
    e, lat, f = text["num_experts"], text["routed_expert_hidden_size"], text["moe_intermediate_size"]
    shared = text["num_shared_experts"] * f
    yield m + "gate.weight", (e, d)
    yield m + "gate.e_score_correction_bias", (e,)
    yield m + "routed_expert_down_proj.weight", (lat, d)
    yield m + "routed_expert_up_proj.weight", (d, lat)
    yield m + "routed_expert_norm.weight", (lat,)
    yield m + "shared_experts.gate_proj.weight", (shared, d)
    yield m + "shared_experts.up_proj.weight", (shared, d)
    yield m + "shared_experts.down_proj.weight", (d, shared)


def _stored_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(_FP32_SUFFIXES) else torch.bfloat16


def release_tensor_specs(config: Mapping[str, Any], layers: Optional[range] = None) -> Iterator[TensorSpec]:
    """Every tensor of a release with this ``config.json`` (published layout, MXFP4 routed experts), in the
    order they are written: decoder layers (``layers``, default all), the text model's own, the projector, the
    vision tower. At the published config's sizes this gives the release's shapes (tests/fixtures/k3/
    weight_families.tsv)."""
    text, vision = config["text_config"], config["vision_config"]
    lm = "language_model."
    for i in layers if layers is not None else range(text["num_hidden_layers"]):
        for name, shape in _layer_specs(text, i):
            yield TensorSpec(lm + name, shape, _stored_dtype(name))
        if i >= text["first_k_dense_replace"]:
            yield from _expert_specs(
                f"{lm}model.layers.{i}.block_sparse_moe.",
                text["num_experts"],
                text["moe_intermediate_size"],
                text["routed_expert_hidden_size"],
            )
    yield from _model_specs(text)
    yield from _projector_specs(vision)
    yield from _vision_specs(vision)


def _model_specs(text: Mapping[str, Any]) -> Iterator[TensorSpec]:
    d, v = text["hidden_size"], text["vocab_size"]
    yield TensorSpec("language_model.model.embed_tokens.weight", (v, d), torch.bfloat16)
    if not text.get("tie_word_embeddings", False):
        yield TensorSpec("language_model.lm_head.weight", (v, d), torch.bfloat16)
    yield TensorSpec("language_model.model.norm.weight", (d,), torch.bfloat16)
    if text.get("attn_res_block_size") is not None:
        yield TensorSpec("language_model.model.output_attn_res_proj.weight", (1, d), torch.bfloat16)
        yield TensorSpec("language_model.model.output_attn_res_norm.weight", (d,), torch.bfloat16)


def _projector_specs(vision: Mapping[str, Any]) -> Iterator[TensorSpec]:
    # patchmergerv2: the merge's m x m tokens side by side, a square Linear, gelu, a Linear to the text width
    merged = vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1] * vision["mm_hidden_size"]
    yield TensorSpec("mm_projector.proj.0.weight", (merged, merged), torch.bfloat16)
    yield TensorSpec("mm_projector.proj.2.weight", (vision["text_hidden_size"], merged), torch.bfloat16)
    yield TensorSpec("mm_projector.post_norm.weight", (vision["text_hidden_size"],), torch.bfloat16)


def _vision_specs(vision: Mapping[str, Any]) -> Iterator[TensorSpec]:
    w, inter, qkv = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["qkv_hidden_size"]
    p, bf16 = vision["patch_size"], torch.bfloat16
    for b in range(vision["vt_num_hidden_layers"]):
        at = f"vision_tower.encoder.blocks.{b}."
        yield TensorSpec(at + "wqkv.weight", (3 * qkv, w), bf16)
        yield TensorSpec(at + "wo.weight", (w, qkv), bf16)
        yield TensorSpec(at + "norm0.weight", (w,), bf16)
        yield TensorSpec(at + "norm1.weight", (w,), bf16)
        yield TensorSpec(at + "mlp.fc0.weight", (inter, w), bf16)
        yield TensorSpec(at + "mlp.fc1.weight", (w, inter), bf16)
    yield TensorSpec("vision_tower.encoder.final_layernorm.weight", (w,), bf16)
    yield TensorSpec(
        "vision_tower.patch_embed.pos_emb.weight",
        (vision["init_pos_emb_height"], vision["init_pos_emb_width"], w),
        bf16,
    )
    yield TensorSpec("vision_tower.patch_embed.proj.weight", (w, 3, p, p), bf16)


def _value(spec: TensorSpec, gen: torch.Generator, num_heads: int) -> torch.Tensor:
    """A random value for ``spec`` at a scale that keeps a forward sane."""
    name, shape = spec.name, spec.shape
    if name.endswith(("norm.weight", "layernorm.weight", "norm0.weight", "norm1.weight")):
        return torch.ones(shape)
    if name.endswith(".A_log"):  # the real heads' log decay rates; the padding entries are zero, as published
        out = torch.zeros(shape)
        out[:num_heads] = torch.empty(num_heads).uniform_(1.0, 16.0, generator=gen).log()
        return out
    if name.endswith((".dt_bias", ".e_score_correction_bias")):
        return torch.randn(shape, generator=gen) * 0.02
    if name.endswith("_res_proj.weight") or name.endswith("pos_emb.weight"):
        return torch.randn(shape, generator=gen) * 0.02
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def _release_tensors(config: Mapping[str, Any], seed: int) -> Dict[str, torch.Tensor]:
    """Every tensor of ``release_tensor_specs(config)``, drawn from ``seed`` in that order; experts MXFP4."""
    gen = torch.Generator().manual_seed(seed)
    text = config["text_config"]
    num_heads = text["linear_attn_config"]["num_heads"]
    specs = list(release_tensor_specs(config))
    out: Dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name.endswith(".weight_scale"):
            continue  # written with its weight_packed
        if spec.name.endswith(".weight_packed"):
            base = spec.name[: -len(".weight_packed")]
            logical = (spec.shape[0], spec.shape[1] * 2)
            packed, scale = encode("mxfp4", torch.randn(logical, generator=gen) / math.sqrt(logical[1]))
            out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scale
            continue
        out[spec.name] = _value(spec, gen, num_heads).to(spec.dtype)
    for spec in specs:  # the encoder's shapes and dtypes are the release's
        t = out[spec.name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise AssertionError(f"{spec.name}: made {tuple(t.shape)} {t.dtype}, the release has {spec}")
    return out


def _shard_of(name: str) -> str:
    """The shard group a tensor goes to: one a decoder layer, then the text model's own, the projector and the
    tower (the release's last three shards hold exactly these)."""
    if name.startswith("language_model.model.layers."):
        return "layer " + name.split(".")[3]
    if name.startswith("language_model."):
        return "text"
    return name.split(".")[0]


def _n_base_of(tokenizer_dir: Optional[str]) -> int:
    if tokenizer_dir is None:
        return DEFAULT_N_BASE
    model = os.path.join(tokenizer_dir, "tiktoken.model")
    if not os.path.isfile(model):
        raise ValueError(f"tokenizer_dir: {tokenizer_dir} has no tiktoken.model; give the K3-style tokenizer folder")
    with open(model) as f:  # one "base64(bytes) rank" line per ordinary token
        return sum(1 for line in f if line.strip())


def write_k3_release(
    path: Union[str, os.PathLike],
    *,
    seed: int = 0,
    tokenizer_dir: Union[str, os.PathLike, None] = None,
    n_base: Optional[int] = None,
    published_config: Union[str, os.PathLike, None] = None,
    sizes: Optional[Mapping[str, Mapping]] = None,
) -> List[str]:
    """Write a tiny K3 base in the release's format to ``path`` (replaced whole; see the module doc) and return
    the names of the files written, sorted.

    tokenizer_dir: a K3-style tokenizer folder (tests/fixtures/k3_tokenizer/), every file of which is copied
    in; its ``tiktoken.model`` gives ``n_base`` (the ordinary vocabulary) unless ``n_base`` is given. Without
    it the base has no tokenizer and ``n_base`` defaults to 512. published_config: the published config.json
    (default ``PUBLISHED_CONFIG``); sizes: ``TINY_SIZES``-shaped replacement sizes.
    """
    tokenizer_dir = os.fspath(tokenizer_dir) if tokenizer_dir is not None else None
    n_base = n_base if n_base is not None else _n_base_of(tokenizer_dir)
    config = shrink_k3_config(read_published_config(published_config), n_base, sizes)
    tensors = _release_tensors(config, seed)
    groups: Dict[str, List[str]] = {}
    for name in tensors:
        groups.setdefault(_shard_of(name), []).append(name)
    total = len(groups)
    with atomic_directory(path) as tmp:
        weight_map: Dict[str, str] = {}
        for number, names in enumerate(groups.values(), start=1):
            file = f"model-{number:05d}-of-{total:06d}.safetensors"  # the release's numbering, 5 and 6 digits
            save_file({n: tensors[n] for n in names}, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update((n, file) for n in names)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_json(tmp, SAFETENSORS_INDEX, {"metadata": {"total_size": size}, "weight_map": weight_map})
        _write_json(tmp, "config.json", config)
        _write_json(
            tmp,
            "generation_config.json",
            {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        _write_json(tmp, "preprocessor_config.json", _PREPROCESSOR)
        if tokenizer_dir is not None:
            for name in sorted(os.listdir(tokenizer_dir)):
                source = os.path.join(tokenizer_dir, name)
                if os.path.isfile(source):
                    shutil.copyfile(source, os.path.join(tmp, name))
        written = sorted(os.listdir(tmp))
    return written


def _write_json(directory: str, name: str, data: Mapping[str, Any]) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
