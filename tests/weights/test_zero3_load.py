"""load_state into a model built under deepspeed.zero.Init on 2 gloo ranks (rank code in zero3_workers.py):
each rank writes only its own flat partition, and the gathered model equals the saved one exactly."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_plugin.models import MoEPluginForCausalLM, preset_config, save_k3_checkpoint
from moe_plugin.testing.launch import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts processes

WORKERS = Path(__file__).with_name("zero3_workers.py")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3_load")
    torch.manual_seed(0)
    plain = MoEPluginForCausalLM(preset_config("tiny", attn_res=False))
    plain.save_pretrained(root / "hf", max_shard_size="100KB")
    save_k3_checkpoint(plain, root / "k3", max_shard_size="100KB")
    state = {k: v.detach().clone().contiguous() for k, v in plain.state_dict().items()}
    broken = {
        "missing": {k: v for k, v in state.items() if k != "model.norm.weight"},
        "extra": state | {"model.layers.9.self_attn.q_proj.weight": torch.zeros(1)},
        "misshapen": state | {"model.layers.0.self_attn.q_proj.weight": torch.zeros(60, 64)},
    }
    for name, tensors in broken.items():
        (root / "broken" / name).mkdir(parents=True)
        save_file(tensors, str(root / "broken" / name / "model.safetensors"))
    results = run_distributed(f"{WORKERS}:load_partitioned", world_size=2, timeout_s=400, case_dir=str(root))
    return state, results


def test_premise_every_parameter_is_partitioned(case):
    state, results = case
    total = sum(v.numel() for k, v in state.items() if "e_score_correction_bias" not in k)  # the only buffers
    for result in results:
        assert result["placeholders"] == [(0,)], "parameters must be empty placeholders under ZeRO-3"
        assert total / 2 <= result["partition_numel"] < 0.6 * total


@pytest.mark.parametrize("source", ["hf", "k3"])
def test_gathered_partitions_equal_the_saved_model(case, source):
    state, results = case
    for rank, result in enumerate(results):
        got = result[source]["state"]
        assert sorted(got) == sorted(state)
        for name, value in state.items():
            assert torch.equal(got[name], value), f"rank {rank}: {name}"


@pytest.mark.parametrize("source", ["hf", "k3"])
def test_each_rank_reads_about_half_the_checkpoint(case, source):
    state, results = case
    total = sum(v.numel() for v in state.values())
    read = [result[source]["stats"]["elements"] for result in results]
    # rows that straddle the partition boundary are read by both ranks; nothing else is read twice
    assert all(r < 0.6 * total for r in read) and sum(read) >= total, (read, total)


def test_strict_errors_name_the_tensor_under_zero3(case):
    _, results = case
    for result in results:
        errors = result["errors"]
        assert errors["missing"].startswith("checkpoint: 1 tensors of the model are missing: ['model.norm.weight']")
        assert errors["extra"].startswith(
            "checkpoint: 1 tensors the model does not have: ['model.layers.9.self_attn.q_proj.weight']"
        ), errors["extra"]
        # the model side of the shape is ds_shape, not the empty placeholder's (0,)
        assert "model.layers.0.self_attn.q_proj.weight: checkpoint [60, 64], model [64, 64]" in errors["misshapen"]
        assert result["untouched_after_errors"], "a refused checkpoint must not write any partition"


def test_odd_sized_parameter_partition_and_padding(case):
    _, results = case
    for result in results:
        padding = result["padding"]
        assert torch.equal(padding["gathered"], padding["value"])
        start = 8 * result["rank"]  # 15 elements padded to 16: 8 per rank
        want = torch.cat([padding["value"].reshape(-1), torch.zeros(1)])[start : start + 8]
        assert torch.equal(padding["partition"], want), (result["rank"], padding["partition"])
