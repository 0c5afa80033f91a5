"""ZeRO-3 against FSDP2, side by side: the same LoRA recipe (the seed's targets, the planner's measured shape,
``moe_plugin.testing.plan_measure.layout_recipe``) at EP 2 on 4 processes through the product's ``Trainer``,
once with ``parallel.sharding: "zero3"`` (the ZeRO-3 config the plan measures: the shipped one with a 1 M-element
gradient bucket) and once with ``"fsdp2"``, in one launch.

Printed per engine: the median seconds of a timed optimizer step (after one warm-up step; the slowest rank's
time, every rank's step ends with the step's all-reduce; each engine timed twice, in the order zero3, fsdp2,
fsdp2, zero3) and the tokens/s it gives (4 ranks x 2 rows x T
tokens a step), and the largest per-rank peak of tensor bytes over two steps (``torch.profiler``'s allocator
events, ``plan_measure.measure_worker``); then FSDP2's tokens/s and peak as ratios of ZeRO-3's (goal: tokens/s
>= 1.0x at a peak <= 1.0x).

``python -m benchmarks.sharding`` (a few minutes here); ``--seq-len`` and ``--steps`` to change T and the timed
steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from .harness import machine_line

WORLD, EP, ROWS = 4, 2, 2  # ROWS: layout_recipe's micro-batch a rank
ENGINES = ("zero3", "fsdp2")


def recipe(output_dir: str, sharding: str, seq_len: int, steps: int, ds_config: str) -> dict:
    from moe_plugin.testing.plan_measure import layout_recipe

    values = layout_recipe(output_dir, WORLD, EP, seq_len, steps=steps, ds_config=ds_config)
    values["parallel"]["sharding"] = sharding
    if sharding != "zero3":
        values["deepspeed"] = None  # FSDP2 reads the recipe's parallel and schedule sections only
    return values


def timing_worker(recipes: list) -> list:
    """Per recipe: this rank's seconds of each optimizer step after the first (the warm-up)."""
    import torch

    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import Trainer

    torch.set_num_threads(1)
    out = []
    for values in recipes:
        with Trainer(recipe_from_dict(values)) as trainer:
            trainer.train_step()
            seconds = []
            for _ in range(values["schedule"]["steps"] - 1):
                start = time.perf_counter()
                trainer.train_step()  # ends with the step loss's all-reduce: the ranks leave it together
                seconds.append(time.perf_counter() - start)
        out.append(seconds)
    return out


def main(argv=None) -> None:
    from moe_plugin.testing.launch import run_distributed
    from moe_plugin.testing.plan_measure import measured_ds_config

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps an engine (after a warm-up)")
    args = parser.parse_args(argv)
    print(machine_line(1))
    with tempfile.TemporaryDirectory() as tmp:
        ds = measured_ds_config(tmp)

        def recipes(tag: str, steps: int) -> list:
            return [recipe(f"{tmp}/{tag}-{name}", name, args.seq_len, steps, ds) for name in ENGINES]

        # timed in the order zero3, fsdp2, fsdp2, zero3: a load on the shared machine that rises or falls during
        # the run weighs on both engines alike
        timed = recipes("t", args.steps + 1)
        times = run_distributed(
            "benchmarks.sharding:timing_worker", world_size=WORLD, timeout_s=3000, recipes=timed + timed[::-1]
        )
        peaks = run_distributed(
            "moe_plugin.testing.plan_measure:measure_worker", world_size=WORLD, timeout_s=3000, recipes=recipes("m", 2)
        )
    tokens = WORLD * ROWS * args.seq_len
    rate, peak = {}, {}
    for i, name in enumerate(ENGINES):
        runs = (i, 2 * len(ENGINES) - 1 - i)  # the engine's two places in the timed order
        step = statistics.median(max(rank[r][s] for rank in times) for r in runs for s in range(args.steps))
        rate[name], peak[name] = tokens / step, max(rank[i]["peak_bytes"] for rank in peaks)
        print(
            f"sharding {name}, the plan's measured shape, EP {EP} on {WORLD} processes, LoRA r 8, T {args.seq_len}: "
            f"{step:.3f} s a step, {rate[name]:,.0f} tokens/s, per-rank peak {peak[name] / 2**20:,.1f} MiB, "
            f"last loss {peaks[0][i]['loss']:.4f}"
        )
    print(
        f"sharding fsdp2 / zero3, EP {EP} on {WORLD} processes: tokens/s {rate['fsdp2'] / rate['zero3']:.2f}x "
        f"(goal >= 1.0), per-rank peak {peak['fsdp2'] / peak['zero3']:.2f}x (goal <= 1.0)"
    )


if __name__ == "__main__":
    main()
