"""A LoRA training step of one layer's routed experts over packed MXFP4 experts against the same step over
dense fp32 experts (CPU; BF16 on a GPU is in benchmarks/gpu_check.py), side by side in one run: step time
ratio and expert memory ratio (goal: memory <= 0.3 of BF16, step <= 1.5x on CPU).

    .venv/bin/python -m benchmarks.packed_experts

Both variants run the same tokens through the same experts (the dense ones are the packed ones dequantised
once) with peft LoRA on w1/w2/w3; the timing is the median of several forward+backward steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from moe_plugin.layers.packed_experts import PackedStackedExperts
from moe_plugin.layers.stacked_experts import StackedExperts
from moe_plugin.lora import add_lora, lora_config
from moe_plugin.ops.quant import decode

E, DIM, FF, TOKENS, ITERS = 16, 512, 256, 4096, 5


class _Host(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, counts):
        return self.experts(x, counts)


def _build():
    torch.manual_seed(0)
    packed = PackedStackedExperts(E, DIM, FF, "swiglu", expert_format="mxfp4", seed=1)
    dense = StackedExperts(E, DIM, FF, "swiglu")
    with torch.no_grad():
        for kind in ("w1", "w3", "w2"):
            getattr(dense, kind).copy_(
                decode("mxfp4", getattr(packed, kind), getattr(packed, f"{kind}_scale"), packed.logical_shapes[kind][2])
            )

    def cfg():
        return lora_config(8, 16, target_modules=[], target_parameters=["experts.w1", "experts.w2", "experts.w3"])

    return add_lora(_Host(packed), cfg()), add_lora(_Host(dense), cfg()), packed, dense


def _step_seconds(model, x, counts) -> float:
    times = []
    for i in range(ITERS + 1):
        start = time.perf_counter()
        model(x, counts).square().mean().backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> list:
    packed_model, dense_model, packed, dense = _build()
    x = torch.randn(TOKENS, DIM)
    counts = torch.distributions.Multinomial(TOKENS, torch.ones(E)).sample().long()
    t_packed = _step_seconds(packed_model, x, counts)
    t_dense = _step_seconds(dense_model, x, counts)
    packed_bytes = packed.packed_nbytes()
    fp32_bytes = sum(p.numel() * p.element_size() for p in (dense.w1, dense.w2, dense.w3))
    bf16_bytes = fp32_bytes // 2
    lines = [
        f"packed experts (MXFP4, {E} experts {DIM}->{FF}, {TOKENS} tokens, LoRA r=8, {torch.get_num_threads()} "
        f"threads): step {t_packed * 1e3:.1f} ms vs fp32 experts {t_dense * 1e3:.1f} ms, time ratio "
        f"{t_packed / t_dense:.2f}x",
        f"expert memory: packed {packed_bytes / 2**20:.2f} MiB vs BF16 {bf16_bytes / 2**20:.2f} MiB (ratio "
        f"{packed_bytes / bf16_bytes:.3f}) vs fp32 {fp32_bytes / 2**20:.2f} MiB (ratio "
        f"{packed_bytes / fp32_bytes:.3f})",
    ]
    for line in lines:
        print(line, flush=True)
    return lines


if __name__ == "__main__":
    main()
