"""Rank-side code of the megatron model tests: run by moe_plugin.testing.launch.run_distributed.

The parent (test_megatron_model.py) saves, per scenario, a Hugging Face checkpoint (sharded safetensors), the
LoRA adapter weights under Hugging Face names and one micro-batch per rank. Each rank, for every expert-parallel
size in ``layouts`` (re-initialising megatron's groups each time), builds megatron's GPTModel from the specs,
loads its own experts from the shards, adds the same adapters, runs forward/backward on its micro-batch and
reduces the adapter gradients over the data-parallel / expert-data-parallel groups. Results go back to the
parent, which compares them with the Hugging Face model on the concatenated batch. Nothing here asserts.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F


def run_model_checks(case_dir: str, layouts, scenarios, extras: bool = False, seed: int = 0) -> dict:
    """{f"{scenario}/ep{ep}": result dict or {"error": traceback}}, plus "extras/..." checks when asked."""
    from moe_plugin.parallel.distributed import initialize_megatron

    results = {}
    for ep in layouts:
        initialize_megatron(expert_model_parallel_size=ep, seed=seed + 1)
        for scenario in scenarios:
            results[f"{scenario}/ep{ep}"] = _guarded(
                lambda scenario=scenario, ep=ep: _train_step(case_dir, scenario, extras and ep > 1)
            )
        if extras and ep > 1:
            results[f"k3/ep{ep}"] = _guarded(lambda: _k3_forward(case_dir))
    return results


def _guarded(check) -> dict:
    try:
        out = check()
    except Exception:
        out = {"error": traceback.format_exc()}
        print(f"rank {dist.get_rank()}: {out['error']}", file=sys.stderr, flush=True)  # visible if a peer hangs
    dist.barrier()  # a failed check must not leave a peer inside a collective of the next one
    return out


def _count_reads(weights_module):
    """Wrap ``safe_open`` as seen by moe_plugin.testing.megatron_loading: count what is read of expert tensors."""
    counts = {"expert_elements": 0, "expert_full_reads": 0, "tensors": 0, "expert_names": set()}
    original = weights_module.safe_open

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __getitem__(self, index):
            value = self.inner[index]
            if ".experts." in self.name:
                counts["expert_elements"] += value.numel()
                counts["expert_names"].add(self.name)
            counts["tensors"] += 1
            return value

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = original(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            value = self.file.get_tensor(name)
            if ".experts." in name:
                counts["expert_full_reads"] += 1
                counts["expert_elements"] += value.numel()
                counts["expert_names"].add(name)
            counts["tensors"] += 1
            return value

        def get_slice(self, name):
            return Slice(self.file.get_slice(name), name)

    weights_module.safe_open = Handle
    return counts, lambda: setattr(weights_module, "safe_open", original)


def _train_step(case_dir: str, scenario: str, extras: bool) -> dict:
    from megatron.core import parallel_state

    from moe_plugin.megatron import weights
    from moe_plugin.testing.expert_dispatch import dispatched_shapes
    from moe_plugin.lora import add_lora, lora_config
    from moe_plugin.megatron.lora import adapter_state_to_hf
    from moe_plugin.megatron.specs import build_gpt_model
    from moe_plugin.models.configuration import MoEPluginConfig
    from moe_plugin.testing.grad_reduce import reduce_gradients
    from moe_plugin.testing import megatron_loading
    from moe_plugin.testing.megatron_loading import load_hf_adapter_state

    path = os.path.join(case_dir, scenario)
    setup = torch.load(os.path.join(path, "setup.pt"))
    config = MoEPluginConfig.from_pretrained(path).to_model_config()
    rank = dist.get_rank()
    out = {
        "dp": parallel_state.get_data_parallel_world_size(),
        "edp": parallel_state.get_expert_data_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
    }

    model = build_gpt_model(config)
    out["layer_types"] = [
        (type(layer.self_attention).__name__, type(layer.mlp).__name__) for layer in model.decoder.layers
    ]
    if extras:  # before the real load: strict=False loads the broken checkpoint's weights
        out["load_errors"] = _load_errors(model, os.path.join(case_dir, "broken"), config)
    counts, restore = _count_reads(megatron_loading)
    try:
        stats = megatron_loading.load_hf_checkpoint(model, path, config)
    finally:
        restore()
    out["read"], out["stats"] = counts, vars(stats)
    out["local"] = weights.expert_ranges(model)
    if extras:
        out["roundtrip"] = weights.megatron_to_hf_state_dict(model, config)

    lora = setup["lora"]
    add_lora(model, lora_config(lora["r"], lora["alpha"], lora["target_modules"], lora["target_parameters"]))
    load_hf_adapter_state(model, setup["adapters"], config)
    if extras:
        out["adapter_roundtrip"] = adapter_state_to_hf(model, config)
        out["roundtrip_after_lora"] = weights.megatron_to_hf_state_dict(model, config)

    received = _spy_received(model)
    groups_used = _spy_groups_used(model, config.moe.num_groups)
    with dispatched_shapes() as widths:
        tokens = setup["batches"][rank]
        logits = model(tokens, None, None)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
    out["widths"] = widths
    out["loads"] = [layer.mlp.pop_load() for layer in model.decoder.layers if layer.is_moe_layer]
    out["groups_used"] = groups_used
    out["received"] = [r[0] for r in received]
    out["counts"] = vars(reduce_gradients(model))
    out["logits"], out["loss"] = logits.detach(), loss.detach()
    out["grads"] = adapter_state_to_hf(model, config, grads=True)
    out["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)

    if extras:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = setup["packed_cu_seqlens"]
        longest = int((cu[1:] - cu[:-1]).max())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        with torch.no_grad():
            out["packed_logits"] = model(setup["packed"][rank], None, None, packed_seq_params=params)
    return out


def _k3_forward(case_dir: str) -> dict:
    """Load the K3-layout checkpoint into GPTModel on this rank's experts only; logits of this rank's batch.

    Also the ValueError message of a K3 checkpoint with one expert tensor missing and one unknown tensor."""
    import json

    from moe_plugin.megatron import weights
    from moe_plugin.megatron.specs import build_gpt_model
    from moe_plugin.models.k3_config import config_from_k3
    from moe_plugin.testing import megatron_loading

    path = os.path.join(case_dir, "k3")
    with open(os.path.join(path, "config.json")) as f:
        config = config_from_k3(json.load(f)).to_model_config()
    model = build_gpt_model(config)
    counts, restore = _count_reads(megatron_loading)
    try:
        stats = megatron_loading.load_k3_checkpoint_per_rank(model, path, config)
    finally:
        restore()
    tokens = torch.load(os.path.join(case_dir, "mixed", "setup.pt"))["batches"][dist.get_rank()]
    with torch.no_grad():
        logits = model(tokens, None, None)
    try:
        megatron_loading.load_k3_checkpoint_per_rank(model, os.path.join(case_dir, "broken", "k3"), config)
        error = None
    except ValueError as e:
        error = str(e)
    return {
        "read": counts,
        "stats": vars(stats),
        "local": weights.expert_ranges(model),
        "logits": logits,
        "broken_error": error,
    }


def _load_errors(model, broken_dir: str, config) -> dict:
    """The ValueError messages of loading broken checkpoints (None where it loaded)."""
    from moe_plugin.testing.megatron_loading import load_hf_checkpoint

    def message(name, **kwargs):
        try:
            load_hf_checkpoint(model, os.path.join(broken_dir, name), config, **kwargs)
        except ValueError as e:
            return str(e)
        return None

    return {
        "missing": message("missing"),
        "unexpected": message("unexpected"),
        "unexpected_not_strict": message("unexpected", strict=False),
    }


def _spy_groups_used(model, num_groups: int) -> list:
    """Per MoE layer forward, the set of distinct counts of expert groups a token's choices fall in."""
    seen = []
    for layer in model.decoder.layers:
        if not layer.is_moe_layer:
            continue
        route = layer.mlp.route_tokens

        def recording(x, route=route):
            weights, indices, scores = route(x)
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
            per_group = chosen.view(chosen.shape[0], num_groups, -1).any(-1).sum(-1)
            seen.extend(sorted(set(per_group.tolist())))
            return weights, indices, scores

        layer.mlp.route_tokens = recording
    return seen


def _spy_received(model) -> list:
    """Per MoE layer, a list that records the ``tokens_per_expert [E_local]`` this rank's experts compute."""
    seen = []
    for layer in model.decoder.layers:
        if not layer.is_moe_layer:
            continue
        experts, record = layer.mlp.experts, []
        while hasattr(experts, "base_layer"):  # peft's ParamWrappers around the stacked experts
            experts = experts.base_layer
        forward = experts.forward

        def recording(tokens, tokens_per_expert, probs, forward=forward, record=record):
            record.append(torch.as_tensor(tokens_per_expert).clone())
            return forward(tokens, tokens_per_expert, probs)

        experts.forward = recording
        seen.append(record)
    return seen
