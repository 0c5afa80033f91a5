"""LoRA over packed experts through the product's Trainer: a model loaded from a K3-format MXFP4 (or INT4)
checkpoint gives the logits and LoRA gradients of the same model with its experts dequantised once into fp32,
in one process and at EP=2 x ZeRO-3 on 4 gloo processes; the packed tensors stay packed and unconverted. Under
FSDP2 at EP=2 on 4 processes the same logits and gradients, the packed experts kept whole and unconverted."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from moe_plugin.testing.packed_checkpoints import write_tiny_packed_checkpoint
from tests.recipes import recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/packed_trainer_workers.py:run_packed"
IDS = [(7 * i + 3) % 384 for i in range(48)]


def _recipe(
    output_dir,
    base,
    world: int,
    ep: int,
    precision: str = "fp32",
    backend: str = "megatron",
    checkpointing: str = "off",
) -> dict:
    return recipe(
        output_dir,
        world=world,
        ep=ep if backend == "megatron" else 1,
        base=base,
        model={"overrides": {}},
        parallel={"backend": backend},
        schedule={
            "steps": 1,
            "lr": 1e-2,
            "clip_grad_norm": None,
            "precision": precision,
            "activation_checkpointing": checkpointing,
        },
    )


CHECKPOINTED = [("megatron", "selective"), ("megatron", "full"), ("hf", "off"), ("hf", "selective"), ("hf", "full")]
FSDP2 = [("mxfp4-fsdp2", "fp32", "off"), ("mxfp4-fsdp2-full", "fp32", "full"), ("mxfp4-fsdp2-bf16", "bf16", "off")]


def _scenarios(tmp, bases: dict, world: int, ep: int) -> list:
    out = [
        {"name": name, "ids": IDS, "recipe": _recipe(tmp / f"{name}-w{world}", base, world, ep)}
        for name, base in bases.items()
    ]
    # activation checkpointing over the packed base, both backends (hf: ZeRO-3 data parallel only)
    for backend, mode in CHECKPOINTED:
        out.append(
            {
                "name": f"mxfp4-{backend}-{mode}",
                "ids": IDS,
                "recipe": _recipe(
                    tmp / f"mxfp4-{backend}-{mode}-w{world}",
                    bases["mxfp4"],
                    world,
                    ep,
                    backend=backend,
                    checkpointing=mode,
                ),
            }
        )
    if world > 1:  # DeepSpeed's bf16 engine over the packed base: the bytes must stay as stored
        out.append(
            {
                "name": "mxfp4-bf16",
                "ids": IDS,
                "recipe": _recipe(tmp / "mxfp4-bf16", bases["mxfp4"], world, ep, precision="bf16"),
            }
        )
        for name, precision, mode in FSDP2:  # the packed experts kept out of FSDP2's shards
            fsdp2 = _recipe(tmp / name, bases["mxfp4"], world, ep, precision=precision, checkpointing=mode)
            fsdp2["deepspeed"], fsdp2["parallel"]["sharding"] = None, "fsdp2"
            out.append({"name": name, "ids": IDS, "recipe": fsdp2})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    bases = {}
    for fmt in ("mxfp4", "int4"):
        write_tiny_packed_checkpoint(tmp / fmt, fmt, seed=1, dequantized_path=tmp / f"{fmt}-fp32", attn_res=False)
        bases[fmt], bases[f"{fmt}-fp32"] = tmp / fmt, tmp / f"{fmt}-fp32"
        for base in (bases[fmt], bases[f"{fmt}-fp32"]):  # a base brings its tokenizer (byte ids here)
            ByteTokenizer().save_pretrained(base)
    one = run_distributed(WORKER, world_size=1, timeout_s=900, scenarios=_scenarios(tmp, bases, 1, 1))[0]
    four = run_distributed(WORKER, world_size=4, timeout_s=1500, scenarios=_scenarios(tmp, bases, 4, 2))
    return bases, one, four


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_packed_equals_dequantized_fp32_in_every_layout(runs, fmt):
    _, one, four = runs
    for where, result in [("1 process", one)] + [(f"rank {r}", res) for r, res in enumerate(four)]:
        packed, dense = result[fmt], result[f"{fmt}-fp32"]
        assert _rel(packed["logits"], dense["logits"]) <= 1e-5, where
        assert math.isclose(packed["loss"], dense["loss"], rel_tol=1e-5), where
        assert sorted(packed["grads"]) == sorted(dense["grads"]) and packed["grads"], where
        expert_grads = [n for n in dense["grads"] if "experts" in n]
        assert expert_grads, "no expert adapter was trained"
        for name, g in dense["grads"].items():
            assert float(g.abs().max()) > 0 or "lora_A" in name, (where, name)  # lora_A starts with zero grad
            assert _rel(packed["grads"][name], g) <= 1e-5, (where, name)
    for rank, result in enumerate(four):  # and the 4-process layout equals the one process
        assert _rel(result[fmt]["logits"], one[fmt]["logits"]) <= 1e-5, rank
        for name, g in one[fmt]["grads"].items():
            assert _rel(result[fmt]["grads"][name], g) <= 1e-5, (rank, name)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_packed_experts_stay_packed_and_unconverted(runs, fmt):
    bases, one, four = runs
    stored = load_file(str(bases[fmt] / "model.safetensors"))
    # 8 experts x 3 matrices of 32 x 32 weights per MoE layer, at 4.25 bits (MXFP4) or 4.5 bits (INT4 bf16 scales)
    weights = 3 * 8 * 32 * 32
    bits = 4.25 if fmt == "mxfp4" else 4.5
    dtypes = {"mxfp4": {"torch.uint8"}, "int4": {"torch.int32", "torch.uint8"}}[fmt]
    names = [fmt] + (["mxfp4-bf16"] if fmt == "mxfp4" else [])
    for name in names:
        for where, results, ep in [("one", [one], 1), ("four", four, 2)]:
            if name not in results[0]:
                continue
            for rank, result in enumerate(results):
                resident = result[name]["resident"]
                layers = len({k.split(":")[1] for k in resident})
                full = sum(v[1] for v in resident.values())
                here = sum(v[0] for v in resident.values())
                assert {v[2] for v in resident.values()} == dtypes, (name, where)
                assert full * 8 == weights * bits * layers / ep, (name, where, full)  # this rank's experts only
                edp = 1 if ep == 1 else 2  # ZeRO-3 partitions them within the expert-data-parallel pair
                assert here <= math.ceil(full / edp) + 64 * len(resident) and here >= full / edp, (name, where)
                for first, tensors in result[name]["packed"]:  # the bytes as the checkpoint stores them
                    assert first == (rank % 2) * (8 // ep) if ep > 1 else first == 0
                    layer = _layer_of(stored, tensors, first, fmt)
                    assert layer is not None, (name, where, rank, first)


def test_fsdp2_over_the_packed_base_equals_one_process_and_keeps_the_experts_packed_and_whole(runs):
    """FSDP2 at EP 2 on 4 processes over the MXFP4 base: the logits and every adapter gradient are one process's;
    with full activation checkpointing bitwise FSDP2's without (each router called once); in fp32 and bf16 runs
    the packed experts stay out of FSDP2's shards: whole on their EP rank, in the stored dtype and bytes."""
    bases, one, four = runs
    stored = load_file(str(bases["mxfp4"] / "model.safetensors"))
    ref = one["mxfp4"]
    for rank, result in enumerate(four):
        off, full = result["mxfp4-fsdp2"], result["mxfp4-fsdp2-full"]
        assert _rel(off["logits"], ref["logits"]) <= 1e-5, rank
        assert sorted(off["grads"]) == sorted(ref["grads"]) and any("experts" in n for n in ref["grads"]), rank
        for name, g in ref["grads"].items():
            assert _rel(off["grads"][name], g) <= 1e-5, (rank, name)
        assert full["loss"] == off["loss"] and full["router_calls"] == [1, 1, 1], rank
        assert all(torch.equal(full["grads"][n], g) for n, g in off["grads"].items()), rank
        for name in ("mxfp4-fsdp2", "mxfp4-fsdp2-bf16"):
            resident = result[name]["resident"]
            assert resident and all(here == whole for here, whole, _ in resident.values()), (rank, name)
            assert {dtype for _, _, dtype in resident.values()} == {"torch.uint8"}, (rank, name)
            for first, tensors in result[name]["packed"]:
                assert first == (rank % 2) * 4, (rank, name, first)
                assert _layer_of(stored, tensors, first, "mxfp4") is not None, (rank, name, first)


def _layer_of(stored: dict, tensors: dict, first: int, fmt: str):
    """The MoE layer whose stored packed experts ``first ..`` equal ``tensors`` bit for bit, else None."""
    for layer in range(4):
        key = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{first}.w1.weight_packed"
        if key not in stored:
            continue
        ok = True
        for kind in ("w1", "w2", "w3"):
            for j in range(tensors[kind].shape[0]):
                base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{first + j}.{kind}"
                scale = stored[f"{base}.weight_scale"]
                scale = scale.view(torch.uint8) if fmt == "int4" else scale
                ok &= torch.equal(tensors[kind][j], stored[f"{base}.weight_packed"])
                ok &= torch.equal(tensors[f"{kind}_scale"][j], scale)
        if ok:
            return layer
    return None


@pytest.mark.parametrize("backend,mode", [c for c in CHECKPOINTED if c[1] != "off"])
def test_recompute_over_the_packed_base_equals_off_bitwise(runs, backend, mode):
    """schedule.activation_checkpointing over the MXFP4 base (the packed experts dequantised again in the
    recompute, their LoRA applied on the activation side): one process and 4 processes (megatron EP=2 x ZeRO-3,
    hf ZeRO-3 x 4) give the "off" run's loss, every adapter gradient and expert load bitwise, and each router
    ran once in the step."""
    _, one, four = runs
    off_name = "mxfp4" if backend == "megatron" else "mxfp4-hf-off"
    for where, result in [("1 process", one)] + [(f"rank {r}", res) for r, res in enumerate(four)]:
        off, got = result[off_name], result[f"mxfp4-{backend}-{mode}"]
        assert got["loss"] == off["loss"] and torch.equal(got["logits"], off["logits"]), where
        assert sorted(got["grads"]) == sorted(off["grads"]) and any("experts" in n for n in off["grads"]), where
        assert all(torch.equal(got["grads"][n], g) for n, g in off["grads"].items()), where
        assert torch.equal(got["loads"], off["loads"]), where
        assert got["router_calls"] == off["router_calls"] == [1, 1, 1], (where, got["router_calls"])
