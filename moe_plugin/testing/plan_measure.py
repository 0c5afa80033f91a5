"""The planner against measured runs: tiny layouts trained for real on the CPU through the product's
``Trainer`` (docs/planner.md, "Checked against measurements").

The checked number is a rank's peak of tensor bytes: ``torch.profiler`` with ``profile_memory=True`` reports
every allocation and free of the CPU allocator with its size, and the running sum of those events, from just
before the ``Trainer`` starts to the end of its last step, peaks at the bytes the run really held at once. It
counts neither glibc's retained heap pages (VmHWM's excess under ZeRO-3) nor leaves out allocated pages never
written (VmHWM's shortfall for KDA's chunk padding). VmHWM is not reported: the profiler's own records
(tens of MB a step) would be in it.
What is not the model (DeepSpeed's and megatron's own tensors) is planned as one measured constant: the first
layout of every launch is a calibration run of a model too small to matter, whose measured peak minus its
planned peak is the overhead for that launch's other layouts.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from typing import Dict, List, Optional

__all__ = [
    "SHAPE",
    "CALIBRATION",
    "LAYOUTS",
    "CHECKPOINTED",
    "MEASURED_REDUCE_BUCKET",
    "layout_recipe",
    "layout_recipes",
    "measured_layouts",
    "measure_worker",
    "measure_phases_worker",
    "planned_peak",
    "tensor_peak",
]

# weights of about 20 M parameters (most of them routed experts) and activations of the same order
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
    use_dsa_indexer=False,
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
CALIBRATION = dict(
    SHAPE,
    vocab_size=512,
    hidden_size=32,
    num_experts=8,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    intermediate_size=64,
    linear_attn_config=dict(SHAPE["linear_attn_config"], num_heads=1, head_dim=16, gate_rank=8),
)
# (world, EP, seq_len, expert format) of the layouts each launch runs after its calibration
LAYOUTS = {
    1: [(1, 1, 256, "dense"), (1, 1, 1024, "dense"), (1, 1, 512, "mxfp4")],
    2: [(2, 1, 512, "dense"), (2, 2, 256, "dense"), (2, 2, 1024, "mxfp4")],
    4: [(4, 2, 256, "dense"), (4, 2, 1024, "dense"), (4, 1, 512, "dense"), (4, 2, 512, "mxfp4")],
}
# activation checkpointing (schedule.activation_checkpointing): one layout per launch, with Attention Residuals
# (what "full" recomputes beyond "selective"), run in every mode after LAYOUTS
CHECKPOINTED_SHAPE = dict(SHAPE, attn_res=True, attn_res_block_size=2)
CHECKPOINTED = {1: (1, 1, 1024, "dense"), 2: (2, 2, 512, "mxfp4"), 4: (4, 2, 512, "dense")}
CHECKPOINTING_MODES = ("off", "selective", "full")
# The shipped ZeRO-3 config allocates DeepSpeed's default 5e8-element contiguous-gradient bucket (2 GB in
# fp32), which would be most of every measured peak and hide the rest of the plan; the measured layouts run
# that config with a bucket of 1 M elements, and the plan counts whatever the config says.
MEASURED_REDUCE_BUCKET = 1_000_000
SHIPPED_DS_CONFIG = "ds_configs/zero3_lora.json"


def measured_ds_config(directory: str) -> str:
    """``ds_configs/zero3_lora.json`` with ``reduce_bucket_size`` = ``MEASURED_REDUCE_BUCKET``, written into
    ``directory``; returns its path."""
    with open(SHIPPED_DS_CONFIG) as f:
        values = json.load(f)
    values["zero_optimization"]["reduce_bucket_size"] = MEASURED_REDUCE_BUCKET
    path = os.path.join(directory, "zero3_measured.json")
    with open(path, "w") as f:
        json.dump(values, f, indent=2)
    return path


def layout_recipe(
    output_dir: str,
    world: int,
    ep: int,
    seq_len: int,
    expert_format: str = "dense",
    shape: dict = SHAPE,
    steps: int = 2,
    ds_config: Optional[str] = SHIPPED_DS_CONFIG,
    checkpointing: str = "off",
    sharding: str = "zero3",
) -> dict:
    """A LoRA recipe on the seed's targets (one micro-batch of 2 rows per rank), fp32 as the CPU trains. Two
    steps: DeepSpeed records its module trace in the first and runs the second in the steady state (the
    trace complete: parameters kept gathered for reuse, prefetch on)."""
    return {
        "output_dir": output_dir,
        "seed": 0,
        "deepspeed": ds_config if world > 1 and sharding == "zero3" else None,
        "model": {"preset": "tiny", "overrides": dict(shape, expert_format=expert_format)},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "gate"]},
        "data": {"kind": "arithmetic", "num_documents": 400, "seq_len": seq_len, "eval_fraction": 0.0},
        "parallel": {"backend": "megatron", "expert_parallel_size": ep, "sharding": sharding},
        "schedule": {
            "steps": steps,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "decay": "constant",
            "activation_checkpointing": checkpointing,
        },
        "checkpoint": {"every": 0},
        "logging": {"every": 1000, "progress_bar": False, "wandb": {"mode": "disabled"}},
    }


# FSDP2 (parallel.sharding "fsdp2"): measured on 4 processes after their own calibration
FSDP2_LAYOUTS = [(4, 2, 512, "dense"), (4, 2, 1024, "mxfp4"), (4, 1, 512, "dense")]


def fsdp2_recipes(directory: str) -> List[dict]:
    """The FSDP2 calibration recipe, then those of ``FSDP2_LAYOUTS``, with outputs in ``directory``."""
    return [layout_recipe(f"{directory}/calibration", 4, 1, 256, shape=CALIBRATION, sharding="fsdp2")] + [
        layout_recipe(f"{directory}/l{i}", w, ep, seq, fmt, sharding="fsdp2")
        for i, (w, ep, seq, fmt) in enumerate(FSDP2_LAYOUTS)
    ]


def measured_layouts(world: int) -> List[tuple]:
    """``(world, EP, seq_len, expert format, checkpointing mode, shape)`` of each layout a launch of ``world``
    processes measures after its calibration: ``LAYOUTS[world]``, then ``CHECKPOINTED[world]`` in every mode."""
    return [layout + ("off", SHAPE) for layout in LAYOUTS[world]] + [
        CHECKPOINTED[world] + (mode, CHECKPOINTED_SHAPE) for mode in CHECKPOINTING_MODES
    ]


def layout_recipes(directory: str, world: int) -> List[dict]:
    """The calibration recipe, then those of ``measured_layouts(world)``, with outputs and the DeepSpeed config
    in ``directory``."""
    ds = measured_ds_config(directory) if world > 1 else None
    return [layout_recipe(f"{directory}/calibration", world, 1, 256, shape=CALIBRATION, ds_config=ds)] + [
        layout_recipe(f"{directory}/l{i}", w, ep, seq, fmt, shape=shape, ds_config=ds, checkpointing=mode)
        for i, (w, ep, seq, fmt, mode, shape) in enumerate(measured_layouts(world))
    ]


def _settle() -> None:
    gc.collect()
    try:  # hand the last layout's freed heap back before the next one starts
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def tensor_peak(events, names=()) -> Dict[str, float]:
    """The peak of the running sum of the CPU allocator's events (``torch.profiler``'s ``[memory]`` events:
    ``nbytes`` > 0 an allocation, < 0 a free), overall and within each user annotation (``record_function``)
    of ``names``; bytes above the sum before the first event."""
    memory, spans = [], []
    for e in events:
        if e.name() == "[memory]" and e.device_type().name == "CPU":
            memory.append((e.start_ns(), e.nbytes()))
        elif e.is_user_annotation() and e.name() in names:
            spans.append((e.name(), e.start_ns(), e.end_ns()))
    memory.sort()
    out = {"all": 0.0}
    total, times, sums = 0, [], []
    for t, n in memory:
        total += n
        times.append(t)
        sums.append(total)
        out["all"] = max(out["all"], float(total))
    for name, start, end in spans:
        inside = [s for t, s in zip(times, sums) if start <= t <= end]
        out[name] = max([out.get(name, 0.0)] + [float(s) for s in inside])
    return out


def measure_worker(recipes: List[dict], threads: int = 1, count_attention: bool = False) -> List[Dict[str, float]]:
    """Run each recipe's ``Trainer`` for its steps in this process under ``torch.profiler``; per recipe the
    peak of tensor bytes over the run (``peak_bytes``) and per phase (``phases``: build, step 1, ...).
    ``count_attention``: then one more step, outside the measured run, whose gated MLA layers' forward FLOPs on
    this rank are ``attention_flops`` (``_attention_flops``)."""
    import contextlib

    import deepspeed  # noqa: F401  imported before the baseline: imports are not the model
    import megatron.core  # noqa: F401
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..training.loop import Trainer
    from ..recipe.schema import recipe_from_dict

    torch.set_num_threads(threads)
    out = []
    for values in recipes:
        _settle()
        phases = ["build"] + [f"step {i + 1}" for i in range(values["schedule"]["steps"])]
        with contextlib.ExitStack() as stack:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with record_function(phases[0]):
                    trainer = Trainer(recipe_from_dict(values))
                stack.enter_context(trainer)
                for phase in phases[1:]:
                    with record_function(phase):
                        trainer.train_step()
                losses = [float(x) for x in trainer.result.losses]
            flops = _attention_flops(trainer) if count_attention else None
        peaks = tensor_peak(prof.profiler.kineto_results.events(), phases)
        out.append({"peak_bytes": peaks.pop("all"), "phases": peaks, "loss": losses[-1], "losses": losses})
        if flops is not None:
            out[-1]["attention_flops"] = flops
        del prof
        _settle()
    return out


def _attention_flops(trainer) -> float:
    """The FLOPs of one training step's gated MLA forwards on this rank: every op with a formula in
    ``torch.utils.flop_counter`` (the products) run while one of them is on the stack. Forward only (their
    backward repeats the same work): torch's ``FlopCounterMode`` tracks modules by hooks on their outputs' grad
    functions, which the chunked attention's autograd function has none of inside."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    module = trainer.engine.module
    mla = [i for i, kind in enumerate(trainer.model_config.layer_types) if kind == "mla"]
    ends = tuple(f"layers.{i}.self_attention" for i in mla)
    layers = [m for name, m in module.named_modules() if name.endswith(ends)]
    inside, total = [0], [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            formula = flop_registry.get(func._overloadpacket)
            if inside[0] and formula is not None:
                total[0] += formula(*args, **(kwargs or {}), out_val=out)
            return out

    hooks = [m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1)) for m in layers]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1)) for m in layers]
    try:
        with Count():
            trainer.train_step()
    finally:
        for hook in hooks:
            hook.remove()
    return float(total[0])


def measure_phases_worker(phases: List[dict]) -> List[Optional[List[Dict[str, float]]]]:
    """Several worlds' measurements in one launch: ``phases`` in order, each ``{"world": w, "recipes": [...],
    "threads": t}``, run by ranks ``0 .. w - 1`` as a world of its own (``measure_worker``); per phase this
    rank's results, or None where it takes no part.

    Launch it with ``init_process_group=False`` on the largest world: each phase starts its own process group
    from the environment set here (this rank, the phase's world size, a rendezvous file of the phase's own), its
    ``Trainer``s run in it as in a launch of that size, and it is destroyed before the next phase.
    """
    from ..parallel.distributed import INIT_METHOD_ENV, destroy_distributed, init_distributed

    launch_env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", INIT_METHOD_ENV)}
    rank = int(launch_env["RANK"])
    out: List[Optional[List[Dict[str, float]]]] = []
    try:
        for index, phase in enumerate(phases):
            if rank >= phase["world"]:
                out.append(None)
                continue
            os.environ.update(
                {
                    "WORLD_SIZE": str(phase["world"]),
                    "LOCAL_RANK": str(rank),
                    INIT_METHOD_ENV: f"{launch_env[INIT_METHOD_ENV]}-phase{index}",
                }
            )
            init_distributed("cpu")  # one group a phase, as run_distributed starts one for a launch of its size
            try:
                out.append(
                    measure_worker(phase["recipes"], phase.get("threads", 1), phase.get("count_attention", False))
                )
            finally:
                destroy_distributed()
    finally:
        for name, value in launch_env.items():
            if value is not None:
                os.environ[name] = value
    return out


def planned_peak(recipe_values: dict, world: int, cache: dict) -> float:
    """The planner's peak for one measured layout, without the overhead constant (bytes)."""
    from ..recipe.schema import recipe_from_dict
    from ..plan.planner import plan_recipe

    # the trainer drops no token: every expert computes exactly its rows, a capacity factor of 1
    plan = plan_recipe(
        recipe_from_dict(recipe_values), devices=world, overhead_bytes=0.0, cache=cache, capacity=1.0, summaries=False
    )
    return plan.memory.peak
