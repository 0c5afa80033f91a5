"""Activation checkpointing (``schedule.activation_checkpointing``, moe_plugin/layers/recompute.py) side by side:
one LoRA training step of the tiny preset's widths at 12 layers (its KDA, KDA, KDA, MLA pattern three times,
Attention Residuals, the DSA indexer, 8 latent experts top-2) at 1 x 4096 tokens, fp32 on the CPU, where
activations dominate, in each mode, each in a fresh process.

Activation memory: the step's peak of tensor bytes (``torch.profiler``'s allocator events summed,
``moe_plugin.testing.plan_measure.tensor_peak``) above what the process held as the step began (weights,
adapters, Adam states), i.e. what the forward and backward add. Step time: the median of 3 steps after a warm-up, the
profiler off. Printed: each mode's activation memory and step time, and their ratios to ``"off"``; goals
``"selective"`` <= 0.5 of the memory at <= 1.25x the time, ``"full"`` <= 0.25 at <= 1.45x.
``python -m benchmarks.checkpointing`` (records its lines in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .harness import ROOT, machine_line, write_results

SEQ = 4096
THREADS = 2
# the tiny preset's widths at 12 layers (its 4-layer pattern three times): with layer-wise recompute one layer
# is rebuilt at a time, so 4 layers would floor the ratio near 1/4 of a layer's share plus the kept set
LAYERS = dict(num_hidden_layers=12, layer_types=["kda", "kda", "kda", "mla"] * 3)
GOALS = {"selective": (0.5, 1.25), "full": (0.25, 1.45)}


def _child(mode: str, seq: int, threads: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_plugin.layers.recompute import set_recompute
    from moe_plugin.lora import add_lora, lora_config
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.testing.plan_measure import tensor_peak

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = add_lora(
        MoEPluginForCausalLM(preset_config("tiny", **LAYERS)).train(),
        lora_config(8, 16, ["q_proj", "k_proj", "gate"]),
        wrap=True,
    )
    set_recompute(model, mode)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    cu = torch.arange(0, seq + 1, 512)  # packed documents of 512 tokens, as the trainer feeds them

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, cu_seqlens=cu).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up: Adam's states exist from here on, as in every later step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = step()
    peak = tensor_peak(prof.profiler.kineto_results.events())["all"]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"activation_bytes": peak, "seconds": sorted(times)[1], "loss": loss}


def run_mode(mode: str, seq: int = SEQ, threads: int = THREADS) -> dict:
    """One mode's step in a fresh process: {"activation_bytes", "seconds", "loss"}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkpointing", "--child", mode, str(seq), str(threads)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"mode {mode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")


def main(seq: int = SEQ) -> list:
    lines = [
        machine_line(THREADS),
        f"tiny preset at 12 layers, LoRA r=8 on q_proj, k_proj, gate; 1 x {seq} tokens "
        "(documents of 512), fp32, one step; activation memory = the step's tensor-byte peak above its start",
    ]
    results = {mode: run_mode(mode, seq) for mode in ("off", "selective", "full")}
    off = results["off"]
    for mode, r in results.items():
        memory, slower = r["activation_bytes"] / off["activation_bytes"], r["seconds"] / off["seconds"]
        goal = ""
        if mode in GOALS:
            m, t = GOALS[mode]
            goal = f" (goal <= {m} at <= {t}x: {'met' if memory <= m and slower <= t else 'NOT met'})"
        lines.append(
            f"{mode:>9}: activations {r['activation_bytes'] / 2**20:7.1f} MiB ({memory:.2f} of off), step "
            f"{r['seconds']:.2f} s ({slower:.2f}x off), loss {r['loss']:.6f}{goal}"
        )
        print(lines[-1], flush=True)
    write_results("activation checkpointing (benchmarks/checkpointing.py)", lines)
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))), flush=True)
    else:
        main()
