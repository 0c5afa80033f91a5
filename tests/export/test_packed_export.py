"""moe-plugin export of runs the product's ``train`` made over packed bases (the tiny MXFP4 and INT4 K3-format
checkpoints of ``testing.packed_checkpoints``, one process). References are independent of the export: plain peft over
the base's dequantised fp32 twin (written by the generator), and ``weights.quantize.merge_expert_adapter`` for
requantised experts. Every format reloads to the adapted model's logits; merged exports write dense fp32
experts (the base's dtype) by default, or the base's format again with ``--requantise``, counting the values
that changed; a dropped expert delta in a requantised export is named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin import cli
from moe_plugin.export import FORMATS, ExportCheckError, export_run
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from moe_plugin.testing.packed_checkpoints import write_tiny_packed_checkpoint
from tests.export.saved_files import directory_tensors
from tests.recipes import recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/trainer_workers.py:run_recipes"
PACKED = ("mxfp4", "int4")
KINDS = [(to, False) for to in FORMATS] + [("merged-hf", True), ("merged-k3", True)]
EXPERT_VALUES = 3 * 3 * 8 * 32 * 32  # MoE layers x matrices x experts x 32 x 32


LR, STEPS = 2e-2, 2
BOUND = 1e-3 * LR * STEPS  # tests/training/test_trainer.py's bound for values trained through Adam


def _recipe(output_dir, base, world: int = 1, ep: int = 1) -> dict:
    return recipe(
        output_dir,
        world=world,
        ep=ep,
        base=base,
        model={"overrides": {}},
        seed=5,
        schedule={"steps": STEPS, "lr": LR},
        checkpoint={"every": 1 if world > 1 else 0, "keep": 3},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed-runs")
    for fmt in PACKED:
        write_tiny_packed_checkpoint(tmp / fmt, fmt, seed=1, dequantized_path=tmp / f"{fmt}-fp32", attn_res=False)
        for base in (fmt, f"{fmt}-fp32"):  # a base the trainer reads brings its tokenizer (byte ids here)
            ByteTokenizer().save_pretrained(tmp / base)
    run_distributed(WORKER, world_size=1, timeout_s=900, recipes=[_recipe(tmp / f"run-{f}", tmp / f) for f in PACKED])
    # the same MXFP4 run at EP=2 x ZeRO-3 on 4 gloo processes
    run_distributed(WORKER, world_size=4, timeout_s=1500, recipes=[_recipe(tmp / "run-ep2", tmp / "mxfp4", 4, 2)])
    out = {
        fmt: {"run": str(tmp / f"run-{fmt}"), "base": str(tmp / fmt), "twin": str(tmp / f"{fmt}-fp32")}
        for fmt in PACKED
    }
    out["ep2"] = dict(out["mxfp4"], run=str(tmp / "run-ep2"))
    return out


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed-exports")
    out = {}
    for fmt in PACKED:
        for to, requantise in KINDS:
            directory = str(tmp / f"{fmt}-{to}-{'q' if requantise else 'd'}")
            out[fmt, to, requantise] = (
                directory,
                export_run(runs[fmt]["run"], to, directory, requantise=requantise, max_shard_size="20KB"),
            )
    return out


def _ids():
    g = torch.Generator().manual_seed(321)  # not the export's own check batch
    return torch.randint(0, 256, (2, 40), generator=g)


@torch.no_grad()
def _logits(model):
    return model(input_ids=_ids()).logits.float()


def _rel(a, b):
    return float((a - b).abs().max()) / float(b.abs().max())


def _twin(paths):
    from moe_plugin.models import load_k3_checkpoint

    return load_k3_checkpoint(paths["twin"]).float().eval()


def _adapted_twin(paths):
    from peft import PeftModel

    return PeftModel.from_pretrained(_twin(paths), os.path.join(paths["run"], "adapter")).eval()


def _expert_adapters(model):
    """``{weight name: (lora_A, lora_B, scaling)}`` of the expert adapters of a plain-peft model."""
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "parameter_name", None) and "default" in module.lora_A:
            stem = name[len("base_model.model.") :].replace(".base_layer", "")
            out[f"{stem}.{module.parameter_name}"] = (
                module.lora_A["default"].weight.detach(),
                module.lora_B["default"].weight.detach(),
                module.scaling["default"],
            )
    return out


def _apply_per_expert(model, directory):
    """What a serving engine with MoE LoRA does: each expert's own A_e, B_e, scaling alpha / r, onto dense weights."""
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    state = load_file(os.path.join(directory, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            b = state[key.replace(".lora_A.", ".lora_B.")]
            parts = key[len("base_model.model.") : -len(".lora_A.weight")].split(".")
            if parts[-2].isdigit():  # ...experts.{e}.w1
                params[".".join(parts[:-2] + parts[-1:])][int(parts[-2])] += scaling * b @ a
            else:
                params[".".join(parts) + ".weight"] += scaling * b @ a
    return model


def _reload(paths, to, directory):
    from peft import PeftModel

    from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint

    if to == "peft":
        return PeftModel.from_pretrained(_twin(paths), directory).eval()
    if to == "per-expert":
        return _apply_per_expert(_twin(paths), directory)
    if to == "merged-hf":
        return MoEPluginForCausalLM.from_pretrained(directory).float().eval()
    return load_k3_checkpoint(directory).float().eval()


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("to", FORMATS)
def test_each_format_reloads_to_the_adapted_models_logits(runs, exports, fmt, to):
    reference = _logits(_adapted_twin(runs[fmt]))
    assert _rel(_logits(_twin(runs[fmt])), reference) > 1e-3  # the adapter matters: dropping it could not pass
    directory, report = exports[fmt, to, False]
    assert _rel(_logits(_reload(runs[fmt], to, directory)), reference) <= 1e-5
    assert report.check.logits_rel_diff <= 1e-5 and report.expert_deltas == 3 * 3 * 8


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("to", ["merged-hf", "merged-k3"])
def test_merged_exports_write_the_bases_dtype_and_hold_one_layers_experts(runs, exports, fmt, to):
    directory, report = exports[fmt, to, False]
    manifest = json.load(open(os.path.join(directory, "moe_plugin_export.json")))
    assert manifest["expert_format"] == report.expert_format == "float32"  # the tiny base's dtype
    assert manifest["requantised_changed_values"] is None and "written in float32" in report.summary()
    assert manifest["peak_expert_layers"] == 1
    config = json.load(open(os.path.join(directory, "config.json")))
    text = config.get("text_config", config)  # merged-k3 keeps the base's own form (text_config inside)
    assert "quantization_config" not in text and "quantization_config" not in config
    assert config.get("expert_format", "dense") == "dense"
    twin = _twin(runs[fmt]).state_dict()
    adapters = _expert_adapters(_adapted_twin(runs[fmt]))
    written = {}
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            written.update(load_file(os.path.join(directory, f)))
    assert all(t.dtype == torch.float32 for t in written.values())
    for name, (a, b, scaling) in adapters.items():  # the dequantised experts + each expert's own B_e A_e
        for e in range(8):
            want = twin[name][e] + scaling * b.view(b.shape[0], 4, 8)[:, :, e] @ a.view(8, 4, -1)[e]
            key = name if to == "merged-hf" else name.replace("experts.", f"experts.{e}.") + ".weight"
            got = written[key][e] if to == "merged-hf" else written[key]
            assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), (name, e)


def _requantised_reference(paths, fmt):
    """merge_expert_adapter (the packed-base work's own merge) on the stored packed experts: per stack the
    packed tensors and the changed count."""
    from moe_plugin.models import load_k3_checkpoint
    from moe_plugin.weights.quantize import merge_expert_adapter

    packed = load_k3_checkpoint(paths["base"]).state_dict()
    out = {}
    for name, (a, b, scaling) in _expert_adapters(_adapted_twin(paths)).items():
        merged = merge_expert_adapter(
            fmt, packed[name], packed[name + "_scale"], a.shape[1], a, b, scaling, requantize=True
        )
        out[name] = merged
    return out


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("to", ["merged-hf", "merged-k3"])
def test_requantised_exports_hold_the_requantised_merge_and_count_the_changes(runs, exports, fmt, to):
    from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint

    directory, report = exports[fmt, to, True]
    reference = _requantised_reference(runs[fmt], fmt)
    changed = sum(m.changed for m in reference.values())
    manifest = json.load(open(os.path.join(directory, "moe_plugin_export.json")))
    assert manifest["requantised_changed_values"] == report.requantised_changed_values == changed
    assert manifest["requantised_values"] == EXPERT_VALUES and 0 < changed < EXPERT_VALUES
    assert manifest["expert_format"] == fmt and manifest["check"]["requantised_ties"] == 0
    assert f"experts requantised to {fmt}, {changed} of {EXPERT_VALUES} expert values changed" in report.summary()
    model = MoEPluginForCausalLM.from_pretrained(directory) if to == "merged-hf" else load_k3_checkpoint(directory)
    state = model.state_dict()
    for name, merged in reference.items():
        assert torch.equal(state[name], merged.packed) and torch.equal(state[name + "_scale"], merged.scale), name
    if to == "merged-k3":
        stored = (
            load_file(os.path.join(directory, "model.safetensors"))
            if os.path.exists(os.path.join(directory, "model.safetensors"))
            else {}
        )
        config = json.load(open(os.path.join(directory, "config.json")))
        formats = {"mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized"}
        # merged-k3 keeps the base's own config.json, its quantization_config inside text_config as K3 has it
        assert config.get("text_config", config)["quantization_config"]["format"] == formats[fmt]
        assert all(
            ".weight_packed" in n or "experts." not in n or n.endswith(("weight_scale", "weight_shape")) for n in stored
        )


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("to", ["merged-hf", "merged-k3"])
def test_requantised_exports_reload_to_the_requantised_models_logits(runs, exports, fmt, to):
    """The reference: the dequantised twin with its experts set to the requantised merge, the other adapters
    by plain peft (the expert ones switched off: their deltas are in the requantised experts)."""
    from peft import PeftModel

    from moe_plugin.ops.quant import decode

    reference = _requantised_reference(runs[fmt], fmt)
    twin = _twin(runs[fmt])
    params = dict(twin.named_parameters())
    with torch.no_grad():
        for name, merged in reference.items():
            params[name].copy_(decode(fmt, merged.packed, merged.scale, params[name].shape[-1], torch.float32))
    model = PeftModel.from_pretrained(twin, os.path.join(runs[fmt]["run"], "adapter")).eval()
    for module in model.modules():
        if getattr(module, "parameter_name", None) and "default" in module.lora_B:
            torch.nn.init.zeros_(module.lora_B["default"].weight)
    want = _logits(model)
    directory, _ = exports[fmt, to, True]
    got = _logits(_reload(runs[fmt], to, directory))
    assert _rel(got, want) <= 1e-5
    assert _rel(got, _logits(_adapted_twin(runs[fmt]))) > 1e-5  # requantising is lossy: not the exact merge


def test_a_dropped_expert_delta_in_a_requantised_export_is_named(runs, tmp_path, monkeypatch):
    import moe_plugin.export.merge as merge

    real = merge.delta_for
    weight = "model.layers.2.block_sparse_moe.experts.w2"

    def drop_expert_3(target, state):
        delta = real(target, state)
        if target.weight == weight:
            delta[3] = 0
        return delta

    monkeypatch.setattr(merge, "delta_for", drop_expert_3)
    out = tmp_path / "dropped"
    with pytest.raises(
        ExportCheckError,
        match=rf"delta missing for \['{weight} expert 3'\] \(the requantised "
        r"experts equal the base's\)",
    ):
        export_run(runs["mxfp4"]["run"], "merged-k3", str(out), requantise=True)
    assert not out.exists()


def test_the_command_prints_the_changed_values(runs, exports, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["export", "--run", runs["int4"]["run"], "--to", "merged-hf", "--requantise", str(out)]) == 0
    changed = exports["int4", "merged-hf", True][1].requantised_changed_values
    assert f"experts requantised to int4, {changed} of {EXPERT_VALUES} expert values changed" in capsys.readouterr().out


@pytest.mark.parametrize("to", FORMATS)
def test_an_ep2_zero3_packed_run_exports_as_the_ep1_run(runs, exports, tmp_path, to):
    """Tensor for tensor. The bound is looser than tests/export/test_export.py's for dense runs: the packed
    kernels dequantise per group of the rank's own experts, which leaves gradients equal only to 1e-5 of each
    tensor's largest (tests/training/test_packed_trainer.py), and Adam's normalised update of an element with a
    small gradient magnifies that; 1% of the largest move Adam can make, lr x steps, covers it."""
    one = directory_tensors(exports["mxfp4", to, False][0])
    four_dir = str(tmp_path / "ep2")
    export_run(runs["ep2"]["run"], to, four_dir, max_shard_size="20KB")
    four = directory_tensors(four_dir)
    assert sorted(one) == sorted(four)
    bound = 1e-2 * LR * STEPS
    adapter = load_file(os.path.join(runs["mxfp4"]["run"], "adapter", "adapter_model.safetensors"))
    largest = max(float(t.abs().max()) for t in adapter.values())
    merged_bound = 2.0 * 4 * (2 * largest + bound) * bound + 1e-6  # scaling x r x (|B| |dA| + |dB| |A|)
    for name, value in one.items():
        diff = float((four[name] - value).abs().max())
        assert diff <= (bound if to in ("peft", "per-expert") else merged_bound), (name, diff)


def test_the_ep2_zero3_checkpoint_over_a_packed_base_rebuilds_the_gathered_adapter(runs, tmp_path):
    """The last DeepSpeed checkpoint of the 4-process run, stitched across expert-parallel ranks on one
    process (export/zero_checkpoint.py), is the adapter the run gathered, bit for bit."""
    export_run(runs["ep2"]["run"], "peft", str(tmp_path / "step"), step=STEPS)
    rebuilt = load_file(str(tmp_path / "step" / "adapter_model.safetensors"))
    final = load_file(os.path.join(runs["ep2"]["run"], "adapter", "adapter_model.safetensors"))
    assert sorted(rebuilt) == sorted(final) and any("experts" in k for k in final)
    assert all(torch.equal(rebuilt[k], final[k]) for k in final)
