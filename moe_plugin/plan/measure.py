"""The planner against measured runs: tiny layouts trained for real on the CPU through the product's
``Trainer`` (docs/planner.md, "Checked against measurements").

A rank's measured peak is ``VmHWM`` minus ``VmRSS`` just before the ``Trainer`` starts, after the imports and
with the high-water mark reset (``/proc/self/clear_refs``), as ``benchmarks/harness.py`` measures (``pin_mmap``:
with glibc's mmap threshold pinned, the diagnosis of docs/planner.md). What is not the model (DeepSpeed's and megatron's own state, gloo's buffers, the allocator's slack) is planned as one
measured constant: the first layout of every launch is a calibration run of a model too small to matter,
whose measured peak minus its planned peak is the overhead for that launch's other layouts.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Dict, List

__all__ = ["SHAPE", "CALIBRATION", "layout_recipe", "measure_worker", "planned_peak", "LAYOUTS"]

# weights of about 20 M parameters (most of them routed experts) and activations of the same order
SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, layer_types=["kda", "kda", "kda", "mla"],
             attn_res=False, num_experts=64, num_experts_per_token=4, moe_intermediate_size=256,
             routed_expert_hidden_size=128, intermediate_size=512, index_topk=256, use_dsa_indexer=False,
             linear_attn_config=dict(num_heads=4, head_dim=64, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     gate_form="k3", gate_rank=32, chunk_size=64))
CALIBRATION = dict(SHAPE, vocab_size=512, hidden_size=32, num_experts=8, moe_intermediate_size=32,
                   routed_expert_hidden_size=32, intermediate_size=64,
                   linear_attn_config=dict(SHAPE["linear_attn_config"], num_heads=1, head_dim=16, gate_rank=8))
# (world, EP, seq_len, expert format) of the layouts each launch runs after its calibration
LAYOUTS = {1: [(1, 1, 256, "dense"), (1, 1, 1024, "dense"), (1, 1, 512, "mxfp4")],
           2: [(2, 1, 512, "dense"), (2, 2, 256, "dense"), (2, 2, 1024, "mxfp4")],
           4: [(4, 2, 256, "dense"), (4, 2, 1024, "dense"), (4, 1, 512, "dense"), (4, 2, 512, "mxfp4")]}


def layout_recipe(output_dir: str, world: int, ep: int, seq_len: int, expert_format: str = "dense",
                  shape: dict = SHAPE, steps: int = 2) -> dict:
    """A LoRA recipe on the seed's targets (one micro-batch of 2 rows per rank), fp32 as the CPU trains."""
    return {"output_dir": output_dir, "seed": 0, "deepspeed": "ds_configs/zero3_lora.json" if world > 1 else None,
            "model": {"preset": "tiny", "overrides": dict(shape, expert_format=expert_format)},
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "gate"]},
            "data": {"kind": "arithmetic", "num_documents": 400, "seq_len": seq_len, "eval_fraction": 0.0},
            "parallel": {"backend": "megatron", "expert_parallel_size": ep},
            "schedule": {"steps": steps, "micro_batch_size": 2, "lr": 1e-3, "decay": "constant"},
            "checkpoint": {"every": 0}, "logging": {"every": 1000, "progress_bar": False,
                                                    "wandb": {"mode": "disabled"}}}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _settle() -> None:
    gc.collect()
    try:  # hand freed heap pages back, so that the next layout's baseline is not inflated by the previous one
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, pinned


def pin_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its initial 128 KiB (a diagnosis, docs/planner.md). By default glibc
    raises it each time a large mmapped block is freed; later large blocks then come from the heap, whose
    freed pages stay resident. Pinned, a freed large block goes back to the system at once, but zero-filled
    pages never written (KDA's chunk padding) are not resident either, so VmHWM reads below what is
    allocated."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def measure_worker(recipes: List[dict], threads: int = 1, pin_mmap: bool = False) -> List[Dict[str, float]]:
    """Run each recipe's ``Trainer`` for its steps in this process; per recipe the peak increase in bytes."""
    import deepspeed  # noqa: F401  imported before the baseline: imports are not the model
    import megatron.core  # noqa: F401
    import torch

    if pin_mmap:
        pin_mmap_threshold()

    from ..training.loop import Trainer
    from ..training.recipe import recipe_from_dict

    torch.set_num_threads(threads)
    out = []
    for values in recipes:
        _settle()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        baseline = _status_kib("VmRSS")
        with Trainer(recipe_from_dict(values)) as trainer:
            for _ in range(values["schedule"]["steps"]):
                trainer.train_step()
            loss = trainer.result.losses[-1]
        out.append({"peak_bytes": (_status_kib("VmHWM") - baseline) * 1024.0, "loss": float(loss)})
        _settle()
    return out


def planned_peak(recipe_values: dict, world: int, cache: dict) -> float:
    """The planner's peak for one measured layout, without the overhead constant (bytes)."""
    from ..training.recipe import recipe_from_dict
    from .planner import plan_recipe

    # the trainer drops no token: every expert computes exactly its rows, a capacity factor of 1
    plan = plan_recipe(recipe_from_dict(recipe_values), devices=world, overhead_bytes=0.0, cache=cache, capacity=1.0)
    return plan.memory.peak
