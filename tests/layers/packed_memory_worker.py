"""Child process of test_packed_memory.py: one LoRA training step of a packed-expert model, its peak memory.

``python packed_memory_worker.py '[{"variant": ..., "fmt": ..., "group_size": ...}, ...]'`` measures each
case in turn: it builds the model, runs a warm-up step (the optimizer's states and every step's allocations
exist from then on), resets the resident high-water mark (``/proc/self/clear_refs``), runs one more step and
records the growth of the peak over the resident size just before that step (``VmHWM - VmRSS``, bytes), then
drops the model; it prints ``RESULT [json, ...]``. Variants:

- ``packed``: the product's path, dequantising ``group_size`` experts at a time in forward and backward;
- ``preallocated``: the same step with the packed layer's dequantised bytes allocated before it (every
  dequantisation returns a view of one group-sized buffer decoded up front), so its growth is the step's
  memory without any dequantisation.

The parent runs the child with ``MALLOC_MMAP_THRESHOLD_`` fixed, so each large tensor
is its own mapping and freeing it gives its pages back: the resident size follows the live tensors. Nothing
here asserts.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

# one MoE layer of 16 experts whose matrices are 512 x 512: a group of 4 dequantised in fp32 is 4 MiB, far
# above what the allocator and the interpreter move between two identical steps (kilobytes)
SIZE = dict(
    num_hidden_layers=2,
    layer_types=["kda", "kda"],
    first_k_dense_replace=1,
    attn_res=False,
    use_dsa_indexer=False,
    num_experts=16,
    num_experts_per_token=8,
    moe_intermediate_size=512,
    routed_expert_hidden_size=512,
)
TARGETS = dict(
    target_modules=["q_proj", "k_proj", "gate"], target_parameters=["experts.w1", "experts.w2", "experts.w3"]
)
TOKENS = 64


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(spec: dict) -> dict:
    import moe_plugin.ops.quant.experts as quant_experts
    from moe_plugin.lora import add_lora, lora_config
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.ops.quant import decode

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny", expert_format=spec["fmt"], **SIZE)).train()
    experts = [m for m in model.modules() if getattr(m, "is_packed", False)]
    for m in experts:
        m.group_size = spec["group_size"]
    e, out, inp = experts[0].logical_shapes["w1"]
    group_bytes = spec["group_size"] * out * inp * torch.float32.itemsize  # every kind is [512, 512]
    real = quant_experts.dequantize_experts
    if spec["variant"] == "preallocated":
        first = experts[0]
        buffer = decode(spec["fmt"], first.w1[: spec["group_size"]], first.w1_scale[: spec["group_size"]], inp)
        real = lambda fmt, packed, scale, in_features, dtype: buffer[: packed.shape[0]]  # noqa: E731
    model = add_lora(model, lora_config(4, 8, **TARGETS), wrap=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.tensor([[(37 * i + 11) % 384 for i in range(TOKENS)]])
    counts = {}

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return float(loss)

    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    original = quant_experts.dequantize_experts
    quant_experts.dequantize_experts = counted
    try:
        step()  # warm-up
        calls[0] = 0
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts from the current resident size
        base = _status("VmRSS")
        loss = step()
    finally:
        quant_experts.dequantize_experts = original
    counts["dequantisations"] = calls[0]
    return {
        **spec,
        "growth": _status("VmHWM") - base,
        "group_bytes": group_bytes,
        "loss": loss,
        "expert_bytes": sum(m.packed_nbytes() for m in experts),
        **counts,
    }


def main(specs: list) -> list:
    out = []
    for spec in specs:
        out.append(measure(spec))
        gc.collect()  # the previous model's tensors are unmapped before the next one is built
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))))
