"""The Hugging Face model with Attention Residuals on trains under ZeRO-3 on 2 processes through the product's
Trainer (``parallel.backend: "hf"``, ``ds_configs/zero3_lora.json``) and equals one process.

Two bases: a checkpoint (built under ``deepspeed.zero.Init`` and loaded into the partitions) whose mixing
points are drawn away from their zero start, and the ``tiny`` preset (built whole, partitioned by the engine).
The LoRA targets include the DSA indexer, so its KL term (``indexer_loss_coeff``) is part of every loss.
Under ZeRO-3 a weight is gathered only when its module is called: before the AttnRes code called its mixing
points, the first backward failed here.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_plugin.models.modeling import MoEPluginForCausalLM
from moe_plugin.models.presets import preset_config
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from tests.recipes import recipe, whole
from tests.tolerances import chain_length, check_run

pytestmark = pytest.mark.distributed  # every test here starts processes

WORKER = "tests/training/attn_res_trainer_workers.py:run"
LR = 2e-2
STEPS = 3
MAX_NORM = 0.05
TOKENS = 2 * 48  # a step's global batch: 2 rows of seq_len 48, at most that many label tokens
CHAIN = chain_length(TOKENS, layers=4, width=128, vocab=384)  # the tiny preset: hidden 64, MLP 128
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "k_proj", "gate", "wq_b", "wk", "weights_proj"],
    "target_parameters": ["experts.w1"],
}


def _checkpoint(path) -> str:
    config = preset_config(
        "tiny", vision_config=None, image_token_id=None, attn_res_block_size=3, index_topk=8, indexer_loss_coeff=0.5
    )
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(0.0, 0.5)
            elif "_res_norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif ".indexer." in name and "k_norm" not in name:
                p.normal_(0.0, 0.3)  # a KL term well above rounding
            elif name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.3)  # routing far from ties: no expert flips from rounding differences
    model.save_pretrained(path)
    ByteTokenizer().save_pretrained(path)  # a base brings its tokenizer (the preset's ids are the byte tokenizer's)
    return str(path)


def _recipe(output_dir, world: int, model: dict) -> dict:
    # micro-batch 2 in one process is the concatenation of the 2 ranks' micro-batches of 1
    return recipe(
        output_dir,
        world=world,
        batch=2,
        model=whole(model),
        lora=whole(LORA),
        data={"operation": "+", "num_documents": 200, "seq_len": 48},
        parallel={"backend": "hf"},
        schedule={"steps": STEPS, "lr": LR, "clip_grad_norm": MAX_NORM},
        seed=5,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attn_res_trainer")
    bases = {
        "checkpoint": {"from_pretrained": _checkpoint(tmp / "base")},
        "preset": {"preset": "tiny", "overrides": {"index_topk": 8, "indexer_loss_coeff": 0.5}},
    }
    one = run_distributed(
        WORKER, world_size=1, timeout_s=900, recipes=[(k, _recipe(tmp / f"{k}-w1", 1, m)) for k, m in bases.items()]
    )
    two = run_distributed(
        WORKER, world_size=2, timeout_s=900, recipes=[(k, _recipe(tmp / f"{k}-w2", 2, m)) for k, m in bases.items()]
    )
    return one[0], two


@pytest.mark.parametrize("base", ["checkpoint", "preset"])
def test_attn_res_under_zero3_on_2_processes_equals_one_process(runs, base):
    """Losses, gradient norms, every gradient element and every adapter element after each step, within the
    fp32 bounds of tests/tolerances.py."""
    one, two = runs
    ref = one[base]
    assert len(ref["losses"]) == STEPS and all(kl is not None and kl > 0 for kl in ref["indexer_kl"]), (
        "premise: the indexer's KL term is in every loss"
    )
    assert min(ref["grad_norms"]) > MAX_NORM, "premise: clipping is active on every step"
    for rank, got in enumerate(two):
        got = got[base]
        failures = check_run(ref, got, tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
        assert not failures, (rank, failures[:8])
        assert any(float(v.abs().max()) > 0 for n, v in got["grads"].items() if ".indexer." in n), (
            "the indexer's adapters learn from the KL term"
        )


def test_attn_res_weights_are_partitioned_over_both_ranks(runs):
    _, two = runs
    for rank, result in enumerate(two):
        for base in ("checkpoint", "preset"):
            parts = result[base]["attn_res_partitions"]
            assert len(parts) == result[base]["attn_res_count"] == 2 * 4 * 2 + 2, (base, sorted(parts))
            for name, (stored, full) in parts.items():
                assert stored == math.ceil(full / 2), (rank, base, name, stored, full)
