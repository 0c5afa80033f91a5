"""A row much longer than one slice holds comfortably: 32 k tokens of the tiny preset over 4 context-parallel ranks
trains through the product's Trainer (finite losses at every step), and every rank's measured peak of tensor
bytes is within 15 % of ``moe-plugin plan``'s for the same recipe (docs/planner.md, "Checked against
measurements": a calibration run of a negligible model in the same launch measures the framework's own
memory). Measurement: ``moe_plugin.testing.plan_measure`` (torch.profiler's allocator events), in the planner's
one measuring launch (tests/plan/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes


def test_a_32k_row_over_4_context_ranks_trains_and_matches_the_plan(measured_plans):
    planned, measured = measured_plans["context parallel"]
    assert len(measured) == 4
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
