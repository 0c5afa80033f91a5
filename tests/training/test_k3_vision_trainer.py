"""The tiny Kimi K3 release (moe_plugin/testing/k3_release.py: the published config shrunk, the release's tensor names,
its MoonViT-3D tower and K3 processor files) trains on pictures through the product's Trainer on both faces: the
megatron image model (``MultimodalGPTModel``) at EP=1 equals the Hugging Face image model on the same batch (logits,
each step's loss, gradient norm, adapter gradients and adapters, tests/tolerances.py's fp32 bounds), with LoRA on the
tower's ``wqkv`` and ``fc0`` (the release's names) beside the text model's targets. The rows hold K3's image block
with one ``<|media_pad|>`` an image, expanded to the image's navit token count (docs/multimodal.md 7).
Rank code: tests/training/multimodal_workers.py.
"""

from __future__ import annotations

import json

import pytest

from examples.shapes import write_shapes_dataset
from moe_plugin.testing.k3_release import NUM_SPECIAL, special_token_ids, write_k3_release
from moe_plugin.testing.launch import run_distributed
from tests.recipes import recipe, whole
from tests.tolerances import chain_length, chain_rel, check_run
from tests.training.test_multimodal_trainer import _close, _named

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = "tests/training/multimodal_workers.py:run_recipes"
SEQ, LR, MAX_NORM = 256, 2e-2, 1.0
TOKENS = 4 * SEQ
CHAIN = chain_length(TOKENS, layers=4 + 2, width=128, vocab=512)
LOGITS_REL = chain_rel(chain_length(0, 4 + 2, 128, 0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k3_vision_trainer")
    base = tmp / "k3"
    write_k3_release(str(base), seed=0, tokenizer_dir="tests/fixtures/k3_tokenizer")
    data = write_shapes_dataset(str(tmp), 8, seed=4)
    config = json.loads((base / "config.json").read_text())

    def one(name, backend):
        return recipe(
            tmp / name,
            base=str(base),
            model={"trust_remote_code": True},
            lora={"target_modules": ["q_proj", "k_proj", "gate", "wqkv", "fc0"]},
            data=whole({"kind": "sft", "path": data, "seq_len": SEQ, "eval_fraction": 0.0}),
            parallel={"backend": backend},
            schedule={"lr": LR, "clip_grad_norm": MAX_NORM},
        )

    hf, mg = run_distributed(WORKER, world_size=1, timeout_s=900, recipes=[one("hf", "hf"), one("mg", "megatron")])[0]
    return hf, mg, config


def test_the_k3_release_trains_on_pictures_alike_on_both_faces(runs):
    hf, mg, config = runs
    assert hf["model"] == "ImageTextTrainingModel" and mg["model"] == "MultimodalGPTModel" and hf["has_images"]
    assert (hf["input_ids"] == mg["input_ids"]).all()
    # K3's image block, its one <|media_pad|> expanded to the image's tokens before packing
    n_base = config["text_config"]["vocab_size"] - NUM_SPECIAL
    begins = int((hf["input_ids"] == special_token_ids(n_base)["<|media_begin|>"]).sum())
    pads = int((hf["input_ids"] == config["media_placeholder_token_id"]).sum())
    assert begins > 0 and pads > begins
    assert _close(mg["logits"], hf["logits"], LOGITS_REL)
    grads = hf["grads"]
    tower = [n for n in grads if "vision_tower" in n and "lora_B" in n]
    assert tower and all(float(grads[n].abs().max()) > 0 for n in tower), "premise: the tower's adapters learn"
    failures = check_run(_named(hf), _named(mg), tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
    assert not failures, failures[:8]
