"""The run's files, piece by piece: a run directory that never trains over what it should not, DeepSpeed files that
load without running code (also the ZeRO-3 files of a 2-process EP=2 launch with payloads planted), a trainer
state of JSON and safetensors, a changed checkpoint named damaged. The one-process runs are in
``test_run_safety.py``; the guards and the inputs record in ``test_guards_and_inputs.py``."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch

from moe_plugin.compat.deepspeed import load_engine_file, safe_checkpoint_loading
from moe_plugin.training.checkpoint import CheckpointManager
from moe_plugin.training.trainer_state import read_trainer_state, write_trainer_state
from moe_plugin.training.run_dir import MARKER, RunDirectory
from tests.recipes import ZERO3, minimal
from tests.training.run_safety_workers import payload_file

RECIPE = {"output_dir": "out", "model": {"preset": "tiny"}, "data": {"kind": "arithmetic"}, "schedule": {"steps": 3}}


def test_a_run_that_never_trained_is_reusable_by_a_corrected_recipe(tmp_path):
    RunDirectory.claim(str(tmp_path), RECIPE).release()
    (tmp_path / "checkpoints").mkdir()  # a first save that failed leaves it empty
    corrected = {**RECIPE, "data": {"kind": "arithmetic", "seq_len": 64}}
    with RunDirectory.claim(str(tmp_path), corrected) as run:
        assert not run.resumed
    assert json.loads((tmp_path / MARKER).read_text()) == corrected
    (tmp_path / "losses.json").write_text("[2.0]")
    with pytest.raises(ValueError, match=r"^output_dir: .* holds a run of another recipe: data.seq_len differ"):
        RunDirectory.claim(str(tmp_path), RECIPE)


@pytest.mark.parametrize("text,named", [('{\n  "seed": ', "line 2: not valid JSON"), ("[1]", "holds list")])
def test_a_corrupt_marker_is_named(tmp_path, text, named):
    (tmp_path / MARKER).write_text(text)
    with pytest.raises(ValueError, match=rf"^output_dir: {tmp_path / MARKER}(, |: ){named}") as caught:
        RunDirectory.claim(str(tmp_path), RECIPE)
    assert "\n" not in str(caught.value) and (tmp_path / MARKER).read_text() == text


def test_a_finished_run_without_a_usable_checkpoint_is_not_trained_over(tmp_path):
    with RunDirectory.claim(str(tmp_path), RECIPE) as run:
        (tmp_path / "adapter").mkdir()
        (tmp_path / "losses.json").write_text("[3.0, 2.0, 1.0]")
        for latest in (None, 2):
            with pytest.raises(
                ValueError,
                match=rf"^output_dir: .*\({tmp_path}/adapter, {tmp_path}/losses.json, "
                r"3 steps\).*would train over them",
            ):
                run.refuse_overwriting_outputs(latest)
        run.refuse_overwriting_outputs(3)  # its final checkpoint is there: resuming is harmless


def test_deepspeed_files_load_without_running_code(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    sentinel, bad = tmp_path / "sentinel", tmp_path / "engine" / "optim.pt"
    bad.parent.mkdir()
    payload_file(bad, sentinel)
    good = tmp_path / "good.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(3), "t": torch.ones(2)}, str(good))
    original = TorchCheckpointEngine.load
    with safe_checkpoint_loading():
        loaded = TorchCheckpointEngine().load(str(good))
        assert loaded["zero_stage"] == ZeroStageEnum(3) and torch.equal(loaded["t"], torch.ones(2))
        with pytest.raises(
            ValueError,
            match=rf"^{bad}: not a DeepSpeed checkpoint file that loads without running "
            r"code \(Unsupported global: GLOBAL io.open\): it is damaged"
            rf".*remove {tmp_path} to",
        ):
            TorchCheckpointEngine().load(str(bad))
    assert TorchCheckpointEngine.load is original and not sentinel.exists()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"^{truncated}: not a DeepSpeed checkpoint file") as caught:
        load_engine_file(truncated)
    assert "\n" not in str(caught.value)


def test_a_missing_deepspeed_internal_names_the_version(monkeypatch):
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    monkeypatch.delattr(TorchCheckpointEngine, "load")
    with pytest.raises(
        RuntimeError,
        match=rf"^moe_plugin.compat.deepspeed: .*TorchCheckpointEngine.load is missing"
        rf".* in deepspeed {deepspeed.__version__} \(tested with 0.19.8\)",
    ):
        with safe_checkpoint_loading():
            pass


def test_trainer_state_is_json_and_safetensors_and_reads_back_exactly(tmp_path):
    random.seed(5)
    torch.manual_seed(5)
    state = {
        "step": 3,
        "losses": [1 / 3, 2.5e-8, 7.0],
        "data": {"epoch": 0, "index": 4, "num_rows": 9, "seed": 1},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    paths = write_trainer_state(str(tmp_path), 0, state)
    assert sorted(os.path.basename(p) for p in paths) == ["trainer_rng_rank0.safetensors", "trainer_state_rank0.json"]
    back = read_trainer_state(str(tmp_path), 0)
    assert back["losses"] == state["losses"] and back["step"] == 3 and back["data"] == state["data"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["rng"]["python"] == random.getstate()
    Path(paths[0]).write_text('{"format": 1,\n')
    with pytest.raises(ValueError, match=rf"^{paths[0]}, line 2: not valid JSON.*remove {tmp_path}"):
        read_trainer_state(str(tmp_path), 0)
    Path(paths[1]).write_bytes(b"\xff" * 20)
    os.remove(paths[0])
    legacy, sentinel = tmp_path / "trainer_state_rank0.pt", tmp_path / "sentinel"  # an earlier version's file
    payload_file(legacy, sentinel)
    with pytest.raises(ValueError, match=rf"^{legacy}: not a trainer state that loads without running code"):
        read_trainer_state(str(tmp_path), 0)
    assert not sentinel.exists()


def test_a_changed_checkpoint_is_damaged_not_debris(tmp_path):
    manager = CheckpointManager(tmp_path, rank=0, world_size=1, barrier=lambda: None)
    manager.save(1, lambda staging: Path(staging, "engine.pt").write_bytes(b"12345") and None)
    assert manager.damaged() == []
    Path(tmp_path, "step-00000001", "engine.pt").write_bytes(b"123")
    assert manager.damaged() == [f"{tmp_path}/step-00000001/engine.pt is 3 bytes, its COMPLETE marker lists 5"]


@pytest.mark.distributed
def test_payloads_in_zero3_files_do_not_run_and_every_load_is_weights_only(tmp_path):
    from moe_plugin.testing.launch import run_distributed

    recipe = minimal(
        tmp_path / "run",
        seed=5,
        deepspeed=ZERO3,
        lora={"r": 2, "alpha": 4, "target_parameters": ["experts.w1"]},
        data={"num_documents": 100, "seq_len": 32},
        parallel={"backend": "megatron", "expert_parallel_size": 2},
        schedule={"steps": 1, "micro_batch_size": 1, "lr": 1e-2},
        checkpoint={"every": 1},
        logging={"wandb": {"mode": "disabled"}},
    )
    ranks = run_distributed(
        "tests/training/run_safety_workers.py:zero3_cases",
        world_size=2,
        timeout_s=900,
        recipe=recipe,
        sentinel_dir=str(tmp_path),
    )
    for name, relative in ranks[0]["planted"].items():
        planted = str(tmp_path / f"run-{name}" / "checkpoints" / "step-00000001" / relative)
        messages = [r["errors"][name] for r in ranks]
        assert sum(m.startswith(f"ValueError: {planted}: not a DeepSpeed checkpoint file") for m in messages) == 1, (
            messages
        )
        assert all("another rank found a damaged file" in m or planted in m for m in messages)
        assert not (tmp_path / name).exists(), f"the payload in {relative} ran"
    engine = {os.path.join("engine", f) for f in ranks[0]["files"]}
    assert {
        "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "engine/zero_pp_rank_0_mp_rank_00_model_states.pt",
    } <= engine
    loaded = set()
    for r in ranks:
        assert r["resumed_from"] == 1 and len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert all(weights_only is True for _, weights_only in r["loads"]), r["loads"]
        loaded |= {
            os.path.relpath(path, str(tmp_path / "run" / "checkpoints" / "step-00000001")) for path, _ in r["loads"]
        }
    assert engine <= loaded, "every engine file of the checkpoint was read, and only with weights_only=True"
