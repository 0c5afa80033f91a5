"""Attention Residuals and the DSA indexer's KL loss on megatron's GPTModel equal the Hugging Face model.

One 4-process launch (rank code in attn_res_workers.py) on a checkpoint with Attention Residuals (blocks of 3
layers over 4 layers, so the output mix sees a partial block; mixing points drawn away from their zero start),
a sparse indexer (top-8 keys) with LoRA on its projections, and ``indexer_loss_coeff`` 0.5:

* EP=1, no ZeRO: megatron's model with the parent's adapters, one micro-batch per rank;
* EP=2 x ZeRO-3 through the product's Trainer (megatron backend): its second step, the adapters moved off
  their start by the first.

The reference is the Hugging Face model (same checkpoint and adapters) on the 4 ranks' micro-batches
concatenated: logits per rank, the loss including the indexer term, every adapter gradient, all <= 1e-5.
"""

from pathlib import Path

import pytest
import torch
from peft import set_peft_model_state_dict

from moe_plugin.lora import add_lora, lora_config
from moe_plugin.models.modeling import MoEPluginForCausalLM
from moe_plugin.models.presets import preset_config
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from moe_plugin.training.data.pipeline import label_token_count
from tests.recipes import recipe as recipe_for

pytestmark = pytest.mark.distributed  # every test here starts processes

TOL = 1e-5
WORLD = 4
COEFF = 0.5
WORKERS = Path(__file__).with_name("attn_res_workers.py")
LORA = dict(
    r=4,
    alpha=8,
    target_modules=["q_proj", "k_proj", "gate", "wq_b", "wk", "weights_proj"],
    target_parameters=["experts.w1", "experts.w2", "experts.w3"],
)
CU = torch.tensor([0, 7, 32])  # a document longer than top-8


def base_model() -> MoEPluginForCausalLM:
    config = preset_config(
        "tiny", vision_config=None, image_token_id=None, attn_res_block_size=3, index_topk=8, indexer_loss_coeff=COEFF
    )
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(0.0, 0.5)  # away from the zero start, where every mix is a plain average
            elif "_res_norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif ".indexer." in name and "k_norm" not in name:
                p.normal_(0.0, 0.3)  # index scores far from the attention's: a KL term well above rounding
            elif name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.3)  # routing far from ties
    return model


def hf_lora_model(base_dir, adapters: dict = None, seed: int = 1):
    """The saved base with peft's LoRA; ``adapters`` (PEFT state-dict names) loaded, else random nonzero."""
    model = MoEPluginForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    model = add_lora(model, lora_config(**LORA), wrap=True)
    if adapters is not None:
        result = set_peft_model_state_dict(model, adapters)
        assert not result.unexpected_keys, result.unexpected_keys
    else:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:  # peft starts B at zero, which would zero every A gradient
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.train()


def reference(model, batches, num_items):
    """logits per rank, loss (with the indexer term), indexer KL and adapter grads (PEFT names) of ``model``
    on the concatenated packed batches ``[(ids [1, T], labels [1, T], cu [n+1])]``."""
    model.zero_grad(set_to_none=True)
    ids = torch.cat([b[0] for b in batches], dim=1)
    labels = torch.cat([b[1] for b in batches], dim=1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long)] + [b[2][1:] + i * b[0].shape[1] for i, b in enumerate(batches)])
    out = model(input_ids=ids, labels=labels, cu_seqlens=cu, num_items_in_batch=num_items)
    out.loss.backward()
    grads = {n.replace(".default.", "."): p.grad.clone() for n, p in model.named_parameters() if ".lora_" in n}
    return {
        "logits": out.logits.detach().split(batches[0][0].shape[1], dim=1),
        "loss": out.loss.detach(),
        "indexer_kl": out.indexer_loss.detach(),
        "grads": grads,
    }


def _rel(a, b):
    diff, scale = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / scale if scale > 0 else diff


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_attn_res")
    base_model().save_pretrained(root / "base", max_shard_size="100KB")
    ByteTokenizer().save_pretrained(root / "base")  # a base the trainer reads brings its tokenizer
    model = hf_lora_model(root / "base")
    adapters = {
        n.replace("base_model.model.", "", 1): p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n
    }
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(WORLD):
        ids = torch.randint(0, 384, (1, int(CU[-1])), generator=g)
        labels = ids.clone()
        labels[0, 3:6] = -100  # a prompt span without loss
        batches.append((ids, labels, CU.clone()))
    num_items = sum(label_token_count(labels[0], cu) for _, labels, cu in batches)
    torch.save({"lora": LORA, "adapters": adapters, "batches": batches, "num_items": num_items}, root / "setup.pt")
    recipe = recipe_for(
        root / "run",
        world=WORLD,
        ep=2,
        base=root / "base",
        lora={
            "r": LORA["r"],
            "alpha": LORA["alpha"],
            "target_modules": LORA["target_modules"],
            "target_parameters": LORA["target_parameters"],
            # the reference has no balance term (its equality across faces: tests/training/test_trainer.py)
            "router_balance": {"aux_loss_coeff": 0.0},
        },
        data={"num_documents": 200, "seq_len": 48},
        schedule={"micro_batch_size": 1, "clip_grad_norm": None},
    )
    results = run_distributed(
        f"{WORKERS}:run_checks", world_size=WORLD, timeout_s=900, case_dir=str(root), recipe=recipe
    )
    for rank, result in enumerate(results):
        for name, got in result.items():
            if "error" in got:
                pytest.fail(f"{name} raised on rank {rank}:\n{got['error']}", pytrace=False)
    return {"root": root, "model": model, "batches": batches, "num_items": num_items, "results": results}


def _compare_grads(got, want, where):
    assert set(got) == set(want), f"{where}: adapter names differ: {sorted(set(got) ^ set(want))[:4]}"
    for name, value in want.items():
        assert value.abs().sum() > 0 or ".lora_A." in name, f"premise: {name} has a zero reference gradient"
        err = _rel(got[name], value)
        assert err <= TOL, f"{where}: grad of {name}: rel err {err:.2e}"


def test_ep1_with_attn_res_and_indexer_loss_equals_hf(case):
    ref = reference(case["model"], case["batches"], case["num_items"])
    results = [r["direct"] for r in case["results"]]
    assert results[0]["block"], "the decoder must be an AttnResTransformerBlock"
    assert "decoder.output_attn_res_proj.weight" in results[0]["names"]
    assert "decoder.layers.3.mlp_res_norm.weight" in results[0]["names"]
    for rank, got in enumerate(results):
        err = _rel(got["logits"], ref["logits"][rank])
        assert err <= TOL, f"rank {rank}: logits rel err {err:.2e} vs the HF model"
        _compare_grads(
            {"base_model.model." + k.replace(".default.", "."): v for k, v in got["grads"].items()},
            ref["grads"],
            f"rank {rank} EP=1",
        )
    loss = sum(r["lm"] + COEFF * r["indexer_kl"] for r in results) / WORLD
    kl = sum(r["indexer_kl"] for r in results) / WORLD
    assert ref["indexer_kl"] > 1e-2, "premise: the indexer's KL is not negligible"
    assert _rel(kl, ref["indexer_kl"]) <= TOL, (kl, ref["indexer_kl"])
    assert _rel(loss, ref["loss"]) <= TOL, (loss, ref["loss"])


def test_ep2_zero3_trainer_with_attn_res_and_indexer_loss_equals_hf(case):
    results = [r["trainer"] for r in case["results"]]
    first = results[0]
    assert first["ep"] == 2 and first["zero3"]
    points = {"decoder.output_attn_res_proj.weight", "decoder.layers.3.mlp_res_norm.weight"}
    assert points <= set(first["partitioned"]), "AttnRes points must be partitioned"
    model = hf_lora_model(case["root"] / "base", adapters=first["adapters"])
    batches = [r["batches"][0][:3] for r in results]
    num_items = sum(float(r["batches"][0][3]) for r in results)
    ref = reference(model, batches, num_items)
    assert all("indexer_kl" in r["metrics"][0] for r in results), "the backend reports the indexer term"
    for rank, got in enumerate(results):
        assert _rel(got["logits"][0], ref["logits"][rank]) <= TOL, f"rank {rank}: logits differ from the HF model"
        _compare_grads(got["grads"], ref["grads"], f"rank {rank} EP=2 x ZeRO-3")
        assert abs(got["loss"] - float(ref["loss"])) <= TOL * abs(float(ref["loss"])), (got["loss"], ref["loss"])
    kl = sum(float(r["metrics"][0]["indexer_kl"]) for r in results) / WORLD
    assert abs(kl - float(ref["indexer_kl"])) <= TOL * float(ref["indexer_kl"])
    without = float(ref["loss"]) - COEFF * float(ref["indexer_kl"])
    assert abs(results[0]["loss"] - without) > 100 * TOL * abs(without), "premise: the indexer term is visible"
