"""ZeRO-3's communication settings for the shipped ``ds_configs/zero3_lora.json``, chosen by measurement.

The layout is ``benchmarks/trainer.py``'s EP=2 x ZeRO-3 on 4 processes (its model, recipe and worker), run once
per candidate setting: ``overlap_comm``, the gradient ``reduce_bucket_size`` with the parameter
``stage3_prefetch_bucket_size``, and ``stage3_max_reuse_distance`` (0 frees every gathered parameter after its
use; the shipped 1e9 keeps a model this small gathered whole from the second step on). Each candidate is the
shipped config with those keys replaced, in its own launch, so the peak RSS (VmHWM over the rank's baseline) is
its own.

The machine is shared and its load moves (2.5x between the rounds of one run), so every number is a ratio to the
shipped config's run of the same round: the candidates run in rounds, in turn, the order reversed every other
round so that a steady drift in the load favours no candidate; the printed ratio is the median over the rounds.

Rule: among the candidates whose peak RSS a rank is not above the shipped config's (within 2 %) in any round and
whose tokens/s beats it in every round, the one with the best median tokens/s ratio; none such keeps the shipped
setting. Printed: one line per candidate (the ratios, round by round, and the final loss), then the choice.
(A first run of this sweep also had both buckets at 5e7 and at 1e7: tokens/s ratio 0.94-0.95, peak RSS 1.01-1.02.)

``python -m benchmarks.zero3_buckets`` (about 12 minutes on 2 cores); ``--rounds``, ``--steps``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

from .harness import machine_line
from .trainer import recipe, save_base

SHIPPED = "ds_configs/zero3_lora.json"
M = 1_000_000
# (name, zero_optimization keys replaced in the shipped config); the first is the shipped config itself.
# overlap_comm only picks a side stream for the reduce and the gathers, and DeepSpeed's CPU accelerator has none
# (Stream() is None, stream() a no-op context): on this machine it is expected to measure as the shipped config.
CANDIDATES = [
    ("shipped", {}),
    ("overlap_comm true", {"overlap_comm": True}),
    ("buckets 1e6", {"reduce_bucket_size": 1 * M, "stage3_prefetch_bucket_size": 1 * M}),
    ("reduce 1e6", {"reduce_bucket_size": 1 * M}),
    ("prefetch 1e6", {"stage3_prefetch_bucket_size": 1 * M}),
    ("reuse distance 0", {"stage3_max_reuse_distance": 0}),
]
MEMORY_TOLERANCE = 0.02  # RSS within this of the shipped run's is not above it (glibc's high-water mark moves so)


def candidate_config(directory: str, name: str, keys: dict) -> str:
    """The shipped config with ``keys`` replaced in its ``zero_optimization``, written into ``directory``."""
    with open(SHIPPED) as f:
        values = json.load(f)
    values = copy.deepcopy(values)
    values["zero_optimization"].update(keys)
    path = os.path.join(directory, name.replace(" ", "_") + ".json")
    with open(path, "w") as f:
        json.dump(values, f, indent=2)
    return path


def run_candidate(tmp: str, base: str, config: str, steps: int) -> dict:
    """One launch of the 4-process layout on ``config``: the slowest rank's step time, the largest rank's peak."""
    from moe_plugin.testing.launch import run_distributed

    recipe_dict = recipe(tempfile.mkdtemp(dir=tmp), base, 4, 2, steps + 1)
    recipe_dict["deepspeed"] = config
    ranks = run_distributed(
        "benchmarks.trainer:worker", world_size=4, timeout_s=3000, recipe_dict=recipe_dict, threads=1
    )
    return {
        "step_s": max(r["step_s"] for r in ranks),  # a step ends when its slowest rank ends it
        "peak_mib": max(r["peak_increase_mib"] for r in ranks),
        "loss": ranks[0]["loss"],
    }


def choose(results: dict, tokens: int) -> tuple:
    """(chosen name, the lines to print) by the module's rule; ``results[name]`` is the list of its rounds."""
    ship = results["shipped"]
    lines, best, best_speed = [], "shipped", 1.0
    for name, _ in CANDIDATES:
        rounds = results[name]
        # paired with the shipped run of the same round: the load moves between rounds far more than within one
        speeds = [s["step_s"] / r["step_s"] for s, r in zip(ship, rounds)]
        memories = [r["peak_mib"] / s["peak_mib"] for s, r in zip(ship, rounds)]
        speed, memory = statistics.median(speeds), statistics.median(memories)
        step = statistics.median(r["step_s"] for r in rounds)
        peak = statistics.median(r["peak_mib"] for r in rounds)
        lines.append(
            f"{name:18s}: tokens/s ratio {speed:.3f} (rounds {' '.join(f'{x:.2f}' for x in speeds)}), peak RSS "
            f"ratio {memory:.3f} (rounds {' '.join(f'{x:.2f}' for x in memories)}); {tokens / step:,.0f} tokens/s "
            f"(all ranks), +{peak:.0f} MiB a rank; final loss {rounds[-1]['loss']:.4f}"
        )
        wins = min(speeds) > 1 and max(memories) <= 1 + MEMORY_TOLERANCE
        if name != "shipped" and wins and speed > best_speed:
            best, best_speed = name, speed
    return best, lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps a launch, after one untimed")
    args = parser.parse_args(argv)
    tokens = 4 * 256  # the global batch of benchmarks/trainer.py's recipe
    print(machine_line(1), f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        save_base(f"{tmp}/base")
        configs = {name: candidate_config(tmp, name, keys) for name, keys in CANDIDATES}
        results = {name: [] for name, _ in CANDIDATES}
        for round_ in range(args.rounds):
            order = CANDIDATES if round_ % 2 == 0 else CANDIDATES[::-1]
            for name, _ in order:
                results[name].append(run_candidate(tmp, f"{tmp}/base", configs[name], args.steps))
                r = results[name][-1]
                print(
                    f"  round {round_ + 1} {name}: {r['step_s']:.3f} s/step, +{r['peak_mib']:.0f} MiB",
                    flush=True,
                )
    best, lines = choose(results, tokens)
    print(
        f"EP=2 x ZeRO-3, 4 processes x 1 thread, {args.rounds} rounds x {args.steps} timed steps, ratios to the "
        f"shipped {SHIPPED} ({time.perf_counter() - started:.0f} s):"
    )
    for line in lines:
        print(line)
    print(f"chosen: {best} {dict(CANDIDATES)[best] or '(the shipped config unchanged)'}")


if __name__ == "__main__":
    main()
