"""One launch for every measured check of the planner (test_planner.py's 1-, 2- and 4-process layouts and
test_context_parallel_measured.py's 32 k-token row): 4 processes, whose ranks form a world of 4, then of 2, then
of 1 in turn (``plan_measure.measure_phases_worker``); tests only assert. A fixture, because the suite runs with
``--import-mode=importlib`` (test directories are not importable)."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest

from moe_plugin.testing.launch import run_distributed
from moe_plugin.testing.plan_measure import (
    CALIBRATION,
    fsdp2_recipes,
    layout_recipe,
    layout_recipes,
    measured_ds_config,
    planned_peak,
)

CP_WORLD, CP, CP_TOKENS = 4, 4, 65536


def _cp_recipe(directory: str, name: str, shape: dict, seq_len: int, ds_config: str, steps: int) -> dict:
    values = copy.deepcopy(layout_recipe(f"{directory}/{name}", CP_WORLD, 1, seq_len, shape=shape, ds_config=ds_config))
    values["parallel"]["context_parallel_size"] = CP
    values["schedule"].update(micro_batch_size=1, steps=steps)
    # arithmetic documents of about 20 tokens: enough for every step's packed rows
    values["data"]["num_documents"] = max(400, 2 * steps * seq_len // 16)
    return values


@pytest.fixture(scope="session")
def measured_plans():
    """``{name: (planned peaks, per-rank measurements)}`` for ``"world 1"``, ``"world 2"``, ``"world 4"`` (the
    calibration first, then ``plan_measure.measured_layouts(world)``), ``"fsdp2"`` (its calibration, then
    ``plan_measure.FSDP2_LAYOUTS``) and ``"context parallel"`` (its calibration, then the 64 k-token row at CP 4,
    its gated MLA layers' FLOPs counted on each rank); the planned peaks exclude the framework's overhead."""
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2, 4):
            os.makedirs(f"{tmp}/w{world}")
        os.makedirs(f"{tmp}/fsdp2")
        cp_ds = measured_ds_config(tmp)
        phases = {
            "world 4": dict(world=4, recipes=layout_recipes(f"{tmp}/w4", 4), threads=1),
            "context parallel": dict(
                world=CP_WORLD,
                recipes=[
                    _cp_recipe(tmp, "calibration", CALIBRATION, 1024, cp_ds, steps=2),
                    _cp_recipe(tmp, "long", {}, CP_TOKENS, cp_ds, steps=3),  # the tiny preset as it ships
                ],
                threads=1,
                count_attention=True,
            ),
            "fsdp2": dict(world=4, recipes=fsdp2_recipes(f"{tmp}/fsdp2"), threads=1),
            "world 2": dict(world=2, recipes=layout_recipes(f"{tmp}/w2", 2), threads=1),
            "world 1": dict(world=1, recipes=layout_recipes(f"{tmp}/w1", 1), threads=2),
        }
        shared: dict = {}  # plans of the same layouts are shared between the worlds
        planned = {}
        for name, phase in phases.items():
            cache = {} if name == "context parallel" else shared
            planned[name] = [planned_peak(r, phase["world"], cache) for r in phase["recipes"]]
        per_rank = run_distributed(
            "moe_plugin.testing.plan_measure:measure_phases_worker",
            world_size=4,
            timeout_s=3000,
            init_process_group=False,
            phases=list(phases.values()),
        )
    return {
        name: (planned[name], [ranks[i] for ranks in per_rank if ranks[i] is not None]) for i, name in enumerate(phases)
    }
