"""The trainer, side by side: EP=2 x ZeRO-3 on 4 processes against EP=1 without ZeRO in 1 process (both cores).

Both layouts run the same recipe (LoRA on the seed's targets and every routed expert; the same global batch;
a checkpoint base, which ZeRO-3 builds partitioned) through the product's ``Trainer`` on a model whose weights
dominate a process's memory (about 20 M parameters, most of them routed experts). Printed: the aggregate tokens/s of all
ranks and their ratio (goal >= 0.6 on this 2-core machine), the peak RSS increase of one EP=2 x ZeRO-3 rank over its
baseline against the one process's (goal <= 0.4), and the start-up time apart from the step time.

``python -m benchmarks.trainer`` (about ten minutes here); ``--steps N`` to change the timed steps.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from .harness import _status_kib, machine_line

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    layer_types=["kda", "kda", "kda", "mla"],
    attn_res=False,
    num_experts=64,
    num_experts_per_token=4,
    moe_intermediate_size=256,
    routed_expert_hidden_size=128,
    intermediate_size=512,
    index_topk=256,
    linear_attn_config=dict(
        num_heads=4,
        head_dim=64,
        short_conv_kernel_size=4,
        gate_lower_bound=-5.0,
        gate_form="k3",
        gate_rank=32,
        chunk_size=64,
    ),
)


def save_base(path: str) -> None:
    """The checkpoint base both layouts load: the model and its tokenizer (a base must bring one; the preset's
    ids are the byte tokenizer's)."""
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.models.tokenizer import ByteTokenizer

    MoEPluginForCausalLM(preset_config("tiny", **SHAPE)).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)


def recipe(output_dir: str, base: str, world: int, ep: int, steps: int) -> dict:
    return {
        "output_dir": output_dir,
        "seed": 0,
        "deepspeed": "ds_configs/zero3_lora.json" if world > 1 else None,
        "model": {"from_pretrained": base},
        "lora": {"r": 8, "alpha": 16, "target_parameters": ["experts.w1", "experts.w2", "experts.w3"]},
        "data": {"kind": "arithmetic", "num_documents": 2000, "seq_len": 256, "eval_fraction": 0.0},
        "parallel": {"backend": "megatron", "expert_parallel_size": ep},
        "schedule": {"steps": steps, "micro_batch_size": 4 // world, "lr": 1e-3},
        "checkpoint": {"every": 0},
        "logging": {"every": 1000, "progress_bar": False},
    }


def worker(recipe_dict: dict, threads: int) -> dict:
    import torch

    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    torch.set_num_threads(threads)
    baseline = _status_kib("VmRSS")
    started = time.perf_counter()
    with Trainer(recipe_from_dict(recipe_dict)) as trainer:
        startup = time.perf_counter() - started
        trainer.train_step()  # warm-up, not timed
        clock = time.perf_counter()
        steps = recipe_dict["schedule"]["steps"] - 1
        for _ in range(steps):
            trainer.train_step()
        step_s = (time.perf_counter() - clock) / steps
        loss = trainer.result.losses[-1]
    return {
        "startup_s": startup,
        "step_s": step_s,
        "peak_increase_mib": (_status_kib("VmHWM") - baseline) / 1024,
        "loss": loss,
    }


def main(argv=None) -> None:
    from moe_plugin.testing.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    tokens = 4 * 256  # global tokens per step in both layouts
    print(machine_line(2))
    with tempfile.TemporaryDirectory() as tmp:
        # a checkpoint base, as a real run has: under ZeRO-3 it is built partitioned and each rank streams
        # only its slices (a preset would be drawn whole on every rank first)
        save_base(f"{tmp}/base")
        one = run_distributed(
            "benchmarks.trainer:worker",
            world_size=1,
            timeout_s=3000,
            recipe_dict=recipe(f"{tmp}/one", f"{tmp}/base", 1, 1, args.steps + 1),
            threads=2,
        )[0]
        four = run_distributed(
            "benchmarks.trainer:worker",
            world_size=4,
            timeout_s=3000,
            recipe_dict=recipe(f"{tmp}/four", f"{tmp}/base", 4, 2, args.steps + 1),
            threads=1,
        )
    step4 = max(r["step_s"] for r in four)
    rss4 = max(r["peak_increase_mib"] for r in four)
    print(
        f"trainer EP=1 no ZeRO, 1 process x 2 threads: start-up {one['startup_s']:.1f} s, {one['step_s']:.3f} "
        f"s/step, {tokens / one['step_s']:,.0f} tokens/s, peak RSS +{one['peak_increase_mib']:.0f} MiB"
    )
    print(
        f"trainer EP=2 x ZeRO-3, 4 processes x 1 thread: start-up {max(r['startup_s'] for r in four):.1f} s, "
        f"{step4:.3f} s/step, {tokens / step4:,.0f} tokens/s (all ranks), peak RSS +{rss4:.0f} MiB a rank"
    )
    print(
        f"ratio EP=2 x ZeRO-3 / EP=1 aggregate throughput: {one['step_s'] / step4:.2f} (goal >= 0.6); "
        f"peak RSS increase a rank / one process: {rss4 / one['peak_increase_mib']:.2f} (goal <= 0.4); "
        f"final losses {one['loss']:.4f} vs {four[0]['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
