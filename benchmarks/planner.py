"""The planner's error: planned against measured per-rank peaks of the product's Trainer on tiny CPU layouts
(1, 2 and 4 processes; EP 1 and 2 with ZeRO-3; dense and MXFP4 experts; several sequence lengths; one layout
of each launch with Attention Residuals in every activation checkpointing mode).

Measured: each rank's peak of tensor bytes (``torch.profiler``'s allocator events summed, from just before the
Trainer starts; ``moe_plugin.testing.plan_measure``). The framework overhead is one measured constant per
launch and rank (its calibration layout, a model too small to matter). Printed side by side: each layout's
planned and measured peak, their ratio and the error; the goal is within 15 % on every layout. ``python -m
benchmarks.planner``.
"""

from __future__ import annotations

import tempfile

from .harness import machine_line, write_results


def main() -> None:
    from moe_plugin.testing.launch import run_distributed
    from moe_plugin.testing.plan_measure import layout_recipes, measured_layouts, planned_peak

    lines = [machine_line(2)]
    cache: dict = {}
    worst = 0.0
    for world in (1, 2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            recipes = layout_recipes(tmp, world)
            planned = [planned_peak(r, world, cache) for r in recipes]
            measured = run_distributed(
                "moe_plugin.testing.plan_measure:measure_worker",
                world_size=world,
                timeout_s=3000,
                recipes=recipes,
                threads=max(1, 2 // world),
            )
        for rank in range(world):
            peaks = [m["peak_bytes"] for m in measured[rank]]
            overhead = peaks[0] - planned[0]
            for (w, ep, seq, fmt, mode, shape), plan, peak in zip(measured_layouts(world), planned[1:], peaks[1:]):
                error = (plan + overhead - peak) / peak
                worst = max(worst, abs(error))
                attn_res = ", AttnRes" if shape.get("attn_res") else ""
                line = (
                    f"{w} processes, EP {ep}, seq {seq}, {fmt} experts{attn_res}, checkpointing {mode}, "
                    f"rank {rank}: planned "
                    f"{(plan + overhead) / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB, planned/measured "
                    f"{(plan + overhead) / peak:.2f}, error {error:+.1%} (overhead constant "
                    f"{overhead / 2**20:+.1f} MiB)"
                )
                print(line, flush=True)
                lines.append(line)
    lines.append(f"largest error over every layout and rank: {worst:.1%} (goal 15 %)")
    print(lines[-1])
    write_results("Planner: planned against measured per-rank peaks", lines)


if __name__ == "__main__":
    main()
