"""The expert-parallel dispatch's overlap: one MoE layer at EP 2 on 2 gloo processes, in 1, 2 and 4 chunks.

``parallel.moe_overlap_chunks`` N sends a rank's experts' tokens in N chunks: chunk c's experts run while chunk
c + 1 is dispatched and chunk c - 1 comes back, and the shared experts run while chunk 0 travels
(``moe_plugin/megatron/expert_dispatch.py``). The layer is built once per rank; each iteration runs N = 1, 2, 4
in turn (side by side, so a busy machine slows all three alike) and records the forward + backward time and
the seconds the rank was blocked on an all-to-all handle (the exposed communication, what the trainer logs as
``moe/a2a_exposed_s``). The medians over iterations, the slower rank's, are printed with the ratio of exposed
time N = 4 / N = 1 (goal <= 0.5).

``python -m benchmarks.moe_overlap`` runs the default shape; ``--tiny`` a seconds-long check. On CUDA (NCCL)
``--device cuda`` runs the same on the GPUs given (``benchmarks/gpu_check.py`` runs it with the one it has).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch

SHAPE = dict(tokens=4096, hidden=512, latent=256, experts=32, top_k=8, width=256, shared_width=512)
TINY = dict(tokens=256, hidden=64, latent=32, experts=8, top_k=2, width=32, shared_width=64)
CHUNKS = (1, 2, 4)


def overlap_worker(shape: Dict[str, int], iters: int = 5, threads: int = 1, device: str = "cpu") -> dict:
    """On each rank: the layer's step times and exposed all-to-all seconds per chunk count (lists, one per
    iteration)."""
    import torch.distributed as dist

    from moe_plugin.config import MoEConfig
    from moe_plugin.layers.moe import StableLatentMoE
    from moe_plugin.testing.expert_dispatch import _expert_parallel_copy

    torch.set_num_threads(threads)
    if device == "cuda":  # one GPU a rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    moe = MoEConfig(
        hidden_size=shape["hidden"],
        num_experts=shape["experts"],
        top_k=shape["top_k"],
        expert_intermediate_size=shape["width"],
        latent_size=shape["latent"],
        num_shared_experts=1,
        shared_intermediate_size=shape["shared_width"],
        activation="swiglu",
    )
    layer = _expert_parallel_copy(StableLatentMoE(moe), dist.group.WORLD, 1).to(device)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=g).to(device).requires_grad_(True)
    grad = torch.randn(x.shape, generator=g).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: Dict[int, List[float]] = {n: [] for n in CHUNKS}
    exposed: Dict[int, List[float]] = {n: [] for n in CHUNKS}
    for it in range(iters + 1):  # the first round warms up
        for n in CHUNKS:
            layer.dispatch.chunks = n
            layer.zero_grad(set_to_none=True)
            x.grad = None
            dist.barrier()
            sync()
            layer.dispatch.pop_waited()
            start = time.perf_counter()
            y, _ = layer(x)
            y.backward(grad)
            sync()
            if it:
                times[n].append(time.perf_counter() - start)
                exposed[n].append(layer.dispatch.pop_waited())
    return {"times": times, "exposed": exposed}


def run(shape: Dict[str, int] = SHAPE, iters: int = 5, device: str = "cpu", world: int = 2) -> List[str]:
    """Launch the worker on ``world`` processes and print/return the lines (machine, shape, one per N, ratio)."""
    from moe_plugin.testing.launch import run_distributed

    from .harness import machine_line

    ranks = run_distributed(
        "benchmarks.moe_overlap:overlap_worker",
        world_size=world,
        timeout_s=1800,
        backend="nccl" if device == "cuda" else "gloo",
        shape=shape,
        iters=iters,
        device=device,
    )

    def median(key: str, n: int) -> float:  # the slower rank's median
        return max(statistics.median(r[key][n]) for r in ranks)

    lines = [machine_line(1), f"shape: {shape}, EP {world} on {world} {device} processes, {iters} iterations"]
    for n in CHUNKS:
        lines.append(
            f"moe_overlap_chunks {n}: step {1e3 * median('times', n):.1f} ms, exposed all-to-all "
            f"{1e3 * median('exposed', n):.1f} ms/step"
        )
    ratio = median("exposed", 4) / max(median("exposed", 1), 1e-12)
    speed = median("times", 1) / median("times", 4)
    lines.append(f"exposed all-to-all N=4 / N=1: {ratio:.2f} (goal <= 0.5); step time N=1 / N=4: {speed:.2f}")
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long check at tiny sizes")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    result_lines = run(TINY if args.tiny else SHAPE, args.iters, args.device, args.world)
    if not args.tiny and args.device == "cpu":
        from benchmarks.harness import write_results

        write_results("MoE all-to-all overlap (benchmarks/moe_overlap.py)", result_lines)
