"""A row much longer than one slice holds comfortably: 32 k tokens of the tiny preset over 4 context-parallel ranks
trains through the product's Trainer (finite losses at every step), and every rank's measured peak of tensor
bytes is within 15 % of ``moe-plugin plan``'s for the same recipe (docs/planner.md, "Checked against
measurements": a calibration run of a negligible model in the same launch measures the framework's own
memory). Measurement: ``moe_plugin.testing.plan_measure`` (torch.profiler's allocator events)."""

from __future__ import annotations

import pytest
import copy
import tempfile

from moe_plugin.testing.launch import run_distributed
from moe_plugin.testing.plan_measure import CALIBRATION, layout_recipe, measured_ds_config, planned_peak

pytestmark = pytest.mark.distributed  # every test here starts processes

WORLD, CP, TOKENS = 4, 4, 32768


def _recipe(directory: str, name: str, shape: dict, seq_len: int, ds_config: str, steps: int) -> dict:
    values = copy.deepcopy(layout_recipe(f"{directory}/{name}", WORLD, 1, seq_len, shape=shape, ds_config=ds_config))
    values["parallel"]["context_parallel_size"] = CP
    values["schedule"].update(micro_batch_size=1, steps=steps)
    # arithmetic documents of about 20 tokens: enough for every step's packed rows
    values["data"]["num_documents"] = max(400, 2 * steps * seq_len // 16)
    return values


def test_a_32k_row_over_4_context_ranks_trains_and_matches_the_plan():
    with tempfile.TemporaryDirectory() as tmp:
        ds = measured_ds_config(tmp)
        recipes = [
            _recipe(tmp, "calibration", CALIBRATION, 1024, ds, steps=2),
            _recipe(tmp, "long", {}, TOKENS, ds, steps=3),  # the tiny preset as it ships
        ]
        planned = [planned_peak(r, WORLD, {}) for r in recipes]
        measured = run_distributed(
            "moe_plugin.testing.plan_measure:measure_worker", world_size=WORLD, timeout_s=3000, recipes=recipes
        )
    for rank, (calibration, long) in enumerate(measured):
        overhead = calibration["peak_bytes"] - planned[0]
        error = (planned[1] + overhead - long["peak_bytes"]) / long["peak_bytes"]
        print(
            f"rank {rank}: planned {(planned[1] + overhead) / 2**20:.1f} MiB, measured "
            f"{long['peak_bytes'] / 2**20:.1f} MiB ({error:+.1%})"
        )
        assert abs(error) < 0.15, (
            f"rank {rank}: planned {(planned[1] + overhead) / 2**20:.0f} MiB, measured "
            f"{long['peak_bytes'] / 2**20:.0f} MiB ({error:+.0%})"
        )
        assert len(long["losses"]) == 3 and all(0 < x < 20 for x in long["losses"]), (rank, long["losses"])
