"""Context parallelism, side by side: the tiny preset at T = 16 k tokens through the product's ``Trainer`` at CP 1
(one process) against CP 2 and CP 4 (2 and 4 processes on this machine).

Printed per layout: the per-rank peak of tensor bytes over two LoRA steps (``torch.profiler``'s allocator events,
``moe_plugin.testing.plan_measure.tensor_peak``; the largest rank) and its ratio to CP 1's (goal <= 0.6 at CP 2,
<= 0.35 at CP 4); then, per layer kind, the bytes each rank sends per layer per step through the context group
(its contribution to each all-gather times the peers it reaches, forward and backward) against the bytes of the
layer's activations on the rank (its input slice, ``T / CP x hidden`` fp32), at T = 16 k and T = 8 k, so that
whether the KDA exchange grows with T can be read off (goal: it does not).

``python -m benchmarks.context_parallel`` (a few minutes here); ``--seq-len`` to change T.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from typing import Optional

from .harness import machine_line

KINDS = (("gated_dsa", "mla"), ("kda", "kda"), ("conv", "kda"))


def recipe(output_dir: str, world: int, cp: int, seq_len: int, ds_config: Optional[str] = None) -> dict:
    """``ds_config``: the DeepSpeed config of a multi-process run (``plan_measure.measured_ds_config``: the shipped
    ZeRO-3 config with a 1 M-element gradient bucket; the default 5e8-element bucket, 1.9 GiB in fp32, would be
    most of a rank's peak at this size and hide what context parallelism changes)."""
    return {
        "output_dir": output_dir,
        "seed": 0,
        "deepspeed": ds_config if world > 1 else None,
        "model": {"preset": "tiny", "overrides": {"attn_res": False}},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "gate"]},
        "data": {"kind": "arithmetic", "num_documents": 3000, "seq_len": seq_len, "eval_fraction": 0.0},
        "parallel": {"backend": "megatron", "context_parallel_size": cp},
        "schedule": {"steps": 2, "micro_batch_size": 1, "lr": 1e-3, "decay": "constant"},
        "checkpoint": {"every": 0},
        "logging": {"every": 1000, "progress_bar": False, "wandb": {"mode": "disabled"}},
    }


def _kind_of_caller() -> str:
    """The layer kind of the innermost frame of the project's layers or ops that called the gather."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}moe_plugin{os.sep}" in path and f"{os.sep}parallel{os.sep}" not in path:
            name = os.path.basename(path)
            for key, kind in KINDS:
                if key in name:
                    return kind
        frame = frame.f_back
    return "other"


def counting_worker(recipe_dict: dict, seq_lens: list) -> dict:
    """Per kind, the bytes this rank contributes to the context group's all-gathers in one training step,
    forward and backward, times the peers it reaches; at each T of ``seq_lens``."""
    import torch
    import torch.distributed as dist

    from moe_plugin.parallel import context_parallel
    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.training.loop import Trainer

    torch.set_num_threads(1)
    real, sent = context_parallel.all_gather, collections.Counter()

    def counted(x, group=None):
        peers = dist.get_world_size(group) - 1
        # forward: x goes to every peer; backward (when x needs a gradient): a ring all-reduce of the stacked
        # [size, *x.shape] gradient sends 2 x (size - 1) / size of it, i.e. 2 x peers copies of x
        sent[_kind_of_caller()] += x.numel() * x.element_size() * peers * (3 if x.requires_grad else 1)
        return real(x, group)

    out = {}
    context_parallel.all_gather = counted
    try:
        for seq_len in seq_lens:
            values = dict(recipe_dict, data=dict(recipe_dict["data"], seq_len=seq_len))
            values["output_dir"] = f"{recipe_dict['output_dir']}-{seq_len}"
            with Trainer(recipe_from_dict(values)) as trainer:
                trainer.train_step()  # warm-up
                sent.clear()
                trainer.train_step()
                layers = collections.Counter(trainer.model_config.layer_types)
            out[seq_len] = {kind: sent[kind] / max(layers.get(kind, 1), 1) for kind in sent}
    finally:
        context_parallel.all_gather = real
    return out


def main(argv=None) -> None:
    from moe_plugin.testing.launch import run_distributed
    from moe_plugin.testing.plan_measure import measured_ds_config

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=16384)
    args = parser.parse_args(argv)
    T = args.seq_len
    print(machine_line(1))
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (1, 2, 4):
            ranks = run_distributed(
                "moe_plugin.testing.plan_measure:measure_worker",
                world_size=cp,
                timeout_s=3000,
                recipes=[recipe(f"{tmp}/cp{cp}", cp, cp, T, measured_ds_config(tmp))],
            )
            peaks[cp] = max(r[0]["peak_bytes"] for r in ranks)
            losses = [r[0]["loss"] for r in ranks]
            print(
                f"context parallel CP {cp} ({cp} process{'es' * (cp > 1)}), tiny preset, T {T:,}: per-rank peak "
                f"{peaks[cp] / 2**20:,.1f} MiB, ratio to CP 1 {peaks[cp] / peaks[1]:.2f}"
                + {1: "", 2: " (goal <= 0.6)", 4: " (goal <= 0.35)"}[cp]
                + f", last loss {losses[0]:.4f}"
            )
        hidden = 64  # the tiny preset's
        for cp in (2, 4):
            counts = run_distributed(
                "benchmarks.context_parallel:counting_worker",
                world_size=cp,
                timeout_s=3000,
                recipe_dict=recipe(f"{tmp}/count{cp}", cp, cp, T, measured_ds_config(tmp)),
                seq_lens=[T // 2, T],
            )[cp - 1]  # the last rank: it holds keys for the whole row
            for kind in ("kda", "mla"):
                sent = [counts[t].get(kind, 0.0) for t in (T // 2, T)]
                acts = [t // cp * hidden * 4 for t in (T // 2, T)]
                print(
                    f"context parallel CP {cp}, {kind} layer, bytes sent a rank a step: T {T // 2:,} {sent[0]:,.0f} "
                    f"({sent[0] / acts[0]:.3f} of its activations), T {T:,} {sent[1]:,.0f} "
                    f"({sent[1] / acts[1]:.3f}); T doubled: x{sent[1] / max(sent[0], 1):.2f}"
                )


if __name__ == "__main__":
    main()
