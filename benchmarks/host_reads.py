"""Host reads (device-to-host waits) per training step, per layer kind, on the tiny preset through the product's
``Trainer``: 1 process (EP 1, no ZeRO) and EP 2 x ZeRO-3 on 2 processes, megatron backend both.

What counts and how a read is attributed to a layer kind: ``moe_plugin/training/metrics/host_reads.py``. The
counter is a debug mode, so steps are not timed here. A warm-up step runs first (uncounted), then ``--steps``
counted steps; printed: the mean reads per step per kind (rank 0; every rank's total too under EP 2), then
the sites of the reads (``path:line`` of the innermost moe_plugin frame) with their counts per step.
Goal (issue 24): 0 in kda, mla, dsa, norm, attn_res; at most one per MoE layer, none without EP.

``python -m benchmarks.host_reads`` (a minute or two here); ``--steps N`` for more counted steps.
"""

from __future__ import annotations

import argparse
import tempfile

from .harness import machine_line

SEQ = 128


def recipe(output_dir: str, world: int, ep: int, steps: int) -> dict:
    return {
        "output_dir": output_dir,
        "seed": 0,
        "deepspeed": "ds_configs/zero3_lora.json" if world > 1 else None,
        "model": {"preset": "tiny"},
        "lora": {"r": 8, "alpha": 16},
        "data": {"kind": "arithmetic", "num_documents": 200, "seq_len": SEQ, "eval_fraction": 0.0},
        "parallel": {"backend": "megatron", "expert_parallel_size": ep},
        "schedule": {"steps": steps, "micro_batch_size": 2 // world, "lr": 1e-3},
        "checkpoint": {"every": 0},
        "logging": {"every": 1, "progress_bar": False},
    }


def worker(recipe_dict: dict, steps: int) -> dict:
    import torch

    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import Trainer
    from moe_plugin.training.metrics.host_reads import count_host_reads

    torch.set_num_threads(1)
    with Trainer(recipe_from_dict(recipe_dict)) as trainer:
        trainer.train_step()  # warm-up: first-call work is not a step's
        with count_host_reads(trainer.engine.module) as counts:
            for _ in range(steps):
                trainer.train_step()
    sites = {f"{kind} {call} {site}": n / steps for (kind, call, site), n in sorted(counts.by_site.items())}
    return {"per_kind": {k: n / steps for k, n in counts.per_kind().items()}, "sites": sites}


def _line(label: str, per_kind: dict) -> str:
    kinds = ", ".join(f"{k} {n:g}" for k, n in per_kind.items())
    return f"{label}: host reads per step: {kinds}; total {sum(per_kind.values()):g}"


def main(argv=None) -> None:
    from moe_plugin.testing.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-ep", action="store_true", help="only the 1-process layout")
    args = parser.parse_args(argv)
    print(machine_line(1))
    layouts = [("1 process, EP 1", 1, 1)] + ([] if args.no_ep else [("2 processes, EP 2 x ZeRO-3", 2, 2)])
    with tempfile.TemporaryDirectory() as tmp:
        for label, world, ep in layouts:
            results = run_distributed(
                "benchmarks.host_reads:worker",
                world_size=world,
                timeout_s=1200,
                recipe_dict=recipe(f"{tmp}/w{world}", world, ep, args.steps + 1),
                steps=args.steps,
            )
            head = f"tiny preset, {label}, LoRA r=8, {2 // world} x {SEQ} tokens a rank, rank 0"
            print(_line(head, results[0]["per_kind"]))
            if world > 1:
                totals = ", ".join(f"rank {r} {sum(res['per_kind'].values()):g}" for r, res in enumerate(results))
                print(f"tiny preset, {label}: total host reads per step by rank: {totals}")
            for site, n in results[0]["sites"].items():
                print(f"  {label}, rank 0: {n:g} per step: {site}")


if __name__ == "__main__":
    main()
