"""The planner agrees with itself and with the trainer (issue 18's review): the device-count search plans each
count as ``plan_recipe`` does (one ZeRO rule), the framework overhead follows ``--kernels``, a MoE layer's
router is held fp32 as the trainer holds it (no fp32 copy counted as an activation); and the full-size seed
plan, knobs and device-count search included, takes well under a minute of CPU (issue 17)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch

from moe_plugin.plan.planner import CPU_OVERHEAD_BYTES, GPU_OVERHEAD_BYTES, plan_recipe
from moe_plugin.testing.plan_measure import layout_recipe
from moe_plugin.recipe.schema import recipe_from_dict

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    layer_types=["kda", "mla"],
    attn_res=False,
    num_experts=64,
    num_experts_per_token=4,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    intermediate_size=64,
    use_dsa_indexer=False,
    first_k_dense_replace=0,
    linear_attn_config=dict(
        num_heads=2,
        head_dim=16,
        short_conv_kernel_size=4,
        gate_lower_bound=-5.0,
        gate_form="k3",
        gate_rank=8,
        chunk_size=16,
    ),
)


def _zero3_recipe():
    # world 2 names the shipped ZeRO-3 config (stage 3, DeepSpeed's 5e8-element reduce bucket) at EP 1
    return recipe_from_dict(layout_recipe("/tmp/never", 2, 1, 256))


def test_the_device_count_search_plans_one_device_as_plan_recipe_does():
    """With a stage-3 config one device is ZeRO-3 for ``plan_recipe``; a memory just under that plan's peak
    does not fit one device, so the search cannot answer 1 (it planned one device without ZeRO-3 before)."""
    recipe, cache = _zero3_recipe(), {}
    one = plan_recipe(recipe, devices=1, cache=cache, summaries=False)
    assert one.layout.zero3
    memory = one.memory.peak - 1
    found = plan_recipe(recipe, devices=1, device_memory=memory, knobs=True, cache=cache, summaries=False)
    found = found.min_devices
    fits = [
        d
        for d in range(1, 9)
        if plan_recipe(recipe, devices=d, device_memory=memory, cache=cache, summaries=False).fits
    ]
    assert fits, "premise: some count up to 8 fits"
    assert found == fits[0] and found > 1


def test_the_framework_overhead_follows_the_kernels_not_the_device_size():
    recipe, cache = _zero3_recipe(), {}
    small_gpu = plan_recipe(recipe, devices=2, kernels="gpu", device_memory=16e9, cache=cache, summaries=False)
    large_cpu = plan_recipe(recipe, devices=2, kernels="cpu", device_memory=141e9, cache=cache, summaries=False)
    assert small_gpu.memory.overhead == GPU_OVERHEAD_BYTES
    assert large_cpu.memory.overhead == CPU_OVERHEAD_BYTES
    assert (
        plan_recipe(recipe, devices=2, kernels="gpu", cache=cache, summaries=False).memory.overhead
        == GPU_OVERHEAD_BYTES
    )


class _Saved:
    """Bytes of the storages autograd saves that are not the module's own tensors (each storage once)."""

    def __init__(self, module):
        self.own = {t.untyped_storage()._cdata for t in list(module.parameters()) + list(module.buffers())}
        self.seen, self.keep, self.nbytes = set(), [], 0

    def pack(self, t):
        key = t.untyped_storage()._cdata
        if key not in self.own and key not in self.seen:
            self.seen.add(key)
            self.keep.append(t)
            self.nbytes += t.untyped_storage().nbytes()
        return t


def test_a_bf16_moe_layer_saves_what_the_trainer_held_layer_saves():
    """The MoE layer in bf16 on meta against the same layer held as the trainer holds it (built, LoRA on the
    seed's targets, then the precision policy: the router stays fp32) run for real on the CPU. At 32 tokens
    the router's fp32 copy (64 x 64 x 4 bytes) would be over 2 % of what the layer saves."""
    from moe_plugin.layers.decoder import DecoderLayer
    from moe_plugin.plan.activations import _add_lora, layer_saved_bytes
    from moe_plugin.plan.routing import BalancedDispatch
    from moe_plugin.precision import apply_precision
    from moe_plugin.recipe.resolved_model import base_hf_config

    recipe = recipe_from_dict(layout_recipe("/tmp/never", 1, 1, 32, shape=SMALL))
    mc = base_hf_config(recipe.model).to_model_config()
    assert mc.is_moe_layer(0)
    shape = (1, 32, mc.hidden_size)
    torch.manual_seed(0)
    layer = DecoderLayer(mc, 0)
    _add_lora(layer, recipe.lora)
    apply_precision(layer, torch.bfloat16)
    router = layer.block_sparse_moe.gate.base_layer
    assert router.weight.dtype == torch.float32  # the premise: the trainer's router is fp32
    state = (torch.randn(shape, dtype=torch.bfloat16).requires_grad_(),)
    counter = _Saved(layer)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = layer(state)
    del out
    routing = BalancedDispatch(mc.moe.num_experts, 1.0)
    meta = layer_saved_bytes(mc, 0, recipe.lora, shape, torch.bfloat16, 1, routing=routing)
    copy = mc.moe.num_experts * mc.hidden_size * 4
    assert copy > 0.02 * counter.nbytes  # a copy counted would be twice the tolerance below
    assert sum(meta.values()) == pytest.approx(counter.nbytes, rel=0.01), (meta, counter.nbytes)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_seed_plan_takes_under_a_minute_of_cpu():
    """The full-size K3 plan as the README runs it (knobs, the device-count search): the child's CPU time,
    not wall time, so a loaded machine does not change the verdict."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_plugin.plan.command",
            "--recipe",
            "recipes/k3_seed_layout.json",
            "--device-memory",
            "141GB",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.returncode == 0, done.stderr
    assert "smallest device count that fits" in done.stdout and "experts mxfp4" in done.stdout
    assert cpu < 60, f"the seed plan took {cpu:.0f} s of CPU"
