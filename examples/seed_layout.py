"""The seed article's layout as a runnable example: FSDP2 x expert parallelism with LoRA r=8 on ``q_proj``,
``k_proj`` and ``gate``, on 4 CPU processes (the tiny preset, EP 2; docs/training.md, "FSDP2").

    torchrun --nproc-per-node 4 examples/seed_layout.py

The snippet's order (build, ``apply_expert_parallel``, ``fully_shard``, LoRA) with one change: LoRA goes on before
``fully_shard``. Adapters attached after it are not part of the shards: where the wrapped layer still runs, they
are plain replicated tensors each rank trains on its own batches and nobody averages (the ranks' adapters drift
apart: the check at the end); here peft, wrapping a sharded layer, sizes the adapter from the rank's 1/4 shard and
the forward fails. The recipe trainer does the same with ``parallel.sharding: "fsdp2"`` (``training.engines.fsdp2``).
"""

import sys

import torch
import torch.distributed as dist
from peft import LoraConfig
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moe_plugin.lora import add_lora
from moe_plugin.models import MoEPluginForCausalLM
from moe_plugin.models.presets import preset_config
from moe_plugin.parallel.expert_parallel import apply_expert_parallel
from moe_plugin.parallel.grad_reduce import is_expert_parameter
from moe_plugin.parallel.layout import ParallelLayout


def lora(model):
    return add_lora(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate"]), wrap=True)


def shard(model, mesh):
    experts = {p for p in model.parameters() if is_expert_parameter(p)}  # stay whole on their EP rank
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=experts & set(layer.parameters()))
    fully_shard(model, mesh=mesh, ignored_params=experts)


def main(steps: int = 5) -> None:
    layout = ParallelLayout(world=4, expert=2, sharding="fsdp2").start(seed=0, device="cpu")
    model = MoEPluginForCausalLM(preset_config("tiny"))  # build (the same weights on every rank: seeded)
    apply_expert_parallel(model, layout)  # each rank keeps 4 of the 8 experts
    model = lora(model)  # LoRA before sharding (not after, as the snippet has it): its adapters are sharded too
    shard(model, layout.dense_mesh("cpu"))  # fully_shard per decoder layer and the root, over all 4 ranks
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(384, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(steps):  # each rank its own batch; FSDP2 averages the adapters' gradients
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {mean.item() / dist.get_world_size():.4f}", flush=True)
    adapters = {
        n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters() if "lora_" in n
    }
    whole = torch.cat([p.detach().flatten() for p in adapters.values()])
    held = [torch.empty_like(whole) for _ in range(dist.get_world_size())]
    dist.all_gather(held, whole)
    sharded = all(isinstance(p, DTensor) for n, p in model.named_parameters() if "lora_" in n)
    same = sharded and all(torch.equal(whole, other) for other in held)  # a replicated adapter would drift
    if dist.get_rank() == 0:
        print(f"{len(adapters)} adapter tensors sharded, trained as one, identical on all ranks: {same}", flush=True)
    layout.stop()
    dist.destroy_process_group()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
