"""moe-plugin export can neither destroy data, nor run code from a run directory, nor read a changed input.

One real run of the product's ``train`` (2 gloo processes, EP=2 x ZeRO-3, dense adapters: the main job's
layout) is shared by the module; each test copies it (with its base) before changing anything. Every refusal
is checked for its one-line message naming the input and for sentinel files left as they were in every
directory the export could touch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin import cli
from moe_plugin.export import export_run
from moe_plugin.testing.launch import run_distributed
from moe_plugin.training.inputs import RECORD, fingerprint_inputs, write_recorded_inputs
from moe_plugin.training.run_dir import MARKER
from tests.export.saved_files import directory_tensors
from tests.recipes import OMIT
from tests.recipes import recipe as recipe_for

pytestmark = pytest.mark.distributed  # every test here starts processes

WORKER = "tests/training/trainer_workers.py:run_recipes"
ENGINE_FILES = [
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
]
TEST_LIMIT_S = 600  # a hang fails the test instead of the whole session


@pytest.fixture(autouse=True)
def _time_limit():
    def expire(*_):
        raise TimeoutError(f"the test ran past {TEST_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    base = tmp / "base"
    shutil.copytree("recipes/bases/tiny-arith", base)
    recipe = recipe_for(
        tmp / "run",
        world=2,
        ep=2,
        base=base,
        lora={"target_parameters": OMIT},
        data={"num_documents": 100},
        schedule={"steps": 1},
        checkpoint={"every": 1, "keep": 2},
        logging={"wandb": {"mode": "disabled"}},
    )
    run_distributed(WORKER, world_size=2, timeout_s=900, recipes=[recipe])
    return str(tmp / "run"), str(base)


def _rewrite_json(path, change) -> None:
    with open(path) as f:
        values = json.load(f)
    change(values)
    with open(path, "w") as f:
        json.dump(values, f)


def _copy(trained, root, *, record: bool, from_pretrained=None):
    """A copy of the run and its base under ``root``; the copy names its own base (marker, adapter, record).
    record: write ``moe_plugin_inputs.json`` as the trainer does, else remove it (a run from before records)."""
    run, base = os.path.join(root, "run"), os.path.join(root, "base")
    shutil.copytree(trained[0], run, ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(trained[1], base)
    _rewrite_json(os.path.join(run, MARKER), lambda r: r["model"].update(from_pretrained=from_pretrained or base))
    _rewrite_json(os.path.join(run, "adapter", "adapter_config.json"), lambda c: c.update(base_model_name_or_path=base))
    if os.path.exists(os.path.join(run, RECORD)):
        os.remove(os.path.join(run, RECORD))
    if record:
        with open(os.path.join(run, MARKER)) as f:
            write_recorded_inputs(run, fingerprint_inputs(dict(json.load(f), model={"from_pretrained": base}), base))
    return run, base


def _plant(directories):
    """A sentinel file in each directory; returns what to check afterwards."""
    planted = {}
    for d in directories:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "SENTINEL_user_file.txt")
        with open(path, "w") as f:
            f.write(f"keep {d}\n")
        planted[path] = f"keep {d}\n"
    return planted


def _untouched(planted) -> None:
    for path, content in planted.items():
        assert os.path.isfile(path), f"{path} was deleted"
        with open(path) as f:
            assert f.read() == content, f"{path} was changed"


def _no_leftovers(directory) -> None:
    assert not [e for e in os.listdir(directory) if ".saving-" in e or ".replaced-" in e], os.listdir(directory)


def _cli_error(capsys, argv) -> str:
    """The command's error message; it must be one line, the last on stderr (library warnings may precede it)."""
    assert cli.main(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    prefix = "moe-plugin export: error: "
    errors = [line for line in lines if line.startswith(prefix)]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return errors[0][len(prefix) :]


@pytest.fixture
def copied(trained, tmp_path):
    """A copy of the module's run and base, with its input record (tests change what they like in it)."""
    return _copy(trained, str(tmp_path), record=True)


CASES = ["user_dir", "dot", "dotdot", "home", "home_link", "run", "adapter", "checkpoint", "base", "file"]


@pytest.mark.parametrize("case", CASES)
def test_an_out_that_would_destroy_data_is_refused_and_nothing_is_touched(copied, tmp_path, monkeypatch, capsys, case):
    run, base = copied
    home, work = tmp_path / "home", tmp_path / "work" / "sub"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (tmp_path / "home_link").symlink_to(home)
    user = tmp_path / "user_files"
    out, expected = {
        "user_dir": (
            str(user),
            f"'{user}' is a non-empty directory (SENTINEL_user_file.txt) that is not an earlier "
            "peft export of this run: it has no moe_plugin_export.json",
        ),
        "dot": (".", "'.' is the current directory or one of its parents"),
        "dotdot": ("..", "'..' is the current directory or one of its parents"),
        "home": ("~", "'~' is the home directory or one of its parents"),
        "home_link": (
            str(tmp_path / "home_link"),
            f"'{tmp_path / 'home_link'}' is the home directory or one of its parents ({os.path.realpath(home)})",
        ),
        "run": (run, f"'{run}' is the run directory, which this command reads"),
        "adapter": (os.path.join(run, "adapter"), "is the run's adapter, which this command reads"),
        "checkpoint": (os.path.join(run, "checkpoints", "step-00000001"), "is inside the run's checkpoints"),
        "base": (base, f"'{base}' is the base checkpoint, which this command reads"),
        "file": (str(tmp_path / "notes.txt"), "is an existing file, not a directory"),
    }[case]
    planted = _plant(
        [
            str(home),
            str(work),
            str(work.parent),
            str(user),
            run,
            os.path.join(run, "adapter"),
            os.path.join(run, "checkpoints", "step-00000001"),
            base,
        ]
    )
    (tmp_path / "notes.txt").write_text("user notes\n")
    message = _cli_error(capsys, ["export", "--run", run, "--to", "peft", out])
    assert message.startswith("OUT: ") and expected in message, message
    _untouched(planted)
    assert (tmp_path / "notes.txt").read_text() == "user notes\n"
    for d in (tmp_path, work, work.parent, os.path.dirname(run)):
        _no_leftovers(d)


def test_an_earlier_export_of_the_same_run_and_format_is_replaced_any_other_directory_is_not(copied, trained, tmp_path):
    run, _ = copied
    out = tmp_path / "exports" / "peft"
    out.mkdir(parents=True)  # an existing empty directory is fine
    export_run(run, "peft", str(out))
    first = directory_tensors(out)
    manifest = json.loads((out / "moe_plugin_export.json").read_text())
    assert manifest["run"] == os.path.realpath(run) and manifest["format"] == "peft"
    assert sorted(manifest["contents"]) == sorted(os.listdir(out))
    export_run(run, "peft", str(out))  # the same run and format: replaced whole
    again = directory_tensors(out)
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)
    _no_leftovers(out.parent)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    with pytest.raises(
        ValueError,
        match=r"^OUT: .* is a non-empty directory .* that is not an earlier per-expert "
        r"export of this run: it is a 'peft' export, not 'per-expert'",
    ):
        export_run(run, "per-expert", str(out))
    with pytest.raises(
        ValueError,
        match=r"^OUT: .* not an earlier peft export of this run: it is an export of the "
        rf"run '{os.path.realpath(run)}', not of ",
    ):
        export_run(trained[0], "peft", str(out))
    (out / "my_notes.md").write_text("mine\n")
    with pytest.raises(ValueError, match=r"it also holds entries the export did not write \(my_notes\.md\)"):
        export_run(run, "peft", str(out))
    assert (out / "my_notes.md").read_text() == "mine\n"
    assert all((out / name).read_bytes() == data for name, data in before.items())
    _no_leftovers(out.parent)


class _Payload:
    """Unpickling this creates ``path``: the proof that a loader ran code from the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _planted_pickle(path, proof) -> None:
    torch.save(
        {"module": _Payload(proof), "param_shapes": _Payload(proof), "optimizer_state_dict": _Payload(proof)}, path
    )


def _earlier_version(run: str, step: int = 1) -> None:
    """Make checkpoint ``step`` one of an earlier version: DeepSpeed's files only, no layout-free state (which
    ``export --step`` reads first when it is there)."""
    for name in ("trainable.safetensors", "trainable.json"):
        os.remove(os.path.join(run, "checkpoints", f"step-{step:08d}", name))


@pytest.mark.parametrize("name", ENGINE_FILES + ["mp_rank_00_model_states.pt"])
def test_a_pickle_payload_in_any_engine_file_is_not_executed_and_the_file_is_named(copied, tmp_path, name):
    run, _ = copied
    _earlier_version(run)
    engine = os.path.join(run, "checkpoints", "step-00000001", "engine")
    if name == "mp_rank_00_model_states.pt":  # the one-process (no ZeRO-3) layout reads this file alone
        for f in os.listdir(engine):
            os.remove(os.path.join(engine, f))
    proof = str(tmp_path / "payload_ran")
    _planted_pickle(os.path.join(engine, name), proof)
    with pytest.raises(
        ValueError,
        match=rf"^{os.path.join(engine, name)}: damaged or not a DeepSpeed checkpoint of "
        r"this run \(UnpicklingError: [^\n]*\); restore the checkpoint",
    ):
        export_run(run, "peft", str(tmp_path / "out"), step=1)
    assert not os.path.exists(proof)
    assert not (tmp_path / "out").exists()


def test_a_truncated_layout_free_state_is_named(copied, tmp_path):
    run, _ = copied
    path = os.path.join(run, "checkpoints", "step-00000001", "trainable.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=rf"^{path}: not a readable safetensors file"):
        export_run(run, "peft", str(tmp_path / "out"), step=1)
    assert not (tmp_path / "out").exists()


def test_a_truncated_engine_file_is_named(copied, tmp_path):
    run, _ = copied
    _earlier_version(run)
    path = os.path.join(run, "checkpoints", "step-00000001", "engine", ENGINE_FILES[1])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=rf"^{path}: damaged or not a DeepSpeed checkpoint of this run"):
        export_run(run, "peft", str(tmp_path / "out"), step=1)
    assert not (tmp_path / "out").exists()


def test_the_step_export_of_the_main_jobs_layout_is_the_final_adapter(copied, tmp_path):
    # EP=2 with dense adapters only: DeepSpeed writes no ds_zero_partition_groups (one partition group)
    run, _ = copied
    export_run(run, "peft", str(tmp_path / "step1"), step=1)
    got = directory_tensors(tmp_path / "step1")
    final = load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))
    assert sorted(got) == sorted(final) and all(torch.equal(got[k], final[k]) for k in final)


def _corrupt(path, text) -> None:
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize(
    "what",
    ["marker_json", "marker_list", "adapter_config_json", "adapter_config_list", "adapter_truncated", "adapter_header"],
)
def test_a_corrupt_run_file_is_named(copied, tmp_path, capsys, what):
    run, _ = copied
    marker, config = os.path.join(run, MARKER), os.path.join(run, "adapter", "adapter_config.json")
    weights = os.path.join(run, "adapter", "adapter_model.safetensors")
    if what == "marker_json":
        _corrupt(marker, '{"model": ')
        expected = f"{marker}, line 1: not valid JSON"
    elif what == "marker_list":
        _corrupt(marker, "[1, 2]")
        expected = f"{marker}: holds a JSON list, not an object"
    elif what == "adapter_config_json":
        _corrupt(config, '{\n  "r": 4,\n')
        expected = f"{config}, line 3: not valid JSON"
    elif what == "adapter_config_list":
        _corrupt(config, "[]")
        expected = f"{config}: holds a JSON list, not an object"
    elif what == "adapter_truncated":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 10)
        expected = f"{weights}: damaged safetensors file"
    else:
        with open(weights, "r+b") as f:
            f.write((10**9).to_bytes(8, "little"))
        expected = f"{weights}: damaged safetensors file"
    message = _cli_error(capsys, ["export", "--run", run, "--to", "peft", str(tmp_path / "out")])
    assert message.startswith(expected), message
    assert not (tmp_path / "out").exists()


def test_the_base_is_the_one_the_run_recorded_from_any_directory(trained, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    decoy = elsewhere / "bases" / "tiny"  # what the recipe's relative path names from here
    decoy.mkdir(parents=True)
    (decoy / "config.json").write_text('{"model_type": "not the base"}')
    planted = _plant([str(decoy)])
    monkeypatch.chdir(elsewhere)
    for record in (True, False):  # the record's path; without it, the final adapter's absolute path
        run, base = _copy(trained, str(tmp_path / f"record-{record}"), record=record, from_pretrained="bases/tiny")
        out = tmp_path / f"out-{record}"
        export_run(run, "peft", str(out))
        assert json.loads((out / "moe_plugin_export.json").read_text())["base"] == os.path.realpath(base)
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == os.path.realpath(
            base
        )
    _untouched(planted)
    assert (decoy / "config.json").read_text() == '{"model_type": "not the base"}'
    shutil.rmtree(os.path.join(run, "adapter"))  # no record, no final adapter: nothing pins the relative path
    with pytest.raises(
        ValueError,
        match=r"^run: model\.from_pretrained is the relative path 'bases/tiny' and the run "
        r"recorded no absolute base .* pass --allow-changed-inputs",
    ):
        export_run(run, "peft", str(tmp_path / "step"), step=1)
    assert not (tmp_path / "step").exists()


def test_a_changed_base_is_refused_naming_it_unless_overridden(copied, tmp_path, capsys):
    run, base = copied
    config = os.path.join(base, "config.json")
    _rewrite_json(config, lambda c: None)  # same values, other bytes: the recorded fingerprint differs
    out = tmp_path / "out"
    message = _cli_error(capsys, ["export", "--run", run, "--to", "peft", str(out)])
    assert message.startswith(
        f"the base at {os.path.realpath(base)}: its config.json changed since the run recorded its inputs"
    ), message
    assert "pass --allow-changed-inputs" in message and not out.exists()
    assert cli.main(["export", "--run", run, "--to", "peft", "--allow-changed-inputs", str(out)]) == 0
    assert (out / "adapter_model.safetensors").exists()
