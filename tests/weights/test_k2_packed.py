"""The K2 family's INT4 checkpoints load as stored, under their own names: ``model.layers.{L}.mlp.experts.{E}.
{gate,up,down}_proj.weight_packed`` int32 / ``.weight_scale`` bf16 / ``.weight_shape`` int32 [2], the MoE block
under ``mlp.`` (K2-Thinking), with ``language_model.`` in front (K2.5, K2.6). Single device: the same logits as
the K3-named checkpoint of the same model and as its dequantised fp32 twin, decoding equal to compressed-tensors'
unpacking of the stored tensors; per EP rank: each rank plans and reads only its experts' tensors, and at EP=2
under ZeRO-3 (2 gloo processes, the product's Trainer) every rank holds its experts' stored bytes and gives the
fp32 twin's logits and LoRA gradients. A ``weight_shape`` that disagrees with the model is named."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors.torch import load_file, save_file

from moe_plugin.models.k3_format import load_k3_checkpoint
from moe_plugin.models.presets import preset_config
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.ops.quant import decode
from moe_plugin.testing.launch import run_distributed
from moe_plugin.testing.packed_checkpoints import write_tiny_packed_checkpoint
from moe_plugin.weights.packed import expert_naming, k2_block_name, k2_packed_name
from moe_plugin.weights.plan import detect_layout, plan_reads, stored_tensors
from moe_plugin.weights.reads import Target
from tests.recipes import recipe

KINDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ROUTED = "model.layers.1.mlp.experts"
WORKER = "tests/training/packed_trainer_workers.py:run_packed"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k2")
    write_tiny_packed_checkpoint(
        tmp / "k2", "int4", seed=5, naming="k2", text_prefix=False, dequantized_path=tmp / "fp32", attn_res=False
    )
    write_tiny_packed_checkpoint(tmp / "k2.5", "int4", seed=5, naming="k2", attn_res=False)
    write_tiny_packed_checkpoint(tmp / "k3", "int4", seed=5, attn_res=False)
    for base in ("k2", "fp32", "k2.5", "k3"):  # a base the trainer reads brings its tokenizer (byte ids here)
        ByteTokenizer().save_pretrained(tmp / base)
    return tmp


def test_k2_names():
    assert (
        k2_packed_name("model.layers.3.block_sparse_moe.experts.w2", 7)
        == "model.layers.3.mlp.experts.7.down_proj.weight_packed"
    )
    assert (
        k2_packed_name("language_model.model.layers.3.block_sparse_moe.experts.w1_scale", 0)
        == "language_model.model.layers.3.mlp.experts.0.gate_proj.weight_scale"
    )
    assert k2_block_name("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert k2_block_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert expert_naming(["model.layers.3.mlp.experts.7.up_proj.weight_shape"]) == "k2"
    assert (
        expert_naming(
            ["model.layers.3.block_sparse_moe.experts.7.w3.weight_packed", "model.layers.0.mlp.up_proj.weight"]
        )
        == "k3"
    )
    assert detect_layout(None, ["model.layers.3.mlp.experts.7.up_proj.weight_packed"]) == "k3"


@pytest.mark.parametrize("name", ["k2", "k2.5"])
def test_k2_named_checkpoint_loads_as_stored(checkpoints, name):
    stored = load_file(str(checkpoints / name / "model.safetensors"))
    prefix = "language_model." if name == "k2.5" else ""
    assert (
        f"{prefix}{ROUTED}.3.gate_proj.weight_packed" in stored
        and f"{prefix}model.layers.1.mlp.gate.weight" in stored
        and not any("block_sparse_moe" in k or ".w1." in k for k in stored)
    )
    model, k3 = load_k3_checkpoint(checkpoints / name), load_k3_checkpoint(checkpoints / "k3")
    dense = load_k3_checkpoint(checkpoints / "fp32")
    ids = torch.tensor([[(11 * i + 2) % 384 for i in range(32)]])
    with torch.no_grad():
        logits, same, ref = (m(input_ids=ids).logits for m in (model, k3, dense))
    assert torch.equal(logits, same)
    assert float((logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    experts = model.model.layers[1].block_sparse_moe.experts
    for kind, k2 in KINDS.items():
        for e in range(8):
            base = f"{prefix}{ROUTED}.{e}.{k2}"
            assert torch.equal(getattr(experts, kind)[e], stored[f"{base}.weight_packed"])  # bytes as stored
            assert torch.equal(getattr(experts, f"{kind}_scale")[e], stored[f"{base}.weight_scale"].view(torch.uint8))
            shape = torch.Size(stored[f"{base}.weight_shape"].tolist())
            theirs = (
                unpack_from_int32(stored[f"{base}.weight_packed"], 4, shape).float()
                * stored[f"{base}.weight_scale"].float().repeat_interleave(32, 1)[:, : shape[1]]
            )
            ours = decode("int4", getattr(experts, kind)[e], getattr(experts, f"{kind}_scale")[e], shape[1])
            assert torch.equal(ours, theirs), base


def _rewrite(src, dst, change):
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_weight_shape_that_differs_from_the_model_is_named(checkpoints, tmp_path):
    key = f"{ROUTED}.5.down_proj.weight_shape"
    wrong = _rewrite(
        checkpoints / "k2", tmp_path / "wrong", lambda t: t.__setitem__(key, torch.tensor([32, 40], dtype=torch.int32))
    )
    with pytest.raises(
        ValueError,
        match=key.replace(".", r"\.") + r": checkpoint weight_shape \[32, 40\], model "
        r"\[32, 32\] \(the logical \[out, in\] of one expert of model\.layers\.1\.block_sparse_moe"
        r"\.experts\.w2",
    ):
        load_k3_checkpoint(wrong)
    odd = _rewrite(
        checkpoints / "k2", tmp_path / "odd", lambda t: t.__setitem__(key, torch.tensor([32, 32, 1], dtype=torch.int32))
    )
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r": checkpoint \[3\] int32, expected int32 \[2\]"):
        load_k3_checkpoint(odd)


def test_each_ep_rank_plans_only_its_experts(checkpoints, tmp_path):
    config = preset_config("tiny", expert_format="int4", attn_res=False).to_model_config()
    key = f"{ROUTED}.1.gate_proj.weight_shape"  # expert 1: rank 0's
    broken = _rewrite(
        checkpoints / "k2", tmp_path / "broken", lambda t: t.__setitem__(key, torch.tensor([1, 1], dtype=torch.int32))
    )
    weight_map = {n: str(broken / "model.safetensors") for n in load_file(str(broken / "model.safetensors"))}
    stored = stored_tensors(weight_map)
    stack = "model.layers.1.block_sparse_moe.experts"
    for rank, (first, last) in enumerate([(0, 4), (4, 8)]):
        targets = {
            f"{stack}.w1": Target((4, 32, 4), experts=(first, last), dtype="int32"),
            f"{stack}.w1_scale": Target((4, 32, 2), experts=(first, last), dtype="uint8"),
        }

        def call(targets=targets):
            return plan_reads(targets, weight_map, names="hf", config=config, layout="k3", strict=False, stored=stored)

        if rank == 0:
            with pytest.raises(ValueError, match=key.replace(".", r"\.")):
                call()
            continue
        plan = call()  # rank 1 neither reads nor checks expert 1's record
        assert [r.name for r in plan.reads[f"{stack}.w1"]] == [
            f"{ROUTED}.{e}.gate_proj.weight_packed" for e in range(4, 8)
        ]
        assert [r.name for r in plan.reads[f"{stack}.w1_scale"]] == [
            f"{ROUTED}.{e}.gate_proj.weight_scale" for e in range(4, 8)
        ]


def _recipe(output_dir, base) -> dict:
    return recipe(
        output_dir,
        world=2,
        ep=2,
        base=base,
        model={"overrides": {}},
        lora={"target_modules": ["q_proj", "gate"]},
        schedule={"steps": 1, "lr": 1e-2, "clip_grad_norm": None, "precision": "fp32"},
    )


def _rel(a, b) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


@pytest.mark.distributed
def test_k2_checkpoint_at_ep2_zero3_holds_each_ranks_experts_and_equals_fp32(checkpoints, tmp_path):
    ids = [(7 * i + 3) % 384 for i in range(48)]
    scenarios = [
        {"name": name, "ids": ids, "recipe": _recipe(tmp_path / name, checkpoints / src)}
        for name, src in (("k2.5", "k2.5"), ("fp32", "fp32"))
    ]
    results = run_distributed(WORKER, world_size=2, timeout_s=1500, scenarios=scenarios)
    stored = load_file(str(checkpoints / "k2.5" / "model.safetensors"))
    for rank, result in enumerate(results):
        packed, dense = result["k2.5"], result["fp32"]
        assert _rel(packed["logits"], dense["logits"]) <= 1e-5, rank
        assert sorted(packed["grads"]) == sorted(dense["grads"]) and any("experts" in n for n in dense["grads"])
        for name, g in dense["grads"].items():
            assert _rel(packed["grads"][name], g) <= 1e-5, (rank, name)
        layers = [t for first, t in packed["packed"]]
        assert [first for first, _ in packed["packed"]] == [4 * rank] * len(layers) and layers
        for kind, k2 in KINDS.items():  # this rank's experts 4*rank .. 4*rank+3, bit for bit as stored
            for j in range(4):
                base = f"language_model.{ROUTED}.{4 * rank + j}.{k2}"
                assert torch.equal(layers[0][kind][j], stored[f"{base}.weight_packed"]), (rank, base)
                assert torch.equal(layers[0][f"{kind}_scale"][j], stored[f"{base}.weight_scale"].view(torch.uint8))
    assert json.loads((checkpoints / "k2" / "config.json").read_text())["model_type"] == "kimi_linear"
