"""A checkpoint resumes at another layout (docs/training.md, "Resume anywhere"): written at EP 2 x ZeRO-3 on 4
processes after step 2, resumed on 2 processes at EP 1 and on 1 process; and written on 1 process, resumed on 4
at EP 2; and across engines: ZeRO-3 (4 processes, EP 2) -> FSDP2 (2 processes, EP 1) -> ZeRO-3 (2 processes,
EP 2). Each resumed run's losses equal the uninterrupted one-process run's (the layouts equal one process to
fp32 rounding), its final adapter agrees within the Adam bound, and it says in one line what changed."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin.testing.launch import run_distributed
from tests.tolerances import check_final_adapters
from tests.training.test_trainer import LR, _recipe

WORKER = "tests/training/resume_anywhere_workers.py:run"
STEPS = 4


def _at(tmp, name: str, world: int, ep: int, steps: int = STEPS, backend: str = "megatron", **schedule) -> dict:
    recipe = _recipe(tmp / name, world, ep, steps=steps, backend=backend, **{"warmup_steps": 1, **schedule})
    recipe["checkpoint"]["every"] = 2
    return recipe


def _full(recipe: dict) -> dict:
    """The recipe training every parameter (``"lora": null``): experts, router, attention, embeddings. At a tenth
    of the adapters' learning rate: with every weight of the tiny model moving by 2e-2 a step, the uninterrupted
    4-process EP 2 run itself is 4.3e-5 from one process at step 4 (1e-7 to 7e-7 before; measured), so there the
    comparison would be of fp32 rounding grown by the steps, not of what the resume restored."""
    return dict(recipe, lora=None, schedule={**recipe["schedule"], "lr": LR / 10})


def _moved(recipe: dict, tmp, name: str, world: int, ep: int) -> dict:
    """``recipe``'s output_dir copied to ``name``, and the recipe for it at ``world`` processes, EP ``ep``."""
    shutil.copytree(recipe["output_dir"], tmp / name)
    moved = _at(tmp, name, world, ep, backend=recipe["parallel"]["backend"])
    return moved if recipe.get("lora") is not None else _full(moved)


def _under_fsdp2(recipe: dict) -> dict:
    return dict(recipe, deepspeed=None, parallel={**recipe["parallel"], "sharding": "fsdp2"})


def _adapter(recipe: dict) -> dict:
    return load_file(f"{recipe['output_dir']}/adapter/adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    whole, written1 = _at(tmp, "whole-w1", 1, 1), _at(tmp, "written-w1", 1, 1)
    # a constant schedule: a finished 2-step run, raised to 4 steps, equals one 4-step run
    constant, finished = (
        _at(tmp, name, 1, 1, steps=n, decay="constant") for name, n in (("constant", 4), ("finished", 2))
    )
    longer = dict(copy.deepcopy(finished), schedule={**finished["schedule"], "steps": 4})
    one = run_distributed(
        WORKER,
        world_size=1,
        timeout_s=900,
        calls=[
            {"kind": "train", "recipe": whole},
            {"kind": "stop", "recipe": written1, "steps": 2},
            {"kind": "train", "recipe": constant},
            {"kind": "train", "recipe": finished},
            {"kind": "train", "recipe": longer},
            {"kind": "train", "recipe": _full(_at(tmp, "full-w1", 1, 1))},
            {"kind": "train", "recipe": _at(tmp, "hf-w1", 1, 1, backend="hf")},
        ],
    )[0]
    written4, damaged4 = _at(tmp, "written-w4", 4, 2), _at(tmp, "damaged-w4", 4, 2)
    full4, hf4 = _full(_at(tmp, "full-w4", 4, 2)), _at(tmp, "hf-w4", 4, 2, backend="hf")
    from_one = _moved(written1, tmp, "from-w1-on-w4", 4, 2)
    four = run_distributed(
        WORKER,
        world_size=4,
        timeout_s=1200,
        calls=[
            {"kind": "stop", "recipe": written4, "steps": 2},
            {"kind": "train", "recipe": from_one},
            {"kind": "stop", "recipe": damaged4, "steps": 4, "saves": [2, 4]},
            {"kind": "stop", "recipe": full4, "steps": 2},
            {"kind": "stop", "recipe": hf4, "steps": 2},
        ],
    )[0]
    on_two = _moved(written4, tmp, "from-w4-on-w2", 2, 1)
    truncated = _moved(damaged4, tmp, "damaged-w4-on-w2", 2, 1)
    # across engines: step 3 under FSDP2 from ZeRO-3's step 2, then step 4 under ZeRO-3 from FSDP2's step 3
    chain_fsdp2 = _under_fsdp2(_moved(written4, tmp, "chain", 2, 1))
    chain_zero3 = _at(tmp, "chain", 2, 2)
    cut = next((tmp / "damaged-w4-on-w2" / "checkpoints" / "step-00000004" / "engine").glob("zero_pp_rank_1_*optim*"))
    cut.write_bytes(cut.read_bytes()[:100])  # one rank's file of the newest checkpoint, cut short
    full_on_two = _moved(full4, tmp, "full-w4-on-w2", 2, 1)
    two = run_distributed(
        WORKER,
        world_size=2,
        timeout_s=900,
        calls=[
            {"kind": "train", "recipe": on_two},
            {"kind": "train", "recipe": truncated},
            {"kind": "train", "recipe": full_on_two},
            {"kind": "stop", "recipe": chain_fsdp2, "steps": 1},
            {"kind": "train", "recipe": chain_zero3},
        ],
    )[0]
    on_one, hf_on_one = _moved(written4, tmp, "from-w4-on-w1", 1, 1), _moved(hf4, tmp, "hf-w4-on-w1", 1, 1)
    one_b = run_distributed(
        WORKER,
        world_size=1,
        timeout_s=900,
        calls=[{"kind": "train", "recipe": on_one}, {"kind": "train", "recipe": hf_on_one}],
    )[0]
    resumed = {
        "4 processes EP 2 -> 2 processes EP 1": (two[0], on_two, "4 processes EP 2 on 2 processes EP 1"),
        "4 processes EP 2 -> 1 process": (one_b[0], on_one, "4 processes EP 2 on 1 process EP 1"),
        "1 process -> 4 processes EP 2": (four[1], from_one, "1 process EP 1 on 4 processes EP 2"),
    }
    return {
        "whole": (one[0], whole),
        "written4": four[0],
        "resumed": resumed,
        "truncated": (two[1], cut),
        "longer": (one[2], one[3], one[4]),
        "full": (one[5], two[2]),
        "hf": (one[6], one_b[1]),
        "chain": (two[3], two[4], chain_zero3),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    "which", ["4 processes EP 2 -> 2 processes EP 1", "4 processes EP 2 -> 1 process", "1 process -> 4 processes EP 2"]
)
@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_layout(runs, which):
    whole, whole_recipe = runs["whole"]
    got, recipe, change = runs["resumed"][which]
    assert whole["resumed_from"] is None and got["resumed_from"] == 2
    assert len(got["losses"]) == len(whole["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(whole["losses"], got["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), (which, step, a, b)
    assert f"resuming step 2 written at {change}" in got["printed"], got["printed"][-2000:]
    failures = check_final_adapters(_adapter(whole_recipe), _adapter(recipe), steps=STEPS, lr=LR)
    assert not failures, failures[:8]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_zero3_run_resumes_under_fsdp2_and_back(runs):
    """ZeRO-3 on 4 processes at EP 2 stops after step 2; FSDP2 on 2 processes at EP 1 resumes from its layout-free
    state, trains step 3 and saves (FSDP2's checkpoint is that state alone); ZeRO-3 on 2 processes at EP 2
    resumes from it and finishes. Every loss is the uninterrupted run's, the final adapter within the Adam bound."""
    whole, whole_recipe = runs["whole"]
    under_fsdp2, back, recipe = runs["chain"]
    assert len(under_fsdp2["losses"]) == 3 and back["resumed_from"] == 3 and len(back["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(whole["losses"], back["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b)
    assert under_fsdp2["losses"] == back["losses"][:3]
    assert "resuming step 3 written at 2 processes EP 1 under fsdp2 on 2 processes EP 2 under zero3" in back["printed"]
    step3 = f"{recipe['output_dir']}/checkpoints/step-00000003"
    with open(f"{step3}/trainable.json") as f:
        assert json.load(f)["sharding"] == "fsdp2"
    assert not os.path.exists(f"{step3}/engine")  # no DeepSpeed files: the layout-free state is all
    failures = check_final_adapters(_adapter(whole_recipe), _adapter(recipe), steps=STEPS, lr=LR)
    assert not failures, failures[:8]


@pytest.mark.distributed
def test_the_layout_free_state_names_every_adapter_with_its_moments_whole(runs):
    """What the checkpoint holds: every trainable tensor, expert adapters over all experts, with its moments."""
    _, whole_recipe = runs["whole"]
    tmp_one = whole_recipe["output_dir"].replace("whole-w1", "written-w1")
    tmp_four = whole_recipe["output_dir"].replace("whole-w1", "written-w4")
    one = load_file(f"{tmp_one}/checkpoints/step-00000002/trainable.safetensors")
    four = load_file(f"{tmp_four}/checkpoints/step-00000002/trainable.safetensors")
    assert sorted(one) == sorted(four) and any(":exp_avg_sq" in k for k in one)
    for name in one:
        assert one[name].shape == four[name].shape, name  # whole at EP 2 too: the expert adapters all-gathered
    with open(f"{tmp_four}/checkpoints/step-00000002/trainable.json") as f:
        meta = json.load(f)
    assert (
        meta["layout"] == {"world": 4, "expert": 2, "context": 1, "data": 4, "global_batch": 4}
        and meta["adam_step"] == 2
    )


@pytest.mark.distributed
def test_a_resume_that_changes_the_global_batch_is_refused_naming_the_field(runs, tmp_path):
    """Refused in the claim, before the model is built: the checkpoint's global batch is 4 rows."""
    _, whole_recipe = runs["whole"]
    recipe = copy.deepcopy(_at(tmp_path, "x", 1, 1))
    shutil.copytree(whole_recipe["output_dir"].replace("whole-w1", "written-w1"), recipe["output_dir"])
    recipe["schedule"]["micro_batch_size"] = 2
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import train

    with pytest.raises(
        ValueError,
        match=r"output_dir: schedule\.micro_batch_size x schedule\."
        r"gradient_accumulation_steps x 1 data-parallel ranks is 2 rows a step, but "
        r"checkpoint step 2 was written with 4 \(1 processes\)",
    ):
        train(recipe_from_dict(recipe))


@pytest.mark.distributed
def test_a_damaged_newest_checkpoint_is_skipped_and_the_previous_one_resumes(runs):
    """Written at 4 processes EP 2 with checkpoints at steps 2 and 4; rank 1's optimizer file of step 4 cut short;
    on 2 processes: step 4 is named and skipped (kept as it is), step 2 resumes, and the run equals the
    uninterrupted one."""
    whole, _ = runs["whole"]
    got, cut = runs["truncated"]
    assert got["resumed_from"] == 2, got["printed"][-2000:]
    assert f"warning: {cut} is 100 bytes, its COMPLETE marker lists" in got["printed"]
    for a, b in zip(whole["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)
    kept = [p.name for p in cut.parents[2].iterdir()]
    assert ".damaged-step-00000004" in kept  # the new step 4 set the damaged one aside, never removed it


@pytest.mark.distributed
def test_raising_the_steps_continues_a_finished_run_as_one_longer_run(runs):
    constant, finished, longer = runs["longer"]
    assert finished["resumed_from"] is None and len(finished["losses"]) == 2
    assert longer["resumed_from"] == 2 and longer["losses"] == constant["losses"]  # bitwise: the same layout


def test_an_earlier_versions_checkpoint_is_refused_at_another_layout(tmp_path):
    """A checkpoint with DeepSpeed's files only (no trainable.json) resumes at the layout that wrote it only."""
    from moe_plugin.training.run_dir import check_resume_layout

    step = tmp_path / "step-00000002"
    step.mkdir()
    (step / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 4, "files": {}}))
    stored = {"parallel": {"expert_parallel_size": 2}}
    same = {
        "parallel": {"expert_parallel_size": 2},
        "schedule": {"micro_batch_size": 1, "gradient_accumulation_steps": 1},
    }
    check_resume_layout(same, (2, str(step)), 4, stored)
    other = copy.deepcopy(same)
    other["parallel"]["expert_parallel_size"] = 1
    with pytest.raises(
        ValueError,
        match=rf"^output_dir: {step} was written by an earlier version of moe_plugin on 4 "
        r"processes at parallel\.expert_parallel_size 2, and holds no layout-free "
        r"state; resume it on 4 processes with parallel\.expert_parallel_size 2",
    ):
        check_resume_layout(other, (2, str(step)), 2, stored)


@pytest.mark.distributed
def test_export_step_reads_the_layout_free_state_as_it_read_deepspeeds_files(runs, tmp_path):
    """``adapter_from_checkpoint`` of the EP 2 checkpoint: from trainable.safetensors, and (as for a checkpoint of
    an earlier version) from DeepSpeed's per-rank files once those are removed: the same tensors."""
    from moe_plugin.export.zero_checkpoint import adapter_from_checkpoint
    from moe_plugin.models import preset_config

    _, whole_recipe = runs["whole"]
    run = tmp_path / "run"
    shutil.copytree(whole_recipe["output_dir"].replace("whole-w1", "written-w4"), run)
    config = preset_config("tiny", attn_res=False).to_model_config()
    new = adapter_from_checkpoint(str(run), 2, config, "megatron", 4)
    for name in ("trainable.safetensors", "trainable.json"):
        (run / "checkpoints" / "step-00000002" / name).unlink()
    old = adapter_from_checkpoint(str(run), 2, config, "megatron", 4)
    assert sorted(new) == sorted(old) and any("experts" in k for k in new)
    for name in new:
        assert new[name].shape == old[name].shape and torch.equal(new[name], old[name]), name


@pytest.mark.distributed
def test_full_training_resumes_at_another_layout(runs):
    """``"lora": null`` at EP 2 x ZeRO-3 on 4 processes after step 2, resumed on 2 processes at EP 1: every
    trainable parameter (the expert stacks all-gathered over EP) and its moments resharded."""
    whole, got = runs["full"]
    assert got["resumed_from"] == 2 and len(got["losses"]) == len(whole["losses"]) == STEPS
    for a, b in zip(whole["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (whole["losses"], got["losses"])


@pytest.mark.distributed
def test_the_hugging_face_backend_resumes_at_another_layout(runs):
    """The recipe's hf backend at EP 2 x ZeRO-3 on 4 processes (expert parallelism applied from outside the
    Hugging Face model) after step 2, resumed on 1 process without expert parallelism."""
    whole, got = runs["hf"]
    assert got["resumed_from"] == 2 and "written at 4 processes EP 2 on 1 process EP 1" in got["printed"]
    for a, b in zip(whole["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (whole["losses"], got["losses"])
