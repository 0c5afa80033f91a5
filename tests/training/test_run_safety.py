"""A run that never unpickles, knows its inputs, stops on divergence and never harms its outputs: one-process runs in
this process (one shared trained run, copied per case). The pieces one by one, and the 2-process ZeRO-3 files, are
in ``test_run_files_safety.py``; the guards and the inputs record in ``test_guards_and_inputs.py``."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from moe_plugin.training.checkpoint import CheckpointManager
from moe_plugin.training.guards import DivergenceSection, StepGuard, TrainingStopped
from moe_plugin.training.inputs import RECORD, read_recorded_inputs
from moe_plugin.training.run_dir import MARKER
from tests.recipes import minimal
from tests.training.run_safety_workers import digests, plant, save_base


def _recipe(tmp: Path, name: str, **schedule) -> dict:
    return minimal(
        tmp / name,
        base=tmp / "base",
        seed=2,
        lora={"r": 2, "alpha": 4, "target_modules": ["q_proj"]},
        data={"kind": "text", "path": str(tmp / "train.jsonl"), "seq_len": 32, "eval_fraction": 0.0},
        parallel={"backend": "hf"},
        schedule={"steps": 2, "micro_batch_size": 1, "lr": 1e-3, **schedule},
        checkpoint={"every": 1, "keep": 3},
        logging={"wandb": {"mode": "disabled"}},
    )


def _train(recipe: dict, **kwargs):
    from moe_plugin.training.loop import train
    from moe_plugin.recipe.schema import recipe_from_dict

    return train(recipe_from_dict(copy.deepcopy(recipe)), **kwargs)


def _refused(recipe: dict, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        _train(recipe, **kwargs)
    assert "\n" not in str(caught.value), str(caught.value)
    return str(caught.value)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """A 2-step run with a checkpoint per step, its inputs, and a fresh temporary directory for all runs."""
    tmp = tmp_path_factory.mktemp("safety")
    save_base(tmp / "base", 1)
    (tmp / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"{a} - {b} = {a - b}"}) + "\n" for a in range(20) for b in range(5))
    )
    (tmp / "tmp").mkdir()
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(tmp / "tmp"), str(tmp / "tmp")
    try:
        result = _train(_recipe(tmp, "run"))
        yield tmp, result
    finally:
        tempfile.tempdir = saved[1]
        if saved[0] is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = saved[0]
    assert [e for e in os.listdir(tmp / "tmp") if e.startswith("moe_plugin_")] == [], "a rendezvous was left"


def _copy(tmp: Path, name: str, **schedule) -> dict:
    """The shared run copied to ``name``, its marker as if it had run there."""
    shutil.copytree(tmp / "run", tmp / name)
    marker = json.loads((tmp / name / MARKER).read_text())
    marker["output_dir"] = str(tmp / name)
    (tmp / name / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return _recipe(tmp, name, **schedule)


def test_the_run_leaves_no_rendezvous_folder_and_records_its_inputs(one):
    tmp, result = one
    assert len(result.losses) == 2 and [e for e in os.listdir(tmp / "tmp") if e.startswith("moe_plugin_")] == []
    record = read_recorded_inputs(str(tmp / "run"))
    assert record["base"]["path"] == str((tmp / "base").resolve())
    assert record["data"]["data.path"]["path"] == str(tmp / "train.jsonl")
    checkpoint = tmp / "run" / "checkpoints" / "step-00000002"
    assert not list(checkpoint.glob("*.pt")) and (checkpoint / "trainer_state_rank0.json").is_file()


def test_a_changed_data_file_is_refused_then_accepted_with_the_override(one):
    tmp, _ = one
    recipe, data = _copy(tmp, "data", steps=3), tmp / "train.jsonl"
    original = data.read_text()
    try:
        data.write_text(original.replace("0 - 0 = 0", "0 - 0 = 9"))
        message = _refused(recipe)
        assert message.startswith(
            f"data file {data} (data.path): content changed (sha256 differs) since the run recorded"
        )
        assert "--allow-changed-inputs" in message and not (tmp / "data" / "checkpoints" / "step-00000003").exists()
        result = _train(recipe, allow_changed_inputs=True)
        assert result.resumed_from == 2 and len(result.losses) == 3
    finally:
        data.write_text(original)


def test_a_replaced_base_is_refused_then_accepted_with_the_override(one):
    tmp, _ = one
    recipe = _copy(tmp, "base_changed")
    shutil.move(tmp / "base", tmp / "base.orig")
    try:
        save_base(tmp / "base", 7)  # the same model trained otherwise, at the same path
        message = _refused(recipe)
        assert message.startswith(
            f"the base at {(tmp / 'base').resolve()}: the tensor data of shard model.safetensors changed"
        )
        assert _train(recipe, allow_changed_inputs=True).resumed_from == 2
    finally:
        shutil.rmtree(tmp / "base")
        shutil.move(tmp / "base.orig", tmp / "base")


def test_payloads_in_the_engine_file_and_an_old_trainer_state_do_not_run(one):
    tmp, _ = one
    for name, relative in (
        ("engine_payload", "engine/mp_rank_00_model_states.pt"),
        ("state_payload", "trainer_state_rank0.pt"),
    ):
        recipe = _copy(tmp, name)
        checkpoint = tmp / name / "checkpoints" / "step-00000002"
        if relative.startswith("trainer"):  # the layout of an earlier version: no JSON state beside it
            os.remove(checkpoint / "trainer_state_rank0.json")
            marker = json.loads((checkpoint / "COMPLETE").read_text())
            del marker["files"]["trainer_state_rank0.json"]
            (checkpoint / "COMPLETE").write_text(json.dumps(marker))
        plant(str(checkpoint), relative, str(tmp / f"{name}.sentinel"))
        assert _refused(recipe).startswith(f"{checkpoint / relative}: not a ")
        assert not (tmp / f"{name}.sentinel").exists()


def test_a_truncated_engine_file_is_named(one, capsys):
    tmp, _ = one
    recipe = _copy(tmp, "truncated")
    checkpoint = tmp / "truncated" / "checkpoints" / "step-00000002"
    engine = checkpoint / "engine" / "mp_rank_00_model_states.pt"
    engine.write_bytes(engine.read_bytes()[:1000])  # the marker still lists the full size
    # named and skipped (kept as it is); the newest complete checkpoint, step 1, is older than the run's
    # outputs, so starting it again would train over them: refused
    message = _refused(recipe)
    assert message.startswith(f"output_dir: '{tmp / 'truncated'}' holds the outputs of a finished run"), message
    assert "its newest usable checkpoint is step 1" in message
    assert f"warning: {engine} is 1000 bytes, its COMPLETE marker lists " in capsys.readouterr().err
    assert checkpoint.is_dir() and engine.stat().st_size == 1000
    plant(str(checkpoint), "engine/mp_rank_00_model_states.pt", str(tmp / "unused"))  # marker now agrees
    engine.write_bytes(engine.read_bytes()[:200])
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["files"]["engine/mp_rank_00_model_states.pt"] = 200
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    assert _refused(recipe).startswith(f"{engine}: not a DeepSpeed checkpoint file that loads without running code")


def test_a_finished_run_without_markers_is_refused_and_untouched(one):
    tmp, _ = one
    recipe = _copy(tmp, "finished")
    for marker in (tmp / "finished" / "checkpoints").glob("*/COMPLETE"):
        os.remove(marker)
    before = digests(tmp / "finished")
    message = _refused(recipe)
    assert message.startswith(
        f"output_dir: '{tmp / 'finished'}' holds the outputs of a finished run "
        f"({tmp / 'finished' / 'adapter'}, {tmp / 'finished' / 'losses.json'}, 2 steps)"
    )
    assert digests(tmp / "finished") == before
    rerun = _copy(tmp, "finished_ok")  # with its checkpoints: started again, it rewrites nothing
    before = digests(tmp / "finished_ok")
    assert _train(rerun).resumed_from == 2 and digests(tmp / "finished_ok") == before


def test_a_nan_step_stops_before_saving_or_writing_the_adapter(one):
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    tmp, _ = one
    with Trainer(recipe_from_dict(_recipe(tmp, "nan", steps=3))) as trainer:
        head = [m for n, m in trainer.engine.module.named_modules() if n.endswith("lm_head")][0]
        # data-independent: the second step's logits are poisoned
        head.register_forward_hook(lambda m, i, out: out * float("nan") if trainer.step == 1 else out)
        with pytest.raises(TrainingStopped, match=r"^step 2: the loss is nan.*newest checkpoint is step 1's"):
            trainer.run()
    assert sorted(os.listdir(tmp / "nan" / "checkpoints")) == ["step-00000001"]
    assert not (tmp / "nan" / "adapter").exists() and not (tmp / "nan" / "results.json").exists()
    assert CheckpointManager(tmp / "nan" / "checkpoints", 0, 1, lambda: None).latest()[0] == 1


def test_lr_1e6_warns_and_stops_on_divergence(one, capsys):
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    tmp, _ = one
    recipe = minimal(
        tmp / "lr1e6",
        base="recipes/bases/tiny-arith",
        seed=1,
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "gate"]},
        data={"kind": "arithmetic", "operation": "-", "num_documents": 200, "seq_len": 64},
        parallel={"backend": "hf"},
        schedule={"steps": 30, "micro_batch_size": 2, "lr": 1e6, "decay": "constant"},
        logging={"every": 100, "wandb": {"mode": "disabled"}},
    )
    cwd = os.getcwd()
    os.chdir(Path(__file__).parents[2])  # the recipe's base path is relative to the repository
    try:
        with Trainer(recipe_from_dict(recipe)) as trainer:
            trainer.guard = StepGuard(DivergenceSection(window=3, stop_after=2), trainer.logger.message)
            with pytest.raises(TrainingStopped, match=r"^step 6: the loss diverged: .* for 3 steps in a row"):
                trainer.run()
            assert max(trainer.result.grad_norms[2:]) < 1e-3, "the norm collapses: a NaN check would not fire"
    finally:
        os.chdir(cwd)
    assert "warning: step 4: the loss is diverging" in capsys.readouterr().out
    assert not (tmp / "lr1e6" / "adapter").exists()


def test_a_failed_first_start_leaves_output_dir_reusable(one):
    tmp, _ = one
    broken = tmp / "broken_base"
    shutil.copytree(tmp / "base", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    recipe = _recipe(tmp, "first_start", steps=1)
    with pytest.raises(ValueError, match="damaged safetensors file"):  # the cut-short base is refused
        _train({**recipe, "model": {"from_pretrained": str(broken)}})
    assert sorted(os.listdir(tmp / "first_start")) == sorted([".lock", MARKER, RECORD])
    assert len(_train(recipe).losses) == 1  # the corrected recipe (another base) claims it
    bad_data = tmp / "bad.jsonl"
    bad_data.write_text("{not json\n")
    with pytest.raises(ValueError):
        _train({**_recipe(tmp, "never"), "data": {**recipe["data"], "path": str(bad_data)}})
    assert not (tmp / "never").exists(), "the data is read before output_dir is claimed"


# ---------------------------------------------------------------- 2 processes: ZeRO-3's own files
