"""``moe-plugin plan`` on bad and extreme inputs: each non-finite or absurd size is refused in one line naming
the flag (or the recipe's field) and the largest value accepted; the largest accepted row length plans in well
under a minute; the rows' segment lengths equal the trainer's packing."""

from __future__ import annotations

import json
import random
import time
import warnings

import pytest

from moe_plugin.plan import command
from moe_plugin.limits import LIMITS
from moe_plugin.plan.packing import packed_lengths
from moe_plugin.plan.planner import plan_recipe
from moe_plugin.training.data.pipeline import Example, pack_examples
from moe_plugin.recipe.schema import recipe_from_dict

TINY = {
    "output_dir": "outputs/never",
    "model": {"preset": "tiny"},
    "lora": {"r": 8},
    "data": {"kind": "arithmetic", "num_documents": 200, "seq_len": 256, "eval_fraction": 0.0},
}


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _error_line(capsys, argv):
    assert command.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-plugin plan: error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return lines[0]


@pytest.mark.parametrize(
    "flag, value, largest",
    [
        ("--device-memory", "inf", "100TB"),
        ("--device-memory", "nan", "141GB"),
        ("--device-memory", "101TB", "100TB"),
        ("--device-memory", "-3GB", "141GB"),
        ("--seq-len", "1000000000", "16,777,216"),
        ("--seq-len", "1", "16,777,216"),
        ("--micro-batch", str(10**30), "65,536"),
        ("--micro-batch", "0", "65,536"),
        ("--devices", "65537", "65,536"),
        ("--devices", "-1", "65,536"),
        ("--images", "1000000", "4,096"),
        ("--image-size", "100000", "8,192"),
        ("--capacity", "inf", "128"),
        ("--capacity", "nan", "128"),
        ("--capacity", "1e300", "128"),
        ("--capacity", "0.5", "128"),
    ],
)
def test_an_absurd_size_is_one_line_naming_the_flag_and_the_largest(capsys, recipe_file, flag, value, largest):
    line = _error_line(capsys, ["--recipe", recipe_file, f"{flag}={value}"])  # "=": a value may start with "-"
    assert line.startswith(f"moe-plugin plan: error: {flag}: ") and largest in line


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--recipe", "no/such.json"], "--recipe: 'no/such.json'"),
        (["--recipe", "{r}", "--seq-len", "many"], "argument --seq-len"),
        (["--recipe", "{r}", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "required: --recipe"),
    ],
)
def test_a_bad_command_line_is_one_line(capsys, recipe_file, argv, named):
    line = _error_line(capsys, [a.replace("{r}", recipe_file) for a in argv])
    assert named in line


def test_debug_shows_the_traceback(capsys, recipe_file):
    assert command.main(["--recipe", recipe_file, "--seq-len", "1", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1].startswith(
        "moe-plugin plan: error: --seq-len:"
    )


@pytest.mark.parametrize(
    "section, key, value, field, limit",
    [
        ("data", "seq_len", 10**9, "data.seq_len", "seq_len"),
        ("schedule", "micro_batch_size", 10**6, "schedule.micro_batch_size", "micro_batch"),
        ("schedule", "gradient_accumulation_steps", 10**6, "schedule.gradient_accumulation_steps", "grad_accum"),
        ("data", "num_documents", 10**8, "data.num_documents", "num_documents"),
    ],
)
def test_the_recipes_own_absurd_sizes_are_refused_by_name(section, key, value, field, limit):
    values = json.loads(json.dumps(TINY))
    values.setdefault(section, {})[key] = value
    # the recipe's schema refuses them first now, by the planner's limits; one line naming the field and the
    # largest value either way
    with pytest.raises(ValueError, match=f"(^|: ){field}: must be .*{LIMITS[limit]:,}") as refused:
        plan_recipe(recipe_from_dict(values), devices=1)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_the_largest_accepted_row_length_plans_in_well_under_a_minute():
    # a 1e9-token row used to be padded as a Python list and run out of memory; 16M tokens is the largest
    recipe = recipe_from_dict(TINY)
    plan_recipe(recipe, devices=2, seq_len=256)  # start-up: imports and the first meta runs
    # this process's CPU time, which other jobs on a busy machine do not stretch (wall time they do)
    started = time.process_time()
    plan = plan_recipe(recipe, devices=2, seq_len=LIMITS["seq_len"], device_memory=141e9, knobs=True)
    elapsed = time.process_time() - started
    assert plan.layout.seq_len == LIMITS["seq_len"] and plan.memory.peak > 0
    assert elapsed < 60, f"{elapsed:.0f} s"


def test_packed_lengths_are_the_trainers_packing():
    rng = random.Random(0)
    for _ in range(30):
        seq_len = rng.choice([2, 7, 16, 64])
        sizes = [rng.randint(1, 2 * seq_len) for _ in range(rng.randint(1, 60))]
        for pack in (True, False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pack_examples warns about the examples it cuts
                rows = pack_examples([Example([1] * n, [1] * n) for n in sizes], seq_len, pack=pack)
            expected = [int(x) for row in rows for x in (row.cu_seqlens[1:] - row.cu_seqlens[:-1])]
            assert packed_lengths(sizes, seq_len, pack) == expected, (sizes, seq_len, pack)
