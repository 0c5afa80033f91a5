"""The planner's error: planned against measured per-rank peaks of the product's Trainer on tiny CPU layouts
(1, 2 and 4 processes; EP 1 and 2 with ZeRO-3; dense and MXFP4 experts; several sequence lengths).

Measured: VmHWM minus VmRSS before the Trainer starts (after the imports). The framework overhead is one
measured constant per launch (its calibration layout, a model too small to matter). Printed: each layout's
planned and measured peak and their ratio; the goal is within 15 %. ``python -m benchmarks.planner``
(``--pin-mmap``: glibc's mmap threshold pinned in every rank, docs/planner.md).
"""

from __future__ import annotations

import tempfile

from .harness import machine_line, write_results


def main() -> None:
    import sys

    pin = "--pin-mmap" in sys.argv[1:]  # the diagnosis of docs/planner.md: glibc's mmap threshold pinned
    from moe_plugin.parallel.launch import run_distributed
    from moe_plugin.plan.measure import CALIBRATION, LAYOUTS, layout_recipe, planned_peak

    lines = [machine_line(2)]
    cache: dict = {}
    for world in (1, 2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            recipes = [layout_recipe(f"{tmp}/calibration", world, 1, 256, shape=CALIBRATION)] + [
                layout_recipe(f"{tmp}/l{i}", *layout) for i, layout in enumerate(LAYOUTS[world])]
            planned = [planned_peak(r, world, cache) for r in recipes]
            measured = run_distributed("moe_plugin.plan.measure:measure_worker", world_size=world,
                                       timeout_s=3000, recipes=recipes, threads=max(1, 2 // world),
                                       pin_mmap=pin)
        for rank in range(world):
            peaks = [m["peak_bytes"] for m in measured[rank]]
            overhead = peaks[0] - planned[0]
            for (w, ep, seq, fmt), plan, peak in zip(LAYOUTS[world], planned[1:], peaks[1:]):
                line = (f"{w} processes, EP {ep}, seq {seq}, {fmt} experts, rank {rank}: planned "
                        f"{(plan + overhead) / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB, planned/measured "
                        f"{(plan + overhead) / peak:.2f} (overhead constant {overhead / 2**20:.0f} MiB)")
                print(line, flush=True)
                lines.append(line)
    write_results("Planner: the same layouts with glibc's mmap threshold pinned (diagnosis of the ZeRO-3 gap)"
                  if pin else "Planner: planned against measured per-rank peaks", lines)


if __name__ == "__main__":
    main()
