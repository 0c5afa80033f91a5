"""The Hugging Face Trainer path (moe_plugin/hf_trainer.py, docs/hf-trainer.md): ``transformers.Trainer`` with
``TrainingArguments(deepspeed=ds_configs/hf_trainer/zero3_lora.json, use_cpu=True)`` trains the model with peft
LoRA on 2 gloo processes (ZeRO-3 data parallel); its first step equals one process's within fp32 rounding and its
adapter the one process's within AdamW's propagation of it through the steps both routed alike, the loss falls,
the adapter loads back with plain ``AutoPeftModelForCausalLM`` from another directory with the same outputs, no
deprecation warning is raised, and the callback's offline W&B run holds the MoE keys, as many with 4x the
experts; ``report_to="wandb"`` is refused before a W&B run starts. The same launch trains at expert parallelism
2 x ZeRO-3 (``parallelize_experts``, expert adapters included): each rank holds half the experts, the steps equal
one process, the per-rank load metric is the EP ranks', and ``MoETrainer`` saves the whole adapter, which plain
peft loads on one process (tests/hf_trainer_workers.py); and with ``gradient_checkpointing=True``, equal to the
run without it."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from moe_plugin.testing.launch import run_distributed
from tests.hf_trainer_workers import LEARNING_RATE
from tests.tolerances import chain_length, chain_rel, check_final_adapters, sum_rel

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
            # the base by a path relative to the working directory, as the docs' example names it
            dict(
                run,
                base=os.path.relpath(base8),
                output_dir=str(tmp / "two"),
                deepspeed=DS_CONFIG,
                per_device=4,
                record_steps=True,
            ),
            dict(
                experts,
                output_dir=str(tmp / "ep2"),
                deepspeed=DS_CONFIG,
                per_device=4,
                ep=2,
                record_metrics=True,
                record_steps=True,
            ),
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
            dict(run, output_dir=str(tmp / "one"), deepspeed=None, per_device=8, record_steps=True),
            dict(run, base=base32, output_dir=str(tmp / "one32"), deepspeed=None, per_device=8, steps=2),
            dict(experts, output_dir=str(tmp / "one_experts"), deepspeed=None, per_device=8, record_steps=True),
            dict(refuse_wandb=str(tmp / "wandb_refusal"), base=base8),  # last: before the fix it left a W&B run
        ],
    )
    return {
        "two": [[r[0]] for r in two],
        "ep2": [r[1] for r in two],
        "checkpointed": [r[2] for r in two],
        "one": one[0][0],
        "one32": one[0][1],
        "one_experts": one[0][2],
        "wandb_refusal": one[0][3],
        "base8": base8,
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_train_with_deepspeed_zero3(runs):
    for result in runs["two"]:
        got = result[0]
        assert got["deepspeed"] and got["world"] == 2 and got["distributed_type"] == "DistributedType.DEEPSPEED"


def _step_tokens() -> int:
    """At most this many label tokens in a step's global batch of 8 rows (the workers' data)."""
    from moe_plugin.training.data.pipeline import IGNORE, arithmetic_examples

    return 8 * max(sum(label != IGNORE for label in ex.labels) for ex in arithmetic_examples(400, 0, "-"))


def _same_steps_as_one_process(got: dict, one: dict, adapter_sizes: dict) -> list:
    """What two processes share exactly with one process (docs/hf-trainer.md): the first step, from the same
    parameters, differs by the order of the fp32 sums alone (tests/tolerances.py 1-3): its loss within
    ``sum_rel`` of the tokens plus ``chain_rel`` of the model (``check_run``'s step-1 bound), its gradient norm
    within ``chain_rel`` of the largest element per element, at most ``chain_rel * norm`` each, so
    ``sqrt(n) * chain_rel * norm`` over the ``n`` trainable elements, plus the norm's own sum. Later steps differ
    by what AdamW made of that rounding, which grows with the steps: the Trainer records no step gradients to
    bound them by, so the final adapters are checked instead (``check_final_adapters``)."""
    out = []
    if len(got["losses"]) != len(one["losses"]) or len(got["grad_norms"]) != len(one["grad_norms"]):
        return [f"steps: {len(got['losses'])} logged, the one-process run {len(one['losses'])}"]
    tokens, n = _step_tokens(), sum(adapter_sizes.values())
    rel = chain_rel(chain_length(tokens, layers=4, width=128, vocab=384))  # the tiny preset: hidden 64, MLP 128
    loss_bound = (sum_rel(tokens) + rel) * abs(one["losses"][0])
    if not abs(got["losses"][0] - one["losses"][0]) <= loss_bound:
        out.append(f"step 1 loss {got['losses'][0]!r} vs {one['losses'][0]!r}, bound {loss_bound:.3g}")
    norm_bound = (math.sqrt(n) * rel + sum_rel(n)) * one["grad_norms"][0]
    if not abs(got["grad_norms"][0] - one["grad_norms"][0]) <= norm_bound:
        out.append(f"step 1 gradient norm {got['grad_norms'][0]!r} vs {one['grad_norms'][0]!r}, bound {norm_bound:.3g}")
    return out


def _steps_routed_alike(ranks: list, one: dict) -> int:
    """How many steps, from the first, every MoE layer's training forward chose the same experts for every token
    in ``ranks`` (each rank's ``step_routes``; rank r holds rows [4 r, 4 r + 4) of the step's 8) as in ``one``."""
    for step, calls in enumerate(one["step_routes"]):
        ours = [torch.cat(parts) for parts in zip(*(rank["step_routes"][step] for rank in ranks))]
        if len(ours) != len(calls) or not all(torch.equal(a, b) for a, b in zip(ours, calls)):
            return step
    return len(one["step_routes"])


def _adapters_equal_one_process(ranks: list, one: dict) -> list:
    """The whole adapter after the last step both layouts routed alike within AdamW's propagation of rounding
    over those steps (``check_final_adapters``), and rank 0's saved adapter equal to what it held after the
    last step. Why not always the last step: a routing choice is discrete, and where two experts' scores
    nearly tie, logits that differ by rounding choose differently (tests/hf_trainer_workers.py, _StepRecord);
    the trajectories then part by more than rounding, which no fp32 bound describes."""
    alike = _steps_routed_alike(ranks, one)
    print(f"routed alike for {alike} of {len(one['step_routes'])} steps")
    if alike == 0:  # from the same parameters, step 1's logits differ by rounding alone
        return ["step 1: the layouts chose different experts"]
    reference, got = one["step_adapters"][alike - 1], ranks[0]["step_adapters"][alike - 1]
    out = check_final_adapters(reference, got, steps=alike, lr=LEARNING_RATE)
    last = {name.replace(".default.", "."): value for name, value in ranks[0]["step_adapters"][-1].items()}
    saved = _adapter(ranks[0]["adapter"])
    if sorted(saved) != sorted(last) or not all(torch.equal(saved[k], last[k]) for k in saved):
        out.append("the saved adapter is not the one held after the last step")
    return out


@pytest.mark.distributed
def test_two_processes_equal_one_process_and_the_loss_falls(runs):
    """2 ranks of 4 rows against one process of 8: the first step within fp32 rounding, the adapter after each
    step both routed alike within AdamW's worst case of those steps elementwise (all but 1 % within a hundredth
    of a step; ``_adapters_equal_one_process``)."""
    one = runs["one"]
    assert len(one["losses"]) == STEPS and not one["deepspeed"]
    sizes = {k: v.numel() for k, v in _adapter(one["adapter"]).items()}
    for result in runs["two"]:
        assert _same_steps_as_one_process(result[0], one, sizes) == []
    assert _adapters_equal_one_process([result[0] for result in runs["two"]], one) == []
    losses = one["losses"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.05, losses


# a fresh process, as a user loads the adapter: plain peft's Auto class, nothing but the path (and the import that
# registers the model with transformers' Auto classes)
_AUTO_PEFT = """
import sys, torch
from peft import AutoPeftModelForCausalLM
import moe_plugin
from tests.hf_trainer_workers import probe_ids
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    logits = model(input_ids=probe_ids()).logits
    with model.disable_adapter():
        untrained = model.get_base_model()(input_ids=probe_ids()).logits
torch.save({"logits": logits, "untrained": untrained, "class": type(model).__name__}, sys.argv[2])
"""


@pytest.mark.distributed
def test_adapter_loads_with_auto_peft_from_another_directory_with_the_same_outputs(runs, tmp_path):
    """The base was loaded by a relative path and the LoraConfig leaves task_type unset (both as the docs' example
    had them): the adapter still loads with ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` in a new process
    whose working directory is elsewhere, and gives the trained model's logits."""
    import subprocess
    import sys

    got = runs["two"][0][0]
    with open(os.path.join(got["adapter"], "adapter_config.json")) as f:
        config = json.load(f)
    assert config["base_model_name_or_path"] == runs["base8"]  # absolute, though loaded by a relative path
    assert config["task_type"] == "CAUSAL_LM"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "logits.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _AUTO_PEFT, os.path.abspath(got["adapter"]), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(out)
    assert loaded["class"] == "PeftModelForCausalLM"
    for result in runs["two"]:
        torch.testing.assert_close(loaded["logits"], result[0]["logits"], rtol=1e-4, atol=1e-5)
    assert float((loaded["logits"] - loaded["untrained"]).abs().max()) > 1e-3  # the adapter changed the outputs


@pytest.mark.distributed
def test_a_short_run_prints_no_deprecation_warning(runs):
    """Trainer construction, 8 steps and the save, every warning recorded each time it is raised: none is a
    deprecation (torch's reduce_scatter_tensor / all_gather_into_tensor through DeepSpeed's ZeRO-3 and
    megatron-core's dispatcher printed one per step and rank before; moe_plugin.compat rebinds them)."""
    ranks = [r[0] for r in runs["two"]] + runs["ep2"] + runs["checkpointed"] + [runs["one"]]
    assert [got["deprecations"] for got in ranks] == [[]] * len(ranks), [got["deprecations"] for got in ranks]


@pytest.mark.distributed
def test_wandb_refusal_leaves_no_wandb_run_behind(runs):
    """``report_to="wandb"`` is refused at ``Trainer(...)``, before transformers' own W&B callback starts a run:
    the working directory holds no ``wandb/offline-run-*`` afterwards (it held an empty one before)."""
    got = runs["wandb_refusal"]
    assert got["refused"] is not None and 'report_to includes "wandb"' in got["refused"]
    assert got["wandb_dirs"] == []


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
    sizes = {k: v.numel() for k, v in _adapter(one["adapter"]).items()}
    for got in runs["ep2"]:
        assert got["deepspeed"] and got["world"] == 2 and got["local_experts"] == 4  # 8 experts, EP = 2
        assert got["experts_partitioned"]  # from_pretrained ran under zero.Init: the per-rank checkpoint read
        assert len(got["losses"]) == STEPS
        assert _same_steps_as_one_process(got, one, sizes) == []  # the adapters: the test below
        assert "ep_size" in got["bad_ep_size"] and "dividing the world size 2" in got["bad_ep_size"]
    losses = runs["ep2"][0]["losses"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.05, losses


@pytest.mark.distributed
def test_rank_load_under_expert_parallelism_is_the_busiest_ranks_share(runs):
    """At EP 2 the callback reports ``moe/<layer>/rank_load_max_over_mean`` of the 2 expert-parallel ranks (it was 1,
    the callback took EP 1): computed here by hand from the same logged row's per-expert load shares ``s_e``
    (load / mean): rank r holds experts [4 r, 4 r + 4), its load over the mean rank load is sum(s_e) / 4."""
    rows = runs["ep2"][0]["metric_rows"]  # rank 0 logs; the loads are summed over both ranks
    assert len(rows) == STEPS
    layers = sorted({k.split("/")[1] for _, row in rows for k in row if re.match(r"moe/layer\d+/rank_load_", k)})
    assert layers == ["layer1", "layer2", "layer3"]
    unbalanced = 0.0
    for _, row in rows:
        worst = 0.0
        for layer in layers:
            shares = row[f"moe/{layer}/load"]
            assert len(shares) == 8
            by_hand = max(sum(shares[:4]) / 4, sum(shares[4:]) / 4)
            assert row[f"moe/{layer}/rank_load_max_over_mean"] == pytest.approx(by_hand, rel=1e-12)
            worst = max(worst, by_hand)
        assert row["moe/rank_load_max_over_mean"] == pytest.approx(worst, rel=1e-12)
        unbalanced = max(unbalanced, worst)
    assert unbalanced > 1.01  # the premise: the routing sends one rank more than the other


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
    # the Trainer records no step gradients: each element within the worst case of the AdamW steps routed alike,
    # all but a few within a hundredth of a step (tests/tolerances.py, check_final_adapters)
    assert _adapters_equal_one_process(runs["ep2"], runs["one_experts"]) == []
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
