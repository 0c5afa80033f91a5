"""A tiny image+text base in K3's published form, written by the tests (not the package's K3 writer): the
release's ``config.json`` shape (``model_type`` "kimi_k3", ``architectures``, ``auto_map``, ``dtype`` bfloat16,
``media_placeholder_token_id``, ``text_config`` + ``vision_config``), its tensors in the release's dtypes (bf16,
with KDA's ``A_log``/``dt_bias``/``q,k,v_conv1d``/``o_norm`` and the router's ``e_score_correction_bias`` in fp32,
docs/k3-formats.md), per-expert tensors and padded ``A_log`` (tests/models/k3_fixtures.py), the vision tower's
tensors under the model's names, and the files a release directory ships beside the weights: the K3-style
remote-code tokenizer (tests/fixtures/k3_tokenizer: ``tokenization_kimi.py`` importing ``encoding_k3.py``),
``generation_config.json`` and ``preprocessor_config.json``."""

from __future__ import annotations

import json
import os
import shutil

import torch

from tests.models.k3_fixtures import k3_text_config, k3_text_shapes, random_tensors, write_k3

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "tests", "fixtures", "k3_tokenizer")
RELEASE_FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
VOCAB, MEDIA_PAD, EOS = 768, 533, 514  # the tokenizer fixture's (k3_token_ids.json)
VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
    "pos_emb_height": 16,
    "pos_emb_width": 16,
}


def release_config() -> dict:
    text = dict(k3_text_config(), vocab_size=VOCAB, bos_token_id=512, eos_token_id=EOS, pad_token_id=767)
    text["dtype"] = "bfloat16"
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "bos_token_id": 512,
        "dtype": "bfloat16",
        "eos_token_id": EOS,
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "media_placeholder_token_id": MEDIA_PAD,
        "image_token_id": MEDIA_PAD,
        "model_type": "kimi_k3",
        "pad_token_id": 767,
        "text_config": text,
        "tie_word_embeddings": False,
        "vision_config": dict(VISION),
    }


def vision_tensors(config: dict, seed: int = 3) -> dict:
    """The tower's and projector's tensors under the image+text model's own names, random."""
    from moe_plugin.models import MoEPluginForConditionalGeneration, config_from_k3

    with torch.device("meta"):
        model = MoEPluginForConditionalGeneration(config_from_k3(config))
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(t.shape, generator=gen) * 0.1
        for n, t in model.state_dict().items()
        if n.startswith(("vision_tower.", "mm_projector."))
    }


def write_release_base(path, seed: int = 0) -> dict:
    """Write the base into ``path``; returns its tensors as stored (name -> tensor)."""
    config = release_config()
    text = random_tensors(k3_text_shapes(config["text_config"]), num_heads=2, seed=seed)
    tensors = {"language_model." + n: t for n, t in text.items()}
    tensors.update(vision_tensors(config))
    tensors = {n: t.float() if n.endswith(RELEASE_FP32) else t.bfloat16() for n, t in tensors.items()}
    write_k3(path, config, tensors, per_shard=80)
    for name in os.listdir(TOKENIZER):
        if name != "k3_token_ids.json":
            shutil.copyfile(os.path.join(TOKENIZER, name), os.path.join(path, name))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 512, "eos_token_id": EOS, "pad_token_id": 767, "max_length": 64}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": 14, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, f)
    return tensors
