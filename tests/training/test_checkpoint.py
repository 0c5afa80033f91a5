"""CheckpointManager: complete checkpoints only, pruned to ``keep``; a failure on any rank raises on every rank;
a SIGKILL at any moment (rank 1 while writing, rank 0 at each publishing step) leaves the previous checkpoint
as latest() with byte-identical files, and clean_leftovers() removes the debris."""

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from moe_plugin.testing.launch import run_distributed
from moe_plugin.training.checkpoint import COMPLETE, CheckpointManager, step_name

WORKERS = Path(__file__).with_name("checkpoint_workers.py")


def _manager(root, keep=2, **kwargs) -> CheckpointManager:
    return CheckpointManager(root, rank=0, world_size=1, barrier=lambda: None, keep=keep, **kwargs)


def _writer(step: int, files=("model.pt", "trainer_state.json")):
    def write(staging):
        for i, name in enumerate(files):
            Path(staging, name).write_bytes(f"{name} of step {step}".encode() * (i + 1))

    return write


def _digests(directory) -> dict:
    """``{relative path: sha256}`` of every file under ``directory``: an independent view of its bytes."""
    out = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            out[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def test_save_latest_and_pruning_to_keep(tmp_path):
    manager = _manager(tmp_path / "checkpoints", keep=2)
    assert manager.latest() is None
    paths = [manager.save(step, _writer(step)) for step in (10, 20, 30)]
    assert paths == [str(tmp_path / "checkpoints" / step_name(s)) for s in (10, 20, 30)]
    assert manager.latest() == (30, paths[2])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000020", "step-00000030"]
    marker = json.loads(Path(paths[2], COMPLETE).read_text())
    on_disk = {name: os.path.getsize(os.path.join(paths[2], name)) for name in os.listdir(paths[2]) if name != COMPLETE}
    assert marker == {"step": 30, "world_size": 1, "files": on_disk}
    assert set(on_disk) == {"model.pt", "trainer_state.json", "rank0.done"}
    assert Path(paths[2], "model.pt").read_bytes() == b"model.pt of step 30"
    one = _manager(tmp_path / "one", keep=1)
    for step in (1, 2, 3):
        one.save(step, _writer(step))
    assert os.listdir(tmp_path / "one") == ["step-00000003"]


def test_corrupted_and_partial_checkpoints_are_not_latest_and_are_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    manager = _manager(root, keep=5)
    for step in (10, 20, 30, 40):
        manager.save(step, _writer(step))
    good = _digests(root / "step-00000010")
    os.remove(root / "step-00000040" / COMPLETE)  # never completed
    (root / "step-00000030" / "model.pt").write_bytes(b"truncated")  # another size than the marker lists
    os.remove(root / "step-00000020" / "trainer_state.json")  # a listed file is missing
    (root / "step-00000050").mkdir()
    (root / "step-00000050" / COMPLETE).write_text("{not json")
    (root / ".staging-step-00000060" / "sub").mkdir(parents=True)
    (root / ".pruning-step-00000005").mkdir()
    foreign = ["notes.txt", "step-latest", ".staging-mine", "step-00000070.bak"]
    for name in foreign:
        (root / name).write_text("not ours")
    (tmp_path / "step-00000099").mkdir()  # outside root: never looked at
    assert manager.latest() == (10, str(root / "step-00000010"))
    removed = manager.clean_leftovers()
    # what killed saves leave goes; a checkpoint changed after it was saved (its marker no longer matches, or
    # cannot be read) stays as it is: it is skipped, never removed
    assert removed == sorted(
        str(root / n) for n in ("step-00000040", ".staging-step-00000060", ".pruning-step-00000005")
    )
    damaged = ["step-00000020", "step-00000030", "step-00000050"]
    assert sorted(os.listdir(root)) == sorted(foreign + ["step-00000010"] + damaged)
    assert [p.split("/")[-2] for p in manager.damaged()] == damaged[::-1]
    assert (tmp_path / "step-00000099").is_dir()
    assert _digests(root / "step-00000010") == good
    assert manager.clean_leftovers() == []
    other_rank = CheckpointManager(root, rank=1, world_size=2, barrier=lambda: None, all_ok=lambda ok: ok)
    (root / ".staging-step-00000080").mkdir()
    assert other_rank.clean_leftovers() == [] and (root / ".staging-step-00000080").is_dir()


def test_a_failed_write_raises_and_leaves_the_previous_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    manager = _manager(root)
    manager.save(1, _writer(1))
    before = _digests(root)

    def failing(staging):
        _writer(2)(staging)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, failing)
    with pytest.raises(ValueError, match=r"^write: returned '/etc/passwd', which is not a file inside"):
        manager.save(2, lambda staging: ["/etc/passwd"])
    assert _digests(root) == before and os.listdir(root) == ["step-00000001"], "no staging directory is left"
    assert manager.latest() == (1, str(root / "step-00000001"))


def test_a_step_not_after_the_latest_is_refused(tmp_path):
    manager = _manager(tmp_path)
    manager.save(5, _writer(5))
    for step in (5, 3):
        with pytest.raises(ValueError, match=rf"^step: .*step-00000005, not older than step {step}.*save a later"):
            manager.save(step, _writer(step))
    with pytest.raises(ValueError, match=r"^step: must be a non-negative integer, got -1"):
        manager.save(-1, _writer(0))
    assert os.listdir(tmp_path) == ["step-00000005"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"rank": 2, "world_size": 2, "all_ok": bool}, r"CheckpointManager\.rank"),
        ({"rank": 0, "world_size": 0}, r"CheckpointManager\.world_size"),
        ({"rank": 0, "world_size": 1, "keep": 0}, r"CheckpointManager\.keep"),
        ({"rank": 0, "world_size": 2}, r"CheckpointManager\.all_ok: world_size is 2 but torch.distributed"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        CheckpointManager(tmp_path, barrier=lambda: None, **kwargs)


# Where rank 0 dies: (description, os function, hook on (src, dst) -> True to die, before or after the call,
# the step latest() returns afterwards, the names clean_leftovers() removes). The save is of step 30 over
# step-10 and step-20 with keep=2.
KILL_POINTS = [
    ("while writing", None, None, None, 20, [".staging-step-00000030"]),
    ("after writing COMPLETE", "replace", lambda s, d: d.endswith(COMPLETE), "after", 20, [".staging-step-00000030"]),
    (
        "before the publishing rename",
        "rename",
        lambda s, d: d.endswith("step-00000030"),
        "before",
        20,
        [".staging-step-00000030"],
    ),
    ("after the publishing rename", "rename", lambda s, d: d.endswith("step-00000030"), "after", 30, []),
    ("while pruning", "rename", lambda s, d: ".pruning-" in d, "after", 30, [".pruning-step-00000010"]),
]


@pytest.mark.parametrize("point", KILL_POINTS, ids=[p[0] for p in KILL_POINTS])
def test_sigkill_of_rank_0_at_each_step_of_a_save(tmp_path, point):
    description, function, dies_at, when, latest_step, debris = point
    root = tmp_path / "checkpoints"
    manager = _manager(root)
    manager.save(10, _writer(10))
    manager.save(20, _writer(20))
    previous = _digests(root / "step-00000020")
    pid = os.fork()  # a real SIGKILL of a saving process, without the seconds of starting a new one
    if pid == 0:
        try:
            if function is not None:
                real = getattr(os, function)

                def hooked(src, dst, *args, **kwargs):
                    die = dies_at(os.fspath(src), os.fspath(dst))
                    if die and when == "before":
                        os.kill(os.getpid(), signal.SIGKILL)
                    real(src, dst, *args, **kwargs)
                    if die:
                        os.kill(os.getpid(), signal.SIGKILL)

                setattr(os, function, hooked)

            def write(staging):
                _writer(30)(staging)
                if function is None:
                    os.kill(os.getpid(), signal.SIGKILL)

            manager.save(30, write)
        finally:
            os._exit(3)  # reached only if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"killed {description}"
    assert manager.latest() == (latest_step, str(root / step_name(latest_step)))
    assert _digests(root / "step-00000020") == previous
    assert manager.clean_leftovers() == [str(root / name) for name in debris]
    manager.save(40, _writer(40))  # the next save works and prunes to keep
    assert sorted(os.listdir(root)) == [step_name(latest_step), "step-00000040"]


def _shard(directory, rank):
    return torch.load(os.path.join(directory, "global_step", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


@pytest.mark.distributed
def test_two_ranks_save_into_one_directory_and_a_failure_raises_on_both(tmp_path):
    root = tmp_path / "checkpoints"
    results = run_distributed(
        f"{WORKERS}:save_twice_then_fail", world_size=2, timeout_s=240, init_process_group=True, root=str(root)
    )
    paths = [str(root / "step-00000010"), str(root / "step-00000020")]
    assert [r["paths"] for r in results] == [paths, paths]
    staging = [str(root / f".staging-step-000000{s}") for s in (10, 20, 30)]
    assert [r["staging_seen"] for r in results] == [staging, staging], "every rank writes into the same directory"
    for path, step in zip(paths, (10, 20)):
        marker = json.loads(Path(path, COMPLETE).read_text())
        expected = {os.path.join("global_step", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)}
        expected |= {"trainer_state.json", "rank0.done", "rank1.done"}
        assert marker["step"] == step and marker["world_size"] == 2 and set(marker["files"]) == expected
        assert all(os.path.getsize(os.path.join(path, f)) == size for f, size in marker["files"].items())
        for rank in (0, 1):
            shard = _shard(path, rank)
            assert shard["step"] == step
            assert torch.equal(shard["values"], torch.arange(8, dtype=torch.float32) + 100 * step + rank)
    assert results[1]["failure"] == "OSError: disk full on rank 1"
    assert results[0]["failure"].startswith(
        "RuntimeError: checkpoint step-00000030: writing failed: another "
        "rank failed while writing; no checkpoint was published"
    )
    assert [r["latest"] for r in results] == [(20, paths[1])] * 2
    assert sorted(os.listdir(root)) == ["step-00000010", "step-00000020"], "the failed save's staging is gone"


@pytest.mark.distributed
def test_rank_1_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    previous = CheckpointManager(root, rank=0, world_size=1, barrier=lambda: None)
    previous.save(20, _writer(20))
    before = _digests(root / "step-00000020")
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code -9"):
        run_distributed(f"{WORKERS}:save_and_die", world_size=2, timeout_s=240, init_process_group=True, root=str(root))
    assert (root / ".staging-step-00000030" / "global_step").is_dir(), "the killed save got as far as writing"
    assert previous.latest() == (20, str(root / "step-00000020"))
    assert _digests(root / "step-00000020") == before
    assert previous.clean_leftovers() == [str(root / ".staging-step-00000030")]
    assert os.listdir(root) == ["step-00000020"]
