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


def kda_held_worker(length: int = 2048, heads: int = 4, dim: int = 64) -> dict:
    """One KDA layer's op on this rank's slice of ``length`` tokens of a one-document row, under the group's
    context parallelism: the bytes its autograd graph saves for the backward (``saved_tensors_hooks``, each
    storage once), and how many of them are the exchange's (the whole saved set minus the same op's on a
    one-rank context of the same slice, which exchanges nothing)."""
    import torch
    import torch.distributed as dist

    from moe_plugin.ops.context import ContextSlice
    from moe_plugin.ops.kda.context_parallel import chunk_kda_context
    from moe_plugin.parallel.context_parallel import context_slice

    def saved_bytes_of(fn) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return sum(storages.values())

    def alone(total):
        return ContextSlice(rank=0, size=1, total=total, offsets=(0, total), gather=lambda x: x.unsqueeze(0))

    size = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, length, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    gate = -torch.rand(1, length, heads, dim, generator=g).requires_grad_(True)
    beta = torch.rand(1, length, heads, generator=g).requires_grad_(True)
    args = (q, k, v, gate, beta)
    held = saved_bytes_of(lambda: chunk_kda_context(*args, context_slice(size * length), use_qk_l2norm_in_kernel=True))
    alone_bytes = saved_bytes_of(lambda: chunk_kda_context(*args, alone(length), use_qk_l2norm_in_kernel=True))
    return {"held": held, "exchange": held - alone_bytes}


def kda_held_lines() -> list:
    """KDA's bytes held a rank for the backward at CP 2 and CP 4, the same slice a rank (goal: independent of
    CP)."""
    from moe_plugin.testing.launch import run_distributed

    # the row's last rank: the same role at any CP (its document began before it, none goes on past it)
    held = {
        cp: run_distributed("benchmarks.context_parallel:kda_held_worker", world_size=cp, timeout_s=600)[-1]
        for cp in (2, 4)
    }
    line = (
        f"context parallel KDA (4 heads x 64, 2,048 tokens a rank, one document): bytes the op holds for the "
        f"backward on the row's last rank: CP 2 {held[2]['held']:,}, CP 4 {held[4]['held']:,}; CP 4 / CP 2 "
        f"{held[4]['held'] / held[2]['held']:.2f} (goal 1.00: independent of CP; beyond a one-rank context's "
        f"{held[2]['held'] - held[2]['exchange']:,}: its entering state and the slice's scan from it)"
    )
    print(line)
    return [line]


MLA_PATHS = {
    # name -> (head-parallel where it can, keys expanded at a time: None = the layer's chunk, the queries re-laid out)
    "head-parallel": (True, None, False),
    "whole-row expansion": (False, "row", False),
    "blockwise": (False, None, True),
}


def mla_worker(lengths: list, paths: list, indexer: bool, heads: int = 8) -> dict:
    """A gated MLA layer (K3's kind, shrunk: 8 heads of 40 + 32 dims over a 32 + 8 latent; with ``indexer`` the
    DSA indexer, 4 heads of 16, top-256, attention sparse) on this rank's slice of a one-document row under the
    group's context parallelism, along each of ``paths`` (``MLA_PATHS``: head-parallel; the gathered latent with
    the keys and values of the row up to the slice's end expanded at once on contiguous slices, as before the
    blockwise path; the blockwise path with its queries re-laid out), per row length: the layer's forward and
    backward peak of tensor bytes on this rank (``torch.profiler``), and this rank's attention alone, forward
    and backward, timed with the other ranks idle (each rank in turn)."""
    import time

    import torch
    import torch.distributed as dist

    from moe_plugin.config import MLAConfig
    from moe_plugin.layers import gated_dsa
    from moe_plugin.ops.context import ContextSlice
    from moe_plugin.parallel.context_parallel import context_slice
    from moe_plugin.testing.plan_measure import tensor_peak

    config = MLAConfig(
        hidden_size=64, num_heads=heads, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=8, v_head_dim=32, use_indexer=indexer, index_topk=256, index_n_heads=4, index_head_dim=16,
    )  # fmt: skip
    rank, size = dist.get_rank(), dist.get_world_size()
    chosen, balanced = gated_dsa.heads_parallel, ContextSlice.balanced
    ops = {name: getattr(gated_dsa, name) for name in ("dense_causal_attention", "latent_attention")}
    out = {}
    for total in lengths:
        for path in paths:
            by_heads, chunk, relaid = MLA_PATHS[path]
            torch.manual_seed(0)
            layer = gated_dsa.GatedMLAAttention(config)
            if chunk == "row":
                layer.context_key_chunk = total
            x = torch.randn(1, total // size, 64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
            calls = []
            for name, op in ops.items():
                setattr(gated_dsa, name, lambda *a, op=op, calls=calls, **k: calls.append((op, a, k)) or op(*a, **k))
            gated_dsa.heads_parallel = chosen if by_heads else (lambda *a: False)
            ContextSlice.balanced = balanced if relaid else property(lambda self: False)
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
                    layer(x, context=context_slice(total)).square().sum().backward()
            finally:
                for name, op in ops.items():
                    setattr(gated_dsa, name, op)
                gated_dsa.heads_parallel, ContextSlice.balanced = chosen, balanced
            peak = tensor_peak(p.profiler.kineto_results.events())["all"]
            op, (q, keys, *rest), kwargs = calls[0]
            q, keys = (t.detach().clone().requires_grad_() for t in (q, keys))
            rest = [t.detach().clone().requires_grad_() if torch.is_tensor(t) and t.requires_grad else t for t in rest]
            seconds = 0.0
            for turn in range(size):
                dist.barrier()
                if turn == rank:
                    start = time.perf_counter()
                    op(q, keys, *rest, **kwargs).square().sum().backward()
                    seconds = time.perf_counter() - start
            out[f"{path} {total}"] = {"peak": peak, "seconds": seconds}
    return out


def mla_lines(lengths=(16384, 32768), cp: int = 4, indexer: bool = True) -> list:
    """Gated MLA at CP 4: the largest per-rank peak of the blockwise path against the whole-row expansion (goal
    <= 0.25), and the max / mean of the ranks' attention times (goal <= 1.1); without the indexer, head-parallel
    beside them."""
    from moe_plugin.testing.launch import run_distributed

    paths = ["whole-row expansion", "blockwise"] + ([] if indexer else ["head-parallel"])
    ranks = run_distributed(
        "benchmarks.context_parallel:mla_worker",
        world_size=cp,
        timeout_s=3000,
        lengths=list(lengths),
        paths=paths,
        indexer=indexer,
    )
    kind = "with the indexer (top-256)" if indexer else "no indexer"
    lines = []
    for total in lengths:
        got = {path: [r[f"{path} {total}"] for r in ranks] for path in paths}
        peak = {path: max(r["peak"] for r in rs) for path, rs in got.items()}
        balance = {
            path: max(r["seconds"] for r in rs) / (sum(r["seconds"] for r in rs) / cp) for path, rs in got.items()
        }
        lines.append(
            f"context parallel gated MLA (8 heads, {kind}), CP {cp}, T {total:,}: largest per-rank peak "
            + ", ".join(f"{path} {peak[path] / 2**20:,.1f} MiB" for path in paths)
            + f"; blockwise / whole-row {peak['blockwise'] / peak['whole-row expansion']:.2f} (goal <= 0.25); "
            + "attention time max/mean over the ranks: "
            + ", ".join(f"{path} {balance[path]:.2f}" for path in paths)
            + " (goal <= 1.1)"
        )
        print(lines[-1])
    return lines


def main(argv=None) -> None:
    from moe_plugin.testing.launch import run_distributed
    from moe_plugin.testing.plan_measure import measured_ds_config

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--kda-only", action="store_true", help="only KDA's bytes held at CP 2 and 4 (seconds)")
    parser.add_argument("--mla-only", action="store_true", help="only gated MLA's peak and balance at CP 4")
    parser.add_argument(
        "--no-indexer", action="store_true", help="with --mla-only: gated MLA without the indexer (head-parallel too)"
    )
    args = parser.parse_args(argv)
    if args.kda_only:
        kda_held_lines()
        return
    if args.mla_only:
        print(machine_line(1))
        mla_lines(indexer=not args.no_indexer)
        return
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
