"""KDA op variants for benchmarks.harness: forward + backward in fp32 at B=1, H=4, K=V=64.

Variants: our chunk_kda, our naive_recurrent_kda, and transformers' torch chunk_kimi_delta_attention (reached
with inspect.unwrap). The decay comes from K3's bounded gate at initialisation, so most channels decay
strongly (down to -5 per token), the regime the chunked form has to handle without overflow.
Run: ``python -m benchmarks.ops_kda [T]``.
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Callable, Dict, List

import torch

from benchmarks.harness import machine_line, run_variant
from moe_plugin.ops.kda import chunk_kda, kda_gate_k3, l2norm, naive_recurrent_kda

B, H, K, V = 1, 4, 64, 64


def _inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen))
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.full((H * K,), math.log(math.expm1(0.01)))
    g = kda_gate_k3(torch.randn(B, T, H, K, generator=gen), A_log, dt_bias)
    beta = torch.rand(B, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _step(fn: Callable, T: int) -> Callable[[], None]:
    inputs = _inputs(T)

    def step():
        for x in inputs:
            x.grad = None
        o, _ = fn(*inputs)
        o.sum().backward()

    return step


def ours_chunk(T: int = 4096) -> Callable[[], None]:
    return _step(chunk_kda, T)


def ours_recurrent(T: int = 4096) -> Callable[[], None]:
    return _step(naive_recurrent_kda, T)


def transformers_chunk(T: int = 4096) -> Callable[[], None]:
    from transformers.models.kimi_linear import modeling_kimi_linear

    theirs = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
    return _step(lambda q, k, v, g, beta: theirs(q, k, v, g, beta, chunk_size=64), T)


def _describe(result: Dict) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    return f"{result['seconds']:.2f} s / {result['peak_mib']:.0f} MiB"


def _compare(label: str, ours: Dict, theirs: Dict) -> str:
    if "error" in ours or "error" in theirs:
        return f"{label}: ours {_describe(ours)}, theirs {_describe(theirs)}"
    speed = theirs["seconds"] / ours["seconds"]
    memory = ours["peak_mib"] / max(theirs["peak_mib"], 1e-9)
    return f"{label}: {speed:.1f}x faster, memory {memory:.2f}x (ours {_describe(ours)}, theirs {_describe(theirs)})"


def main(T: int = 4096, threads: int = 2, iters: int = 3) -> List[str]:
    results = {
        name: run_variant(f"benchmarks.ops_kda:{name}", threads=threads, iters=iters, T=T)
        for name in ("ours_chunk", "ours_recurrent", "transformers_chunk")
    }
    lines = [
        machine_line(threads) + f"; B={B} H={H} K=V={K} T={T}, fp32 forward+backward",
        _compare("kda chunk vs transformers chunk", results["ours_chunk"], results["transformers_chunk"]),
        _compare("kda chunk vs our recurrent", results["ours_chunk"], results["ours_recurrent"]),
    ]
    doubled = run_variant("benchmarks.ops_kda:ours_chunk", threads=threads, iters=iters, T=2 * T)
    lines.append(
        f"kda chunk peak memory at T={T} -> {2 * T}: {results['ours_chunk']['peak_mib']:.0f} -> "
        f"{doubled['peak_mib']:.0f} MiB ({doubled['peak_mib'] / results['ours_chunk']['peak_mib']:.2f}x "
        f"for 2x T: linear), time {doubled['seconds'] / results['ours_chunk']['seconds']:.2f}x"
    )
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
