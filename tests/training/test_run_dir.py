"""The output-directory guard: dangerous or foreign paths are refused, one run at a time holds a directory."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from moe_plugin.training.run_dir import LOCK, MARKER, RunDirectory

RECIPE = {
    "output_dir": "out",
    "model": {"preset": "tiny", "from_pretrained": None, "overrides": {}},
    "data": {"kind": "arithmetic", "seq_len": 64},
    "schedule": {"steps": 10, "lr": 0.003},
    "eval": {"every": 0},
    "logging": {"every": 10},
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLDER = textwrap.dedent("""
    import json, sys
    from moe_plugin.training.run_dir import RunDirectory
    run = RunDirectory.claim(sys.argv[1], json.loads(sys.argv[2]))
    print("held", flush=True)
    sys.stdin.read()  # hold the lock until killed
""")


def _claim_refused(path, recipe=RECIPE):
    with pytest.raises(ValueError) as caught:
        RunDirectory.claim(path, recipe)
    assert str(caught.value).startswith("output_dir: ")
    return str(caught.value)


def _snapshot(path):
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_empty_string():
    assert "is empty" in _claim_refused("")


def test_the_current_directory_and_its_parents(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert "is the current directory or one of its parents" in _claim_refused(".")
    assert "is the current directory or one of its parents" in _claim_refused("..")
    assert "is the current directory or one of its parents" in _claim_refused(str(tmp_path))
    assert "is the filesystem root" in _claim_refused("/")
    assert os.listdir(work) == []


def test_the_home_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert "is the home directory" in _claim_refused(str(home))
    assert "is the home directory" in _claim_refused("~")
    os.symlink(home, tmp_path / "link")
    assert "is the home directory" in _claim_refused(str(tmp_path / "link"))
    assert os.listdir(home) == []


def test_an_existing_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"data")
    assert "is an existing file" in _claim_refused(str(path))
    assert path.read_bytes() == b"data"


def test_a_non_empty_foreign_directory_is_left_untouched(tmp_path):
    (tmp_path / "thesis.tex").write_text("years of work")
    before = _snapshot(tmp_path)
    message = _claim_refused(str(tmp_path))
    assert f"is a non-empty directory (thesis.tex) that is not a run of this project: it has no {MARKER}" in message
    assert message.endswith('choose a new or empty directory, e.g. "outputs/my_run"')
    assert _snapshot(tmp_path) == before


def test_a_new_directory_is_claimed_and_marked(tmp_path):
    path = tmp_path / "runs" / "first"
    with RunDirectory.claim(str(path), RECIPE) as run:
        assert run.held and not run.resumed
        assert sorted(os.listdir(path)) == sorted([LOCK, MARKER])  # the write probe is gone
        assert json.loads((path / MARKER).read_text()) == RECIPE
        assert (path / LOCK).read_text().strip() == str(os.getpid())
    assert not run.held


def test_an_empty_directory_is_claimed(tmp_path):
    RunDirectory.claim(str(tmp_path), RECIPE).release()
    assert json.loads((tmp_path / MARKER).read_text()) == RECIPE


def test_resuming_keeps_the_files_and_accepts_more_steps_or_other_logging(tmp_path):
    RunDirectory.claim(str(tmp_path), RECIPE).release()
    (tmp_path / "checkpoints" / "step-00000005").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000005" / "state.pt").write_bytes(b"step 5")
    longer = json.loads(json.dumps(RECIPE))
    longer["schedule"]["steps"] = 40
    longer["logging"]["every"] = 1
    longer["eval"] = {"every": 5, "batches": 2}
    longer["output_dir"] = str(tmp_path)
    with RunDirectory.claim(str(tmp_path), longer) as run:
        assert run.resumed
    assert (tmp_path / "checkpoints" / "step-00000005" / "state.pt").read_bytes() == b"step 5"
    assert json.loads((tmp_path / MARKER).read_text())["schedule"]["steps"] == 40


def test_a_changed_recipe_is_refused(tmp_path):
    RunDirectory.claim(str(tmp_path), RECIPE).release()
    (tmp_path / "losses.json").write_text("[2.5]")  # it trained a step (an untrained one is reusable)
    other = json.loads(json.dumps(RECIPE))
    other["model"]["preset"] = "k3"
    other["data"]["seq_len"] = 128
    other["schedule"]["steps"] = 99
    message = _claim_refused(str(tmp_path), other)
    assert f"holds a run of another recipe: data.seq_len, model.preset differ from its {MARKER}" in message
    assert json.loads((tmp_path / MARKER).read_text()) == RECIPE


def test_a_second_claim_while_the_first_holds_the_lock(tmp_path):
    # a second claim opens its own file description, and flock locks conflict between descriptions
    first = RunDirectory.claim(str(tmp_path), RECIPE)
    assert f"another run (pid {os.getpid()}) is using" in _claim_refused(str(tmp_path))
    first.release()
    RunDirectory.claim(str(tmp_path), RECIPE).release()


def _wait_for_line(stream, timeout_s):
    line = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return line[0] if line else ""


@pytest.mark.distributed
def test_another_process_holds_the_lock_until_it_dies(tmp_path):
    path = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path, json.dumps(RECIPE)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _wait_for_line(holder.stdout, timeout_s=600) == "held\n"  # the package import is slow on a busy box
        assert f"another run (pid {holder.pid}) is using" in _claim_refused(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=600)
        holder.stdin.close()
        holder.stdout.close()
    # the kernel dropped the dead holder's lock; its lock file, still on disk, does not block
    assert os.path.exists(os.path.join(path, LOCK))
    with RunDirectory.claim(path, RECIPE) as run:
        assert run.held


def test_an_unwritable_location_is_refused_before_training(tmp_path):
    (tmp_path / "somefile").write_text("not a directory")
    message = _claim_refused(str(tmp_path / "somefile" / "sub"))
    assert "cannot create" in message and "choose a writable location" in message


@pytest.mark.parametrize("where", ["base/run", "base", "data_dir"])
def test_an_output_dir_inside_or_around_an_input_is_refused(tmp_path, where):
    """The one output rule (moe_plugin/output_paths.py): a run never writes into, over or around what it reads,
    even where the directory would be new (inside the base) and so nothing would be deleted."""
    base, data_dir = tmp_path / "base", tmp_path / "data_dir"
    base.mkdir()
    data_dir.mkdir()
    (base / "config.json").write_text("{}")
    (data_dir / "train.jsonl").write_text("{}\n")
    recipe = {
        **RECIPE,
        "model": {"preset": None, "from_pretrained": str(base), "overrides": {}},
        "data": {"path": str(data_dir / "train.jsonl")},
    }
    before = {d: _snapshot(d) for d in (base, data_dir)}
    message = _claim_refused(str(tmp_path / where), recipe)
    label = "the data file data.path" if where == "data_dir" else "the base checkpoint model.from_pretrained"
    assert label in message and "\n" not in message, message
    assert {d: _snapshot(d) for d in (base, data_dir)} == before and not (base / "run").exists()
