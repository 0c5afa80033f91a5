"""The pieces that keep a run honest, one at a time: the divergence and non-finite guards (``guards.py``) and
the fingerprints of a run's inputs (``inputs.py``). The runs that use them are in ``test_run_safety.py``."""

from __future__ import annotations

import json

import pytest

from moe_plugin.training.guards import DivergenceSection, StepGuard, TrainingStopped
from moe_plugin.training.inputs import RECORD, check_inputs, fingerprint_inputs, read_recorded_inputs
from tests.training.run_safety_workers import fake_base

# the loss and gradient norm of lr 1e6 on recipes/bases/tiny-arith (measured with this trainer): the loss rises
# 2.8x while the clipped norm collapses to ~2e-7, so a NaN-only check never fires
LR_1E6_LOSSES = [
    1.652,
    3.969,
    4.595,
    4.715,
    4.548,
    4.803,
    4.93,
    4.74,
    4.63,
    4.634,
    4.847,
    4.601,
    4.352,
    4.356,
    4.661,
    4.603,
    4.5,
    4.6,
]
LR_1E30_LOSSES = [
    1.652,
    2.933,
    2.979,
    3.061,
    2.93,
    3.31,
    3.351,
    3.19,
    2.934,
    3.158,
    3.232,
    2.896,
    2.683,
    2.737,
    3.099,
    3.138,
    3.047,
    3.229,
]


def _drive(guard, losses, norm=1e-7):
    for step in range(1, len(losses) + 1):
        guard.check(step, losses[:step], norm, last_checkpoint=None)


@pytest.mark.parametrize("losses", [LR_1E6_LOSSES, LR_1E30_LOSSES], ids=["lr1e6", "lr1e30"])
def test_the_default_divergence_rule_warns_once_then_stops(losses):
    warnings = []
    with pytest.raises(TrainingStopped) as stopped:
        _drive(StepGuard(None, warnings.append), losses)
    # diverging from step 6 (the first window past step 1), stopped on the 11th diverging step in a row
    assert stopped.value.step == 16 and stopped.value.reason == "diverged"
    assert str(stopped.value).startswith("step 16: the loss diverged:") and "\n" not in str(stopped.value)
    assert "guards.divergence.stop_after (10)" in str(stopped.value)
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 6: the loss is diverging")


def test_a_healthy_run_and_warn_only():
    falling = [2.0 * 0.97**i + 0.1 * (i % 2) for i in range(40)]
    warnings = []
    _drive(StepGuard(None, warnings.append), falling)
    assert warnings == []
    _drive(StepGuard(DivergenceSection(stop_after=None), warnings.append), LR_1E6_LOSSES * 3)
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "loss,norm,named", [(float("nan"), 1.0, "the loss is nan"), (2.0, float("inf"), "the gradient norm is inf")]
)
def test_a_non_finite_step_stops_naming_the_step(loss, norm, named):
    guard = StepGuard(None, print)
    guard.check(1, [2.0], 1.0, None)
    with pytest.raises(TrainingStopped, match=rf"^step 2: {named};.*newest checkpoint is step 1's") as stopped:
        guard.check(2, [2.0, loss], norm, last_checkpoint=1)
    assert isinstance(stopped.value, ValueError) and stopped.value.reason == "non-finite"


def test_inputs_are_fingerprinted_and_every_change_is_named(tmp_path):
    base, data = tmp_path / "base", tmp_path / "train.jsonl"
    fake_base(base, 1.0)
    data.write_text('{"text": "1 - 1 = 0"}\n')
    recipe = {"model": {"from_pretrained": str(base)}, "data": {"kind": "text", "path": str(data)}}
    recorded = fingerprint_inputs(recipe, str(base))
    assert recorded["base"]["path"] == str(base.resolve()) and set(recorded["base"]["files"]) == {
        "config.json",
        "model.safetensors",
    }
    check_inputs(recorded, fingerprint_inputs(recipe, str(base)), override_flag="--allow-changed-inputs")

    def refused(**expect):
        with pytest.raises(ValueError) as caught:
            check_inputs(recorded, fingerprint_inputs(recipe, str(base)), override_flag="--allow-changed-inputs")
        message = str(caught.value)
        assert "\n" not in message and message.endswith(
            "pass --allow-changed-inputs to go on with the inputs as they are now"
        ), message
        for text in expect.values():
            assert text in message, message

    data.write_text('{"text": "1 - 1 = 9"}\n')  # same size
    refused(data=f"data file {data} (data.path): content changed")
    data.write_text('{"text": "1 - 1 = 0, 2 - 1 = 1"}\n')
    refused(data=f"data file {data} (data.path): size changed (22 -> 33 bytes)")
    data.write_text('{"text": "1 - 1 = 0"}\n')
    fake_base(base, 2.0)  # another training of the same shapes: the header is byte-identical
    refused(base=f"the base at {base}: the tensor data of shard model.safetensors changed")
    fake_base(base, 1.0)
    (base / "config.json").write_text(json.dumps({"model_type": "moe_plugin", "hidden_size": 16}))
    refused(base=f"the base at {base}: its config.json changed")
    preset = {"model": {"preset": "tiny", "overrides": {}}, "data": {"kind": "arithmetic"}}
    with pytest.raises(
        ValueError,
        match="the base: was preset 'tiny' with overrides {}, now preset 'tiny' with overrides {\"num_experts\": 4}",
    ):
        check_inputs(
            fingerprint_inputs(preset, None),
            fingerprint_inputs({**preset, "model": {"preset": "tiny", "overrides": {"num_experts": 4}}}, None),
            override_flag="--x",
        )


def test_the_inputs_record_is_read_or_named(tmp_path):
    assert read_recorded_inputs(str(tmp_path)) is None  # a run from before records existed
    (tmp_path / RECORD).write_text('{"format": 1,\n "base": ')
    with pytest.raises(ValueError, match=rf"^{tmp_path / RECORD}, line 2: not valid JSON"):
        read_recorded_inputs(str(tmp_path))
    (tmp_path / RECORD).write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"^{tmp_path / RECORD}: not a record of inputs"):
        read_recorded_inputs(str(tmp_path))
