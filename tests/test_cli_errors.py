"""Input errors of ``moe-plugin train`` and ``export`` (``plan``'s: tests/plan/test_plan_inputs.py): exit status 2,
exactly one stderr line ``moe-plugin <cmd>: error: ...`` naming the input, no traceback (``--debug`` or
MOE_PLUGIN_DEBUG=1 shows it); a bad recipe is refused before torch can load; and the same on 2 processes under
the deepspeed launcher, where rank 1's own error reaches the user and the launch ends instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_plugin import cli
from moe_plugin.cli_errors import describe, run_command
from tests.training.launchers import BIN, REPO, free_port

GOOD = {
    "output_dir": "OUT",
    "model": {"preset": "tiny"},
    "lora": {"r": 4},
    "data": {"kind": "arithmetic", "num_documents": 40, "seq_len": 32, "eval_fraction": 0.0},
    "schedule": {"steps": 1, "micro_batch_size": 1},
    "logging": {"wandb": {"mode": "disabled"}},
}


def _recipe(tmp_path, name, **changes):
    values = json.loads(json.dumps(GOOD))
    values["output_dir"] = str(tmp_path / f"out_{name}")
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        values[section][key] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(values))
    return str(path)


def _one_error_line(err: str, cmd: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"moe-plugin {cmd}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _in_process(capsys, argv, cmd):
    assert cli.main([cmd] + argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    line = _one_error_line(captured.err, cmd)
    assert captured.err.splitlines()[0] == line  # nothing above it
    return captured.err


# ------------------------------------------------------------------------------------------------ train


@pytest.mark.distributed
def test_a_bad_recipe_is_refused_before_torch_loads(tmp_path):
    bad = _recipe(tmp_path, "bad", schedule__steps="10")
    # torch set to None in sys.modules: any import of it fails, so the refusal below never needed it
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['moe_plugin.train', '--recipe', "
        f"{bad!r}]; runpy.run_module('moe_plugin.train', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"moe-plugin train: error: recipe {bad}: schedule.steps: must be an integer, "
        "got '10' (a str); write a whole number without quotes, e.g. 60"
    ]


@pytest.mark.distributed
def test_an_error_found_after_deepspeed_loads_is_the_only_stderr_line(tmp_path):
    """A valid recipe whose DeepSpeed config is broken is refused inside the trainer, after torch and DeepSpeed
    loaded: stderr holds that one line and nothing else (DeepSpeed's accelerator guess printed a warning above it)."""
    broken = tmp_path / "broken_ds.json"
    broken.write_text("{oops")
    recipe = _recipe(tmp_path, "ds", **{})
    values = json.loads(open(recipe).read())
    values["deepspeed"] = str(broken)
    open(recipe, "w").write(json.dumps(values))
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run(
        [sys.executable, "-m", "moe_plugin.train", "--recipe", recipe],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"moe-plugin train: error: {broken}, line 1 column 2: not valid JSON "
        "(Expecting property name enclosed in double quotes); fix the DeepSpeed "
        "config's syntax"
    ], proc.stderr


def test_train_input_errors_are_one_line(capsys, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "output_dir": "x",\n}\n')
    two = _recipe(tmp_path, "two", schedule__steps=0, lora__alpha=0)
    err = _in_process(capsys, ["--recipe", str(tmp_path / "none.json")], "train")
    assert f"recipe {tmp_path / 'none.json'}: cannot read it" in err
    assert f"recipe {broken}, line 3 column 1: not valid JSON" in _in_process(
        capsys, ["--recipe", str(broken)], "train"
    )
    assert "unrecognized arguments: --bogus" in _in_process(capsys, ["--recipe", two, "--bogus"], "train")
    assert "the following arguments are required: --recipe" in _in_process(capsys, [], "train")
    # a recipe's several problems: one error line, then one line per problem, each named by its field
    lines = _in_process(capsys, ["--recipe", two], "train").splitlines()
    assert lines[0] == f"moe-plugin train: error: recipe {two}: 2 problems"
    assert [line.split(":")[0] for line in lines[1:]] == ["  lora.alpha", "  schedule.steps"]


def test_debug_shows_the_traceback(capsys, monkeypatch, tmp_path):
    bad = _recipe(tmp_path, "bad", schedule__steps="10")
    assert cli.main(["train", "--recipe", bad, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RecipeError" in err
    assert err.splitlines()[-1].startswith(f"moe-plugin train: error: recipe {bad}: schedule.steps")
    monkeypatch.setenv("MOE_PLUGIN_DEBUG", "1")
    assert cli.main(["train", "--recipe", bad]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_rank_other_than_0_says_which(capsys, monkeypatch):
    def refuse(argv):
        raise ValueError("data.path: 'x.jsonl' does not exist; give an existing data file")

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, suffix in (("0", ""), ("1", " (rank 1)")):
        monkeypatch.setenv("RANK", rank)
        assert run_command("train", refuse, []) == 2
        assert capsys.readouterr().err == (
            f"moe-plugin train: error: data.path: 'x.jsonl' does not exist; give an existing data file{suffix}\n"
        )


def test_a_bug_keeps_its_traceback():
    def bug(argv):
        raise RuntimeError("not an input error")

    with pytest.raises(RuntimeError, match="not an input error"):
        run_command("train", bug, [])
    assert describe(KeyError("k")) is None and describe(AssertionError()) is None


def test_files_and_json_are_named(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        open(tmp_path / "gone.json")
    assert describe(missing.value).startswith(f"{tmp_path / 'gone.json'}: No such file or directory; check the path")
    with pytest.raises(IsADirectoryError) as directory:
        open(tmp_path)
    assert describe(directory.value) == f"{tmp_path}: Is a directory; give a file, not a directory"
    broken = tmp_path / "b.json"
    broken.write_text('{"a": 1,\n "b": }')
    with pytest.raises(json.JSONDecodeError) as bad, open(broken) as f:
        json.load(f)
    assert describe(bad.value).startswith(f"{broken}, line 2 column 7: not valid JSON (Expecting value)")


# ------------------------------------------------------------------------------------------------ export


def test_export_input_errors_are_one_line(capsys, tmp_path):
    err = _in_process(capsys, ["--run", str(tmp_path), "--to", "peft", str(tmp_path / "out")], "export")
    assert "moe_plugin_run.json" in err and not (tmp_path / "out").exists()
    assert "argument --to: invalid choice: 'zip'" in _in_process(
        capsys, ["--run", str(tmp_path), "--to", "zip", str(tmp_path / "out")], "export"
    )
    assert "argument --step: invalid int value: 'last'" in _in_process(
        capsys, ["--run", str(tmp_path), "--to", "peft", "--step", "last", str(tmp_path / "out")], "export"
    )
    assert cli.main(["export", "--run", str(tmp_path), "--to", "peft", str(tmp_path / "out"), "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ 2 processes


def _launch(args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", MOE_DEBUG)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    command = [os.path.join(BIN, "deepspeed"), "--num_accelerators", "2", "--master_port", str(free_port())] + args
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


MOE_DEBUG = "MOE_PLUGIN_DEBUG"


@pytest.mark.distributed
def test_under_the_launcher_every_ranks_error_and_a_rank_1_only_error_reach_the_user(tmp_path):
    bad = _recipe(tmp_path, "bad", schedule__steps="10")
    proc = _launch(["--module", "moe_plugin.train", "--recipe", bad])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    line = f"moe-plugin train: error: recipe {bad}: schedule.steps: must be an integer"
    assert line in out  # rank 0's; rank 1's unless the launcher stopped it first
    # rank 1 alone: its recipe names a data file its machine lacks (a multi-node job's node without the copy);
    # rank 0's recipe is valid. Rank 1 reports and exits; the launcher stops rank 0 (it would wait for rank 1 in
    # the process group's start) and exits with rank 1's status.
    good, missing = (
        _recipe(tmp_path, "good"),
        _recipe(tmp_path, "missing", data__kind="text", data__path=str(tmp_path / "absent.jsonl")),
    )
    script = tmp_path / "by_rank.sh"
    script.write_text(
        f'#!/bin/sh\nif [ "$RANK" = 1 ]; then R={missing}; else R={good}; fi\n'
        f'exec {sys.executable} -m moe_plugin.train --recipe "$R"\n'
    )
    script.chmod(0o755)
    proc = _launch(["--no_python", "--no_local_rank", str(script)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    line = _one_error_line(proc.stderr, "train")
    assert line.startswith(f"moe-plugin train: error: recipe {missing}: data.path: ") and line.endswith(" (rank 1)")
    assert not os.path.exists(json.load(open(good))["output_dir"])  # rank 0 never got as far as its output
