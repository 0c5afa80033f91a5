"""``moe-plugin plan --recipe R [--devices N --device-memory 141GB --micro-batch B --seq-len T
--checkpointing off|selective|full --expert-format dense|mxfp4|int4 --capacity 1.25 --images N --image-size PX
--kernels gpu|cpu --from-checkpoint --context-parallel N|auto --json]``
(docs/planner.md). A bad input is one line on stderr and exit status 2 (``--debug``: with its traceback); each
size has a largest value it accepts (``planner.LIMITS``), named when it is refused."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

from ..cli_errors import ArgumentParser, run_command

__all__ = ["main", "format_plan"]


def _gb(x: float) -> str:
    return f"{x / 1e9:10.2f} GB"


def format_plan(plan) -> str:
    """The plain-text table of ``plan`` (a ``Plan``)."""
    m, L = plan.memory, plan.layout
    rows = [
        f"plan: {plan.recipe or 'recipe'}",
        f"layout: {L.devices} devices, EP {L.ep} (expert-data-parallel {L.devices // L.ep}), "
        + (
            f"context parallel {L.context} ({L.seq_len // L.context:,} tokens a rank; data-parallel "
            f"{L.devices // L.context}, sharded over data x context), "
            if L.context > 1
            else ""
        )
        + (
            f"FSDP2 (reshard after forward {str(L.reshard_after_forward).lower()}), "
            if L.sharding == "fsdp2"
            else f"ZeRO-3 {'on' if L.zero3 else 'off'}, "
        )
        + f"micro-batch {L.micro_batch} x {L.seq_len} tokens, "
        f"accumulation {L.grad_accum}, activation checkpointing {L.checkpointing}, "
        f"{'bf16' if L.precision_bytes == 2 else 'fp32'}, capacity factor {L.capacity}"
        + (f", {L.images} pictures of {L.image_size} px per micro-batch" if L.images else "")
        + f", {L.kernels.upper()} kernels",
        "",
        "per-device memory                                 bytes",
    ]
    for term, v in m.terms().items():
        rows.append(f"  {term:<48}{_gb(v)}")
    rows += [
        f"  step peak                                       {_gb(m.step_peak + m.overhead)}",
    ]
    if m.build_peak:
        rows.append(f"  build peak (preset base built whole per rank)   {_gb(m.build_peak + m.overhead)}")
    rows.append(f"  PEAK                                            {_gb(m.peak)}")
    if plan.device_memory:
        verdict = "fits" if plan.fits else "does NOT fit"
        rows.append(f"  device memory {plan.device_memory / 1e9:.0f} GB: {verdict}")
    if plan.modes:
        rows.append(
            "activation checkpointing (schedule.activation_checkpointing; what each keeps: "
            "moe_plugin/layers/recompute.py), PEAK per mode:"
        )
        for mode, peak in plan.modes.items():
            fits = "" if not plan.device_memory else ("  fits" if peak <= plan.device_memory else "  does NOT fit")
            rows.append(f"  {mode:<46}{_gb(peak)}{fits}")
        if plan.device_memory:
            fitting = [mode for mode, peak in plan.modes.items() if peak <= plan.device_memory]
            rows.append(f"  modes that fit: {', '.join(fitting) if fitting else 'none'}")
    for k, v in plan.context_exchange.items():
        rows.append(f"  context parallel: {k:<28}{_gb(v)}")
    if plan.context_search:
        from .context_parallel import describe_search

        cs = plan.context_search
        rows.append(describe_search(cs, cs["seq_len"], plan.layout.devices, cs["modes"], cs["device_memory"]))
    all_to_all_gb = plan.all_to_all_bytes_per_layer_step / 1e9
    rows += [
        "",
        f"tokens per step {plan.tokens_per_step:,}; FLOPs per step {plan.flops_per_step:.3e}; "
        f"all-to-all bytes per MoE layer per step per rank {all_to_all_gb:.3f} GB",
        f"1M-token context (micro-batch 1{f', CP {L.context}' if L.context > 1 else ''}):",
    ]
    for k, v in plan.million_context.items():
        rows.append(f"  {k:<46}{_gb(v)}")
    if plan.knobs:
        rows.append("knobs (peak saved; negative: costs more):")
        for k, v in plan.knobs.items():
            rows.append(f"  {k:<46}{_gb(v)}")
    if plan.min_devices is not None or plan.device_memory:
        rows.append(f"smallest device count that fits: {plan.min_devices if plan.min_devices else 'none up to 8192'}")
    rows.append("saved for backward by one layer of each kind (meta forward, no AttnRes mixing):")
    for k, v in plan.kinds_per_layer.items():
        rows.append(f"  {k:<46}{_gb(v)}")
    return "\n".join(rows)


def _plan(argv: List[str]) -> int:
    from ..config import require
    from ..recipe.schema import load_recipe
    from ..limits import check_limit, parse_bytes

    p = ArgumentParser(prog="moe-plugin plan", description=__doc__)
    p.add_argument("--recipe", required=True)
    p.add_argument("--devices", type=int)
    p.add_argument("--device-memory")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument(
        "--checkpointing",
        choices=["off", "selective", "full", "full_routing"],
        help="activation checkpointing to plan (default: the recipe's schedule.activation_checkpointing)",
    )
    p.add_argument("--expert-format", choices=["dense", "mxfp4", "int4"])
    p.add_argument(
        "--capacity",
        type=float,
        help="the dispatch's capacity factor (default: the recipe's "
        "parallel.capacity_factor, 1.25 unless it says otherwise)",
    )
    p.add_argument(
        "--images",
        type=int,
        help="pictures per micro-batch (default: one per row when the recipe trains on images, else none)",
    )
    p.add_argument("--image-size", type=int, default=896, help="side of each square picture in pixels")
    p.add_argument(
        "--kernels",
        choices=["gpu", "cpu"],
        default="gpu",
        help="whose saved sets to plan: the GPU kernels CUDA picks (default) or the CPU's torch paths",
    )
    p.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="plan the base as loaded from a checkpoint (streamed per rank), not built from the preset",
    )
    p.add_argument(
        "--context-parallel",
        help="ranks splitting each row (default: the recipe's parallel.context_parallel_size), or 'auto': the "
        "smallest power of two dividing --devices and the row at which the plan fits --device-memory",
    )
    p.add_argument(
        "--sharding",
        choices=["zero3", "fsdp2"],
        help="the engine that shards the model (default: the recipe's parallel.sharding)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    require(
        os.path.isfile(args.recipe),
        "--recipe",
        f"{args.recipe!r} is not a file; give a recipe JSON, e.g. recipes/k3_seed_layout.json",
    )
    # the sizes' ranges are checked before the recipe is read (plan_recipe checks them again, with the recipe's
    # own), so an absurd flag is refused at once
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    for name, flag, least in (
        ("devices", "--devices", 1),
        ("micro_batch", "--micro-batch", 1),
        ("seq_len", "--seq-len", 2),
        ("images", "--images", 0),
        ("image_size", "--image-size", 1),
        ("capacity", "--capacity", 1),
    ):
        value = getattr(args, name)
        if value is not None:
            check_limit(value, name, flag, least)
    cp = args.context_parallel
    if cp is not None and cp != "auto":
        require(
            cp.isdigit() and int(cp) >= 1,
            "--context-parallel",
            f"must be a positive whole number of ranks or 'auto', got {cp!r}; e.g. --context-parallel 8",
        )
        cp = int(cp)
        check_limit(cp, "devices", "--context-parallel")
    recipe = load_recipe(args.recipe)
    from .planner import plan_recipe  # torch: only for a valid recipe

    plan = plan_recipe(
        recipe,
        devices=args.devices,
        device_memory=memory,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        checkpointing=args.checkpointing,
        expert_format=args.expert_format,
        capacity=args.capacity,
        knobs=cp != "auto",  # auto plans many CP sizes already: no knobs on top
        images=args.images,
        image_size=args.image_size,
        kernels=args.kernels,
        from_checkpoint=args.from_checkpoint,
        context_parallel=cp,
        sharding=args.sharding,
    )
    plan.recipe = args.recipe
    print(json.dumps(plan.to_dict(), indent=1, default=str) if args.json else format_plan(plan))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``moe-plugin plan`` with ``argv`` (default: the command line); the exit status (2: a bad input, in
    one line on stderr; ``--debug`` shows its traceback)."""
    return run_command("plan", _plan, argv)


if __name__ == "__main__":
    sys.exit(main())
