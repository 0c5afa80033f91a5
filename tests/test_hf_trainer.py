"""The Hugging Face Trainer path (moe_plugin/hf_trainer.py, docs/hf-trainer.md): ``transformers.Trainer`` with
``TrainingArguments(deepspeed=ds_configs/hf_trainer/zero3_lora.json, use_cpu=True)`` trains the model with peft
LoRA on 2 gloo processes (ZeRO-3 data parallel); its losses equal one process's, the loss falls, the adapter
loads back in plain peft with the same outputs, and the callback's offline W&B run holds the MoE keys, as many
with 4x the experts. The same launch trains at expert parallelism 2 x ZeRO-3 (``parallelize_experts``, expert
adapters included): each rank holds half the experts, the steps equal one process, and ``MoETrainer`` saves the
whole adapter, which plain peft loads on one process (tests/hf_trainer_workers.py); and with
``gradient_checkpointing=True``, equal to the run without it."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from moe_plugin.testing.launch import run_distributed
from tests.hf_trainer_workers import LEARNING_RATE
from tests.tolerances import check_final_adapters

WORKER = "tests/hf_trainer_workers.py:train_runs"
DS_CONFIG = "ds_configs/hf_trainer/zero3_lora.json"
STEPS = 8


def _save_base(path, num_experts: int) -> str:
    from moe_plugin import MoEPluginForCausalLM, preset_config

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny", num_experts=num_experts))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    base8, base32 = _save_base(tmp / "base8", 8), _save_base(tmp / "base32", 32)
    run = dict(base=base8, steps=STEPS, wandb="offline")
    experts = dict(run, wandb="disabled", expert_adapters=True)  # LoRA on the routed experts too
    two = run_distributed(
        WORKER,
        world_size=2,
        timeout_s=1200,
        runs=[
            dict(run, output_dir=str(tmp / "two"), deepspeed=DS_CONFIG, per_device=4),
            dict(experts, output_dir=str(tmp / "ep2"), deepspeed=DS_CONFIG, per_device=4, ep=2),
            dict(
                run,
                output_dir=str(tmp / "two_checkpointed"),
                deepspeed=DS_CONFIG,
                per_device=4,
                wandb="disabled",
                checkpointing=True,
            ),
        ],
    )
    one = run_distributed(
        WORKER,
        world_size=1,
        timeout_s=1200,
        runs=[
            dict(run, output_dir=str(tmp / "one"), deepspeed=None, per_device=8),
            dict(run, base=base32, output_dir=str(tmp / "one32"), deepspeed=None, per_device=8, steps=2),
            dict(experts, output_dir=str(tmp / "one_experts"), deepspeed=None, per_device=8),
        ],
    )
    return {
        "two": [[r[0]] for r in two],
        "ep2": [r[1] for r in two],
        "checkpointed": [r[2] for r in two],
        "one": one[0][0],
        "one32": one[0][1],
        "one_experts": one[0][2],
        "base8": base8,
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_train_with_deepspeed_zero3(runs):
    for result in runs["two"]:
        got = result[0]
        assert got["deepspeed"] and got["world"] == 2 and got["distributed_type"] == "DistributedType.DEEPSPEED"


@pytest.mark.distributed
def test_two_processes_equal_one_process_and_the_loss_falls(runs):
    one = runs["one"]
    assert len(one["losses"]) == STEPS and not one["deepspeed"]
    for result in runs["two"]:
        got = result[0]
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], one["losses"]):
            assert math.isclose(a, b, rel_tol=1e-4), (got["losses"], one["losses"])
        for a, b in zip(got["grad_norms"], one["grad_norms"]):
            assert math.isclose(a, b, rel_tol=1e-3), (got["grad_norms"], one["grad_norms"])
    losses = one["losses"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.05, losses


@pytest.mark.distributed
def test_adapter_loads_in_plain_peft_with_the_same_outputs(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import moe_plugin  # noqa: F401
    from tests.hf_trainer_workers import probe_ids

    got = runs["two"][0][0]
    with open(os.path.join(got["adapter"], "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == runs["base8"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base8"]), got["adapter"])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_ids()).logits
        base = model.get_base_model()
        with model.disable_adapter():
            untrained = base(input_ids=probe_ids()).logits
    for result in runs["two"]:
        torch.testing.assert_close(logits, result[0]["logits"], rtol=1e-4, atol=1e-5)
    assert float((logits - untrained).abs().max()) > 1e-3  # the adapter changed the outputs


def _keys(run_dir: str) -> set:
    from tests.training.wandb_records import offline_history

    return {k for row in offline_history(run_dir) for k in row if not k.startswith("_")}


@pytest.mark.distributed
def test_offline_wandb_run_holds_the_moe_keys_bounded_in_the_experts(runs):
    from tests.training.wandb_records import offline_history

    (run_dir,) = runs["two"][0][0]["wandb_dirs"]  # rank 0 alone writes the run
    rows = offline_history(run_dir)
    keys = _keys(run_dir)
    for layer in ("layer1", "layer2", "layer3"):
        for name in ("load", "load_max_over_mean", "load_cv", "dead_experts", "overloaded_experts", "routing_drift"):
            assert f"moe/{layer}/{name}" in keys
    for name in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "moe/routing_drift",
        "moe/dead_experts",
        "moe/load_max_over_mean",
        "moe/expert_load_plot",
    ):
        assert name in keys
    logged = [row for row in rows if "train/loss" in row]
    assert [row["train/loss"] for row in logged] == pytest.approx(runs["two"][0][0]["losses"], rel=1e-6)
    histogram = logged[-1]["moe/layer1/load"]
    assert histogram["_type"] == "histogram" and len(histogram["values"]) == 32
    assert sum(histogram["values"]) == 8  # one entry per expert of the 8
    assert logged[0]["moe/routing_drift"] == 0.0 < logged[-1]["moe/routing_drift"]  # lora_B starts at 0
    assert os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(run_dir)), "expert_load.png"))
    (run32,) = runs["one32"]["wandb_dirs"]
    assert _keys(run32) == keys  # 4x the experts, the same keys
    hist32 = [row for row in offline_history(run32) if "moe/layer1/load" in row][-1]["moe/layer1/load"]
    assert len(hist32["values"]) == 32 and sum(hist32["values"]) == 32


def _adapter(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.distributed
def test_expert_parallel_holds_half_the_experts_and_equals_one_process(runs):
    one = runs["one_experts"]
    assert len(one["losses"]) == STEPS
    for got in runs["ep2"]:
        assert got["deepspeed"] and got["world"] == 2 and got["local_experts"] == 4  # 8 experts, EP = 2
        assert got["experts_partitioned"]  # from_pretrained ran under zero.Init: the per-rank checkpoint read
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], one["losses"]):
            assert math.isclose(a, b, rel_tol=1e-4), (got["losses"], one["losses"])
        for a, b in zip(got["grad_norms"], one["grad_norms"]):
            assert math.isclose(a, b, rel_tol=1e-3), (got["grad_norms"], one["grad_norms"])
        assert "ep_size" in got["bad_ep_size"] and "dividing the world size 2" in got["bad_ep_size"]
    losses = runs["ep2"][0]["losses"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.05, losses


@pytest.mark.distributed
def test_expert_parallel_adapter_is_whole_and_loads_in_plain_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import moe_plugin  # noqa: F401
    from tests.hf_trainer_workers import probe_ids

    saved, reference = _adapter(runs["ep2"][0]["adapter"]), _adapter(runs["one_experts"]["adapter"])
    assert saved.keys() == reference.keys()
    expert_keys = [k for k in saved if re.search(r"\.experts\.(base_layer\.)*lora_", k)]
    assert len(expert_keys) == 2 * 3 * 3  # lora_A and lora_B of w1, w2, w3 in the 3 MoE layers
    for key, value in saved.items():
        assert value.shape == reference[key].shape, key  # lora_A [r * 8, in]: every expert, not rank 0's 4
    # the Trainer records no step gradients: each element within the worst case of STEPS AdamW steps, all but a
    # few within a hundredth of a step (tests/tolerances.py, check_final_adapters)
    assert check_final_adapters(reference, saved, steps=STEPS, lr=LEARNING_RATE) == []
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base8"]), runs["ep2"][0]["adapter"])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_ids()).logits
        with model.disable_adapter():
            untrained = model.get_base_model()(input_ids=probe_ids()).logits
    for got in runs["ep2"]:
        torch.testing.assert_close(logits, got["logits"], rtol=1e-4, atol=1e-5)
    assert float((logits - untrained).abs().max()) > 1e-3


@pytest.mark.distributed
def test_gradient_checkpointing_under_zero3_equals_the_same_run_without_it(runs):
    """TrainingArguments(gradient_checkpointing=True) on 2 processes x ZeRO-3: transformers' switch sets the model's
    "full" activation checkpointing (moe_plugin/layers/recompute.py, non-reentrant, routing kept): the logged losses,
    gradient norms and the trained model's logits equal the run without it bitwise, and each router ran once per
    forward (8 steps of 4 rows x 1 micro-batch: 8 calls per MoE layer, as without)."""
    for got, plain in zip(runs["checkpointed"], runs["two"]):
        plain = plain[0]
        assert got["recompute_modes"] == ["full"] and plain["recompute_modes"] == ["off"]
        assert got["losses"] == plain["losses"] and got["grad_norms"] == plain["grad_norms"]
        assert torch.equal(got["logits"], plain["logits"])
        assert got["router_calls_per_layer"] == plain["router_calls_per_layer"] == STEPS


def test_parallelize_experts_refuses_a_peft_model_and_a_missing_process_group(tmp_path):
    from peft import LoraConfig, get_peft_model

    from moe_plugin import MoEPluginForCausalLM, preset_config
    from moe_plugin.parallel.hf_expert_parallel import parallelize_experts

    model = MoEPluginForCausalLM(preset_config("tiny", num_experts=8))
    with pytest.raises(ValueError, match="torch.distributed.*TrainingArguments"):
        parallelize_experts(model, 2)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="^model: .*before get_peft_model"):
        parallelize_experts(peft_model, 2)


@pytest.mark.distributed
def test_parallelize_experts_reads_the_index_and_each_shard_header_once(tmp_path):
    """Experts ZeRO-3 partitioned over all ranks are read again from the checkpoint: on a 2-layer model whose
    layers are both MoE, saved in several shards, the index is read once and each shard's header once (they
    were read again for every MoE layer), and the local experts equal the checkpoint's."""
    from moe_plugin import MoEPluginForCausalLM, preset_config

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(
        preset_config("tiny", num_hidden_layers=2, layer_types=["kda", "mla"], first_k_dense_replace=0)
    )
    model.save_pretrained(str(tmp_path), max_shard_size="200KB")
    shards = sorted(str(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 1  # the premise: an index over several shards
    got = run_distributed(
        "tests/hf_trainer_workers.py:count_checkpoint_reads", world_size=1, timeout_s=1200, base=str(tmp_path)
    )[0]
    assert got["moe_layers"] == 2 and got["partitioned"] and got["experts_match"]
    assert got["index_reads"] == 1
    assert got["header_reads"] == {shard: 1 for shard in shards}
