"""Training-step throughput with expert parallelism: EP=2 (2 processes x 1 thread) vs EP=1 (1 process x 2 threads).

Both run megatron-core's GPTModel built from moe_plugin's specs, with LoRA adapters (q_proj, k_proj, the router
and every routed expert) trained by SGD: forward, backward, ``reduce_gradients`` and the optimizer step. The
global batch is the same; at EP=2 the data-parallel size is 2, so each process runs half of it and the MoE
layers exchange latent-width tokens through megatron's all-to-all. Both layouts run in one invocation (two
launches), and the result is the throughput ratio EP=2 / EP=1 (goal >= 0.7).

``python -m benchmarks.megatron_ep`` runs the default shape; ``--tiny`` a seconds-long check.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

SHAPE = dict(
    hidden=256,
    layers=4,
    experts=16,
    top_k=4,
    expert_width=128,
    latent=128,
    kda_heads=4,
    head_dim=64,
    vocab=4096,
    seq=256,
    global_batch=8,
)
TINY = dict(
    hidden=64,
    layers=2,
    experts=4,
    top_k=2,
    expert_width=32,
    latent=32,
    kda_heads=2,
    head_dim=32,
    vocab=256,
    seq=32,
    global_batch=4,
)
LORA_TARGETS = dict(
    target_modules=("q_proj", "k_proj", "gate"), target_parameters=("experts.w1", "experts.w2", "experts.w3")
)


def model_config(shape: Dict[str, int]):
    """The tiny preset scaled to ``shape`` (last layer MLA, the first dense, the rest KDA + latent MoE)."""
    from moe_plugin.models.presets import preset_config

    s = shape
    types = ["kda"] * (s["layers"] - 1) + ["mla"]
    return preset_config(
        "tiny",
        attn_res=False,
        vision_config=None,
        image_token_id=None,
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        layer_types=types,
        linear_attn_config=dict(
            num_heads=s["kda_heads"],
            head_dim=s["head_dim"],
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
            gate_form="k3",
            gate_rank=s["head_dim"] // 2,
            chunk_size=64,
        ),
        num_experts=s["experts"],
        num_experts_per_token=s["top_k"],
        moe_intermediate_size=s["expert_width"],
        routed_expert_hidden_size=s["latent"],
        intermediate_size=2 * s["hidden"],
        index_topk=s["seq"],
    ).to_model_config()


def train_worker(shape: Dict[str, int], ep: int, threads: int, iters: int = 3, seed: int = 0) -> dict:
    """Rank code: seconds per LoRA training step of this layout (after one warm-up step), and the last loss."""
    from moe_plugin.lora import add_lora, lora_config
    from moe_plugin.megatron.specs import build_gpt_model
    from moe_plugin.parallel.distributed import initialize_megatron
    from moe_plugin.testing.grad_reduce import reduce_gradients

    torch.set_num_threads(threads)
    initialize_megatron(expert_model_parallel_size=ep, seed=seed + 1)
    config = model_config(shape)
    torch.manual_seed(seed)  # same non-expert weights on every rank
    model = build_gpt_model(config)
    add_lora(model, lora_config(8, 16, **LORA_TARGETS))
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(adapters, lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, shape["vocab"], (shape["global_batch"], shape["seq"]), generator=g)
    tokens = batch.chunk(world)[rank]  # data parallel: each rank its share of the same global batch

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens, None, None)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        reduce_gradients(model)
        optimizer.step()
        return loss.item()

    step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        loss = step()
    dist.barrier()
    return {"seconds": (time.perf_counter() - start) / iters, "loss": loss}


def run(shape: Dict[str, int] = SHAPE, iters: int = 3) -> List[str]:
    """Run both layouts; print and return one line each and the ratio line throughput(EP=2) / throughput(EP=1)."""
    from moe_plugin.testing.launch import run_distributed

    from .harness import machine_line

    target = "benchmarks.megatron_ep:train_worker"
    ep2 = run_distributed(target, world_size=2, timeout_s=1800, shape=shape, ep=2, threads=1, iters=iters)
    ep1 = run_distributed(target, world_size=1, timeout_s=1800, shape=shape, ep=1, threads=2, iters=iters)
    seconds_ep2 = max(r["seconds"] for r in ep2)
    seconds_ep1 = ep1[0]["seconds"]
    tokens = shape["global_batch"] * shape["seq"]
    ratio = seconds_ep1 / seconds_ep2
    lines = [
        machine_line(2),
        f"shape: {shape}",
        f"EP=1, 1 process x 2 threads:  {seconds_ep1:.3f} s/step, {tokens / seconds_ep1:.0f} tokens/s",
        f"EP=2, 2 processes x 1 thread: {seconds_ep2:.3f} s/step, {tokens / seconds_ep2:.0f} tokens/s",
        f"ratio EP=2 / EP=1 throughput: {ratio:.2f} (goal >= 0.7)",
    ]
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long check at tiny sizes")
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    result_lines = run(TINY if args.tiny else SHAPE, args.iters)
    if not args.tiny:
        from benchmarks.harness import write_results

        write_results("expert parallelism (benchmarks/megatron_ep.py)", result_lines)
