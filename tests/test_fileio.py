"""Saves are all-or-nothing: a failed or SIGKILLed save never harms the last good checkpoint, a new one leaves
no stale file, and the leftovers of a killed save are removed by the next one."""

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moe_plugin
from moe_plugin import fileio
from moe_plugin.fileio import atomic_directory, resolve_atomic_directory, write_json_atomic
from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint, save_k3_checkpoint


def test_failed_save_keeps_the_previous_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (open(os.path.join(d, "weights.bin"), "w")).write("good")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(target) as d:
            (open(os.path.join(d, "weights.bin"), "w")).write("half")
            raise RuntimeError("disk full")
    assert (target / "weights.bin").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind


def test_new_save_replaces_every_old_file(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        for i in range(3):
            open(os.path.join(d, f"shard-{i}"), "w").write("x")
    with atomic_directory(target) as d:
        open(os.path.join(d, "single"), "w").write("y")
    assert os.listdir(target) == ["single"]


def test_json_write_failure_keeps_old_file(tmp_path):
    path = tmp_path / "config.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["config.json"]


def test_k3_resave_with_fewer_shards_loads_the_new_weights(tmp_path):
    config = moe_plugin.preset_config(
        "tiny", attn_res=False, use_dsa_indexer=False, vision_config=None, image_token_id=None
    )
    torch.manual_seed(0)
    first = MoEPluginForCausalLM(config)
    torch.manual_seed(1)
    second = MoEPluginForCausalLM(config)
    save_k3_checkpoint(first, tmp_path / "k3", max_shard_size=200_000)  # several shards and an index
    save_k3_checkpoint(second, tmp_path / "k3")  # one file: the old index must not survive
    assert not (tmp_path / "k3" / "model.safetensors.index.json").exists()
    loaded = load_k3_checkpoint(tmp_path / "k3")
    for (name, a), b in zip(second.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_weight_map_names_the_path_when_there_is_no_checkpoint(tmp_path):
    from moe_plugin.fileio import safetensors_weight_map

    with pytest.raises(ValueError, match="^path: .* holds neither"):
        safetensors_weight_map(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"^path: .*shard-1\.safetensors"):
        safetensors_weight_map(tmp_path)


# A process that saves ``path`` over and over, each version a different set of files written slowly. It loads
# fileio/atomic.py by its file path: importing the package would import torch and cost seconds per restart.
SAVER = r"""
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("fileio_under_test", sys.argv[1])
fileio = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fileio)
path, started, mode, die_at_swap, first_version = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
if mode == "renames":  # as on a system or file system without an atomic swap
    fileio._exchange = lambda a, b: False
if die_at_swap == "1":  # SIGKILL right after the step that takes the old directory away from path
    real_exchange, real_rename, real_replace = getattr(fileio, "_exchange", None), os.rename, os.replace
    def exchange(a, b):
        swapped = real_exchange(a, b)
        if swapped:
            os.kill(os.getpid(), signal.SIGKILL)
        return swapped
    def moving(real):
        def move(src, dst):
            real(src, dst)
            if os.path.abspath(src) == os.path.abspath(path):
                os.kill(os.getpid(), signal.SIGKILL)
        return move
    fileio._exchange, os.rename, os.replace = exchange, moving(real_rename), moving(real_replace)
open(started, "w").close()
version = first_version
while True:
    with fileio.atomic_directory(path, fsync=False) as d:
        for i in range(5 if version % 2 else 3):  # odd versions have more files: a stale one would show
            with open(os.path.join(d, f"part-{i}"), "w") as f:
                f.write(f"{version}\n" * 100)
            time.sleep(0.002)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(str(version))
    version += 1
"""


def _start_saver(target: Path, started: Path, mode: str, die_at_swap: bool, first_version: int):
    if started.exists():
        started.unlink()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SAVER,
            fileio.atomic.__file__,
            str(target),
            str(started),
            mode,
            "1" if die_at_swap else "0",
            str(first_version),
        ]
    )
    deadline = time.monotonic() + 120  # generous: the machine may be busy
    while not started.exists():
        assert proc.poll() is None, f"the saver exited with {proc.returncode} before starting"
        assert time.monotonic() < deadline, "the saver did not start within 120 s"
        time.sleep(0.005)
    return proc


def _complete_version(target: Path) -> int:
    """The version a directory written by SAVER holds; fails unless every file of exactly one version is there."""
    version = int((target / "manifest.json").read_text())
    expected = {"manifest.json"} | {f"part-{i}" for i in range(5 if version % 2 else 3)}
    assert set(os.listdir(target)) == expected, f"version {version} is incomplete or has stale files"
    for i in range(len(expected) - 1):
        assert (target / f"part-{i}").read_text() == f"{version}\n" * 100
    return version


def _save_version(target: Path, version: int) -> None:
    with atomic_directory(target) as d:
        for i in range(5 if version % 2 else 3):
            (Path(d) / f"part-{i}").write_text(f"{version}\n" * 100)
        (Path(d) / "manifest.json").write_text(str(version))


@pytest.mark.distributed
@pytest.mark.parametrize("mode,kills", [("exchange", 30), ("renames", 20)])
def test_sigkill_at_random_moments_leaves_the_old_or_the_new_complete_directory(tmp_path, mode, kills):
    target, started = tmp_path / "out" / "ckpt", tmp_path / "started"
    _save_version(target, 0)
    rng = random.Random(0)
    seen = 0
    for kill in range(kills):
        proc = _start_saver(target, started, mode, die_at_swap=False, first_version=1000 * (kill + 1))
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        if mode == "renames":  # without an atomic swap a reader must resolve first (the next save does it)
            resolve_atomic_directory(target)
        version = _complete_version(target)  # a reader that just opens path/... finds a whole version
        assert version >= seen, "a kill must never bring back an older version than the one already seen"
        seen = version
    _save_version(target, 1)
    assert os.listdir(target.parent) == ["ckpt"], "the next save removes every leftover of the killed ones"
    assert _complete_version(target) == 1


@pytest.mark.distributed
def test_kill_right_after_the_atomic_swap_keeps_the_new_directory(tmp_path):
    target, started = tmp_path / "ckpt", tmp_path / "started"
    _save_version(target, 2)
    proc = _start_saver(target, started, "exchange", die_at_swap=True, first_version=3)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert _complete_version(target) == 3
    leftover = [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.saving-")]
    assert len(leftover) == 1, "the old directory waits under its temporary name"
    assert _complete_version(tmp_path / leftover[0]) == 2
    _save_version(target, 4)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "started"]


@pytest.mark.distributed
def test_kill_between_the_two_renames_is_undone_by_the_next_reader_or_save(tmp_path):
    target, started = tmp_path / "ckpt", tmp_path / "started"
    _save_version(target, 2)
    proc = _start_saver(target, started, "renames", die_at_swap=True, first_version=3)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert not target.exists(), "the kill landed between taking the old directory away and putting the new one"
    assert resolve_atomic_directory(target) == str(target)
    assert _complete_version(target) == 2, "the old complete directory is back"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "started"]
    proc = _start_saver(target, started, "renames", die_at_swap=True, first_version=5)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    _save_version(target, 6)  # a save resolves first: nothing is lost, nothing is left over
    assert _complete_version(target) == 6
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "started"]


def test_a_file_at_the_path_is_refused_and_kept(tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("user data")
    with pytest.raises(ValueError, match=r"^path: .*ckpt exists and is not a directory.*choose another path"):
        with atomic_directory(target):
            pass
    assert target.read_text() == "user data"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_symlink_is_followed_and_the_directory_it_names_replaced(tmp_path):
    (tmp_path / "scratch" / "real").mkdir(parents=True)
    (tmp_path / "scratch" / "real" / "old").write_text("old")
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "scratch" / "real")
    _save_version(link, 1)
    assert link.is_symlink()
    assert _complete_version(tmp_path / "scratch" / "real") == 1
    assert os.listdir(tmp_path / "scratch") == ["real"]


def test_cleanup_removes_only_dead_writers_leftovers_named_like_ours(tmp_path):
    target = tmp_path / "ckpt"
    _save_version(target, 1)
    dead = tmp_path / ".ckpt.saving-00000000000000aa"
    live = tmp_path / ".ckpt.saving-00000000000000bb"
    replaced = tmp_path / ".ckpt.replaced-00000000000000cc"
    for d in (dead, live, replaced):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("x")
    foreign = [".ckpt.saving-mine", ".ckpt.saving-00000000000000dd.bak", ".other.saving-00000000000000ee", "notes.txt"]
    for name in foreign:
        (tmp_path / name).write_text("keep")
    (tmp_path / ".ckpt.saving-00000000000000ff").write_text("a file, not a directory we make")
    foreign.append(".ckpt.saving-00000000000000ff")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer saving right now does
    try:
        _save_version(target, 2)
        assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", live.name] + foreign)
    finally:
        os.close(fd)
    resolve_atomic_directory(target)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt"] + foreign)
    assert all((tmp_path / name).read_text() != "" for name in foreign)
    assert _complete_version(target) == 2
