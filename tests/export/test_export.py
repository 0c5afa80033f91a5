"""moe-plugin export on real runs of the product's ``train``: one process (megatron, EP=1) and 4 gloo processes
(EP=2 x ZeRO-3). Each format reloads to the adapted model's logits (plain peft over the base as the reference,
the exports read back by plain loaders); a dropped expert delta is named; a target list that leaves a trained
target out is refused; the EP=2 x ZeRO-3 export equals the EP=1 export tensor for tensor, from the final
adapter and from a checkpoint step."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin import cli
from moe_plugin.export import FORMATS, ExportCheckError, export_run
from moe_plugin.testing.launch import run_distributed
from tests.export.saved_files import directory_tensors
from tests.recipes import recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/trainer_workers.py:run_recipes"
LR, STEPS = 2e-2, 2
BOUND = 1e-3 * LR * STEPS  # tests/training/test_trainer.py's bound for values trained through Adam
EXPERT_W2 = "model.layers.1.block_sparse_moe.experts.w2"


def _recipe(output_dir, world: int, ep: int) -> dict:
    return recipe(
        output_dir, world=world, ep=ep, seed=5, schedule={"steps": STEPS, "lr": LR}, checkpoint={"every": 1, "keep": 3}
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    run_distributed(WORKER, world_size=1, timeout_s=900, recipes=[_recipe(tmp / "ep1", 1, 1)])
    run_distributed(WORKER, world_size=4, timeout_s=1500, recipes=[_recipe(tmp / "ep2", 4, 2)])
    return {"ep1": str(tmp / "ep1"), "ep2": str(tmp / "ep2")}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exports")
    out = {}
    for run in ("ep1", "ep2"):
        for to in FORMATS:
            out[run, to] = str(tmp / f"{run}-{to}")
            export_run(runs[run], to, out[run, to], max_shard_size="20KB")
    return out


def _ids():
    g = torch.Generator().manual_seed(123)  # not the export's own check batch
    return torch.randint(0, 256, (3, 40), generator=g)


def _base(run):
    from moe_plugin.models import MoEPluginForCausalLM

    return MoEPluginForCausalLM.from_pretrained(os.path.join(run, "base")).float().eval()


@torch.no_grad()
def _logits(model):
    return model(input_ids=_ids()).logits.float()


def _rel(a, b):
    return float((a - b).abs().max()) / float(b.abs().max())


@pytest.fixture(scope="module")
def adapted(runs):
    """Plain peft over the base, from the run's own adapter directory: the reference logits; and the base's."""
    from peft import PeftModel

    run = runs["ep1"]
    return _logits(PeftModel.from_pretrained(_base(run), os.path.join(run, "adapter")).eval()), _logits(_base(run))


def _apply_per_expert(run, directory):
    """What a serving engine with MoE LoRA does: each expert's own A_e, B_e, scaling alpha / r."""
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    state = load_file(os.path.join(directory, "adapter_model.safetensors"))
    model = _base(run)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            b = state[key.replace(".lora_A.", ".lora_B.")]
            stem = key[len("base_model.model.") : -len(".lora_A.weight")]
            parts = stem.split(".")
            if parts[-2].isdigit():  # ...experts.{e}.w1
                params[".".join(parts[:-2] + parts[-1:])][int(parts[-2])] += scaling * b @ a
            else:
                params[stem + ".weight"] += scaling * b @ a
    return model


def _reload(run, to, directory):
    from peft import PeftModel

    from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint

    if to == "peft":
        return PeftModel.from_pretrained(_base(run), directory).eval()
    if to == "per-expert":
        return _apply_per_expert(run, directory)
    if to == "merged-hf":
        return MoEPluginForCausalLM.from_pretrained(directory).float().eval()
    return load_k3_checkpoint(directory).float().eval()


@pytest.mark.parametrize("to", FORMATS)
def test_each_format_reloads_to_the_adapted_models_logits(runs, exports, adapted, to):
    reference, base = adapted
    assert _rel(base, reference) > 1e-3  # the adapter changes the logits: dropping it could not pass
    got = _logits(_reload(runs["ep1"], to, exports["ep1", to]))
    assert _rel(got, reference) <= 1e-5, to
    manifest = json.load(open(os.path.join(exports["ep1", to], "moe_plugin_export.json")))
    assert manifest["check"]["logits_max_rel_diff"] <= 1e-5 and manifest["expert_deltas"] == 3 * 3 * 8


def test_per_expert_names_and_config_list_every_target(exports):
    directory = exports["ep1", "per-expert"]
    state = load_file(os.path.join(directory, "adapter_model.safetensors"))
    for e in range(8):
        a = state[f"base_model.model.model.layers.1.block_sparse_moe.experts.{e}.w1.lora_A.weight"]
        b = state[f"base_model.model.model.layers.1.block_sparse_moe.experts.{e}.w2.lora_B.weight"]
        assert a.shape == (4, 32) and b.shape[1] == 4
    assert not any(k.endswith("experts.lora_A.weight") for k in state)
    config = json.load(open(os.path.join(directory, "adapter_config.json")))
    assert sorted(config["target_modules"]) == ["gate", "k_proj", "q_proj", "w1", "w2", "w3"]


def test_merged_exports_hold_one_layers_experts_at_a_time(exports):
    for to in ("merged-hf", "merged-k3"):
        directory = exports["ep1", to]
        assert json.load(open(os.path.join(directory, "moe_plugin_export.json")))["peak_expert_layers"] == 1
        index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))["weight_map"]
        layers = {}
        for name, file in index.items():
            if ".experts." in name:
                layers.setdefault(file, set()).add(name.split(".")[2])
        assert layers and all(len(v) == 1 for v in layers.values()), to  # no shard mixes two layers' experts


@pytest.mark.parametrize("to", FORMATS)
def test_ep2_zero3_export_equals_the_ep1_export(runs, exports, to):
    one, four = directory_tensors(exports["ep1", to]), directory_tensors(exports["ep2", to])
    assert sorted(one) == sorted(four)
    adapter = load_file(os.path.join(runs["ep1"], "adapter", "adapter_model.safetensors"))
    # a merged weight moves by scaling * B @ A: its difference is bounded through the factors' differences
    largest = max(float(t.abs().max()) for t in adapter.values())
    merged_bound = 2.0 * 4 * (2 * largest + BOUND) * BOUND + 1e-6
    base = directory_tensors(os.path.join(runs["ep1"], "base"))
    for name, value in one.items():
        diff = float((four[name] - value).abs().max())
        if to in ("peft", "per-expert"):
            assert diff <= BOUND, (name, diff)
        else:
            assert diff <= merged_bound, (name, diff)
            if name in base and "proj" not in name and "experts" not in name and "gate" not in name:
                assert torch.equal(four[name], value), name  # untouched base tensors are identical


def test_checkpoint_step_exports_equal_across_layouts_and_the_last_equals_the_final(runs, tmp_path):
    for run in ("ep1", "ep2"):
        export_run(runs[run], "peft", str(tmp_path / f"{run}-step1"), step=1)
        export_run(runs[run], "peft", str(tmp_path / f"{run}-step2"), step=STEPS)
    for step in (1, 2):
        one, four = directory_tensors(tmp_path / f"ep1-step{step}"), directory_tensors(tmp_path / f"ep2-step{step}")
        assert sorted(one) == sorted(four)
        for name in one:
            assert float((one[name] - four[name]).abs().max()) <= BOUND, (step, name)
    final = load_file(os.path.join(runs["ep2"], "adapter", "adapter_model.safetensors"))
    last = directory_tensors(tmp_path / "ep2-step2")
    assert all(torch.equal(last[k], final[k]) for k in final)  # the gathered final adapter, rebuilt exactly
    first = directory_tensors(tmp_path / "ep2-step1")
    assert any(not torch.equal(first[k], final[k]) for k in final)


def test_a_dropped_expert_delta_is_named_and_nothing_is_written(runs, tmp_path, monkeypatch):
    import moe_plugin.export.merge as merge

    real = merge.delta_for

    def drop_expert_3(target, state):  # the merge forgets one expert of one layer, as converters have done
        delta = real(target, state)
        if target.weight == EXPERT_W2:
            delta[3] = 0
        return delta

    monkeypatch.setattr(merge, "delta_for", drop_expert_3)
    out = tmp_path / "dropped"
    with pytest.raises(ExportCheckError, match=rf"delta missing for \['{EXPERT_W2} expert 3'\]"):
        export_run(runs["ep1"], "merged-k3", str(out))
    assert not out.exists()


def test_a_dropped_per_expert_adapter_is_named(runs, tmp_path, monkeypatch):
    import moe_plugin.export.exporter as exporter

    real = exporter.split_experts

    def lose_expert_6(a, b, experts):
        pieces = real(a, b, experts)
        return [(x * 0, y * 0) if i == 6 else (x, y) for i, (x, y) in enumerate(pieces)]

    monkeypatch.setattr(exporter, "split_experts", lose_expert_6)
    with pytest.raises(ExportCheckError, match=r"delta missing for \[.*experts\.w1 expert 6"):
        export_run(runs["ep1"], "per-expert", str(tmp_path / "lost"))
    assert not (tmp_path / "lost").exists()


def test_a_target_list_that_leaves_trained_targets_out_is_refused(runs, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"targets: the list \['q_proj', 'k_proj', 'gate'\] does not cover what "
        r"was trained: 9 trained target\(s\).*experts\.w1",
    ):
        export_run(runs["ep1"], "peft", str(tmp_path / "a"), targets=["q_proj", "k_proj", "gate"])
    with pytest.raises(ValueError, match=r"targets: \['o_proj'\] match no adapted tensor"):
        export_run(runs["ep1"], "peft", str(tmp_path / "b"), targets=["q_proj", "o_proj"])


def test_an_adapter_config_that_does_not_list_the_expert_targets_is_refused(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["ep1"], run, ignore=shutil.ignore_patterns(".lock"))
    path = run / "adapter" / "adapter_config.json"
    config = json.load(open(path))
    config["target_parameters"] = None  # what a converter that knows only attention adapters writes
    json.dump(config, open(path, "w"))
    with pytest.raises(
        ValueError,
        match=r"adapter_config.json: its target list does not cover what was trained: "
        r"9 trained target\(s\)",
    ):
        export_run(str(run), "merged-hf", str(tmp_path / "out"))


def test_the_command(runs, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["export", "--run", runs["ep2"], "--to", "per-expert", str(out)]) == 0
    assert "check passed" in capsys.readouterr().out and (out / "adapter_model.safetensors").exists()
    assert cli.main(["export", "--run", runs["ep2"], "--to", "peft", "--step", "7", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "step: the run has no complete checkpoint at step 7; complete checkpoints: [1, 2]" in err
    assert cli.main(["export", "--run", str(tmp_path), "--to", "peft", str(tmp_path / "y")]) == 2
    assert "has no moe_plugin_run.json" in capsys.readouterr().err


def test_requantise_needs_a_packed_base(runs, tmp_path):
    with pytest.raises(ValueError, match="requantise: the base's experts are not packed"):
        export_run(runs["ep1"], "merged-k3", str(tmp_path / "q"), requantise=True)
    with pytest.raises(ValueError, match="requantise: only merged exports"):
        export_run(runs["ep1"], "peft", str(tmp_path / "q"), requantise=True)
