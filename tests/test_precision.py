"""The precision policy (moe_plugin/precision.py): which tensors stay fp32, apply_precision on a model, and
the product's Trainer in bf16 (one process without ZeRO; two processes under ZeRO-3, megatron EP=2 and the
Hugging Face face), whose fp32 tensors must keep the checkpoint's exact values through deepspeed.initialize
and the steps (tests/precision_workers.py)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from safetensors.torch import load_file

import moe_plugin
from moe_plugin import MoEPluginForCausalLM
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.precision import FP32_TENSORS, apply_precision, fp32_tensors
from moe_plugin.testing.launch import run_distributed
from tests.recipes import OMIT, recipe

WORKER = "tests/precision_workers.py:run_scenarios"
# what the policy keeps fp32, written out by Hugging Face name (independently of FP32_TENSORS/FP32_OWNERS)
FP32_SUFFIXES = (
    "self_attn.A_log",
    "self_attn.dt_bias",
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.gate.e_score_correction_bias",
)
NUM_FP32 = 3 * 2 + 3 * 2  # tiny: A_log and dt_bias on 3 KDA layers, router weight and bias on 3 MoE layers


def _is_fp32(name: str) -> bool:
    return name.replace(".base_layer.", ".").endswith(FP32_SUFFIXES)


def _tiny(seed: int = 0) -> MoEPluginForCausalLM:
    """The tiny preset with a routing bias that bf16 cannot hold (it starts at zero)."""
    torch.manual_seed(seed)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", attn_res=False))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


def _tensors(model) -> dict:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def test_the_patterns_and_the_owners_name_the_same_tensors():
    from peft import LoraConfig, get_peft_model

    model = _tiny()
    for m in (model, get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "gate"]))):
        names = set(_tensors(m))
        pattern = re.compile("|".join(FP32_TENSORS))
        by_pattern = {n for n in names if pattern.search(n)}
        by_owner = {name for name, _, _ in fp32_tensors(m)}
        assert by_pattern == by_owner == {n for n in names if _is_fp32(n)}
        assert len(by_owner) == NUM_FP32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_precision_casts_the_rest_and_keeps_the_listed_tensors_exact(dtype):
    model = _tiny()
    before = {n: t.detach().clone() for n, t in _tensors(model).items()}
    listed = [n for n in before if _is_fp32(n)]
    # values the low precision cannot hold, so a round trip through it would show
    assert all(not torch.equal(before[n].to(dtype).float(), before[n]) for n in listed)
    assert apply_precision(model, dtype) is model
    after = _tensors(model)
    assert set(after) == set(before)
    for name, tensor in after.items():
        if _is_fp32(name):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name
        else:
            assert tensor.dtype == dtype and torch.equal(tensor, before[name].to(dtype)), name
    # trainable ones stay parameters: the optimizer still sees them
    assert {n for n, p in model.named_parameters() if _is_fp32(n)} == {
        n for n in listed if not n.endswith("e_score_correction_bias")
    }


def test_frozen_listed_parameters_become_fp32_buffers_under_their_names():
    model = _tiny(1)
    reference = copy.deepcopy(model).to(torch.bfloat16)  # the HF model's .to() keeps them, as parameters
    model.requires_grad_(False)
    keys = list(model.state_dict())
    apply_precision(model, torch.bfloat16)
    assert sorted(model.state_dict()) == sorted(keys)  # a module lists its buffers after its parameters
    assert not any(_is_fp32(n) for n, _ in model.named_parameters())
    buffers = dict(model.named_buffers())
    for name, tensor in reference.state_dict().items():
        got = model.state_dict()[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert (name in buffers) == _is_fp32(name), name
    ids = torch.randint(0, 384, (1, 24))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_apply_precision_names_a_bad_dtype():
    with pytest.raises(ValueError, match=r"^dtype: must be torch\.float32, torch\.bfloat16 or torch\.float16"):
        apply_precision(_tiny(), torch.int8)


# ---- the product's Trainer in bf16 ----


def _recipe(tmp, name, backend, world, ep, base, lora=True, precision="bf16") -> dict:
    return {
        "name": name,
        "recipe": recipe(
            tmp / name,
            world=world,
            ep=ep,
            base=base,
            lora={"target_parameters": OMIT} if lora else None,
            data={"num_documents": 60, "seq_len": 32},
            parallel={"backend": backend},
            schedule={"micro_batch_size": 1, "lr": 1e-2, "precision": precision},
        ),
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "base"
    _tiny(2).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)  # a base brings its tokenizer (the preset's ids are the byte tokenizer's)
    return path


@pytest.fixture(scope="module")
def one_process(base):
    tmp = base.parent
    scenarios = [_recipe(tmp, "hf", "hf", 1, 1, base), _recipe(tmp, "hf_fp32", "hf", 1, 1, base, precision="fp32")]
    return run_distributed(WORKER, world_size=1, timeout_s=900, scenarios=scenarios)[0]


@pytest.fixture(scope="module")
def two_processes(base):
    tmp = base.parent
    scenarios = [
        _recipe(tmp, "megatron", "megatron", 2, 2, base),
        _recipe(tmp, "hf_zero3", "hf", 2, 1, base),
        _recipe(tmp, "megatron_full", "megatron", 2, 2, base, lora=False),
        _recipe(tmp, "preset", "megatron", 2, 2, None),
        _recipe(tmp, "preset_fp32", "megatron", 2, 2, None, precision="fp32"),
    ]
    return run_distributed(WORKER, world_size=2, timeout_s=1500, scenarios=scenarios)


def _check_against_checkpoint(result: dict, checkpoint: dict, held: bool = True) -> None:
    """Right after deepspeed.initialize: the fp32 tensors are fp32 buffers with the checkpoint's exact values,
    every other base tensor is the checkpoint's value in bf16; after the steps the held ones are unchanged."""
    assert len(result["built"]["listed"]) == NUM_FP32
    assert set(result["built"]["listed"].values()) == {(True, "torch.float32")}
    for phase in ("built", "trained") if held else ("built",):
        state = result[phase]["state"]
        assert set(state) == set(checkpoint)
        for name, value in checkpoint.items():
            if _is_fp32(name):
                assert state[name].dtype == torch.float32 and torch.equal(state[name], value), (phase, name)
            elif phase == "built":
                assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], value.bfloat16()), name
    assert all(math.isfinite(x) for x in result["losses"])


@pytest.mark.distributed
def test_bf16_trainer_one_process_keeps_the_fp32_tensors_exact(one_process, base):
    checkpoint = load_file(str(base / "model.safetensors"))
    _check_against_checkpoint(one_process["hf"], checkpoint)
    # the same recipe in fp32 takes the same first step to within bf16's rounding of the other weights
    bf16, fp32 = one_process["hf"]["losses"][0], one_process["hf_fp32"]["losses"][0]
    assert abs(bf16 - fp32) <= 2e-2 * fp32, (bf16, fp32)
    assert bf16 != fp32  # it did run in bf16


@pytest.mark.distributed
def test_bf16_zero3_two_processes_keeps_the_fp32_tensors_exact(two_processes, base):
    checkpoint = load_file(str(base / "model.safetensors"))
    for rank, result in enumerate(two_processes):
        for name in ("megatron", "hf_zero3"):
            _check_against_checkpoint(result[name], checkpoint)
        # full training from a checkpoint: ZeRO-3 cannot train an fp32 tensor next to bf16 ones, so the
        # fp32 tensors are held at the checkpoint's values (the routing bias still moves by balancing)
        full = result["megatron_full"]
        _check_against_checkpoint(full, checkpoint, held=False)
        for name, value in checkpoint.items():
            if _is_fp32(name) and not name.endswith("e_score_correction_bias"):
                assert torch.equal(full["trained"]["state"][name], value), (rank, name)


@pytest.mark.distributed
def test_bf16_zero3_preset_keeps_the_values_an_fp32_run_draws(two_processes):
    for result in two_processes:
        bf16, fp32 = result["preset"]["built"], result["preset_fp32"]["built"]
        assert set(bf16["listed"].values()) == {(True, "torch.float32")} and len(bf16["listed"]) == NUM_FP32
        for name, value in fp32["state"].items():
            got = bf16["state"][name]
            if _is_fp32(name):
                assert got.dtype == torch.float32 and torch.equal(got, value), name
            else:
                assert got.dtype == torch.bfloat16 and torch.equal(got, value.bfloat16()), name
