"""Rank-side code of test_zero3_load.py, run by moe_plugin.testing.launch.run_distributed on 2 gloo ranks.

Each rank builds the tiny model under ``deepspeed.zero.Init`` (every parameter partitioned over the 2 ranks),
streams the parent's checkpoints into it with ``load_state`` and returns the gathered tensors, the load
statistics and the ValueError messages of broken checkpoints. Nothing here asserts.
"""

from __future__ import annotations

import os

import torch

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
# zero.Init gets no dtype: DeepSpeed 0.19.8 (Init._set_dtype) ignores an explicit dtype on an accelerator
# without fp16 (the CPU one) and makes the parameters bf16; without one it takes fp32 from this config


def _deepspeed():
    # DeepSpeed's CPU backend JIT-builds a shared-memory collective op (slow, and unused by gloo); the
    # project's cpu_compat module will own this switch, the test sets it until then
    import deepspeed.comm.torch as ds_comm_torch

    ds_comm_torch.build_shm_op = lambda: None
    import deepspeed

    return deepspeed


def _partitioned_model(deepspeed):
    from transformers.initialization import no_init_weights

    from moe_plugin.models import MoEPluginForCausalLM, preset_config

    # no_init_weights: transformers' post-init would re-draw the weights on the empty ZeRO-3 placeholders
    # (it does the same in from_pretrained under ZeRO-3); every tensor is loaded below anyway
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        return MoEPluginForCausalLM(preset_config("tiny", attn_res=False))


def _gathered(deepspeed, model) -> dict:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _error(load) -> str | None:
    try:
        load()
    except ValueError as err:
        return str(err)
    return None


def _padding_check(deepspeed) -> dict:
    """write_flat / zero_padding on a parameter of odd size (15 elements: 8 per rank, 1 of padding)."""
    from moe_plugin.weights.loader import write_flat, zero_padding

    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        linear = torch.nn.Linear(3, 5, bias=False)
    weight = linear.weight
    weight.ds_tensor.fill_(float("nan"))
    value = torch.arange(15.0).reshape(5, 3)
    zero_padding(weight)
    write_flat(weight, 0, value)
    partition = weight.ds_tensor.clone()
    with deepspeed.zero.GatheredParameters([weight]):
        gathered = weight.detach().clone()
    return {"partition": partition, "gathered": gathered, "value": value}


def load_partitioned(case_dir: str) -> dict:
    import torch.distributed as dist

    from moe_plugin.weights import load_state

    deepspeed = _deepspeed()
    out = {}
    model = _partitioned_model(deepspeed)
    config = model.config.to_model_config()
    params = list(model.named_parameters())
    out["placeholders"] = sorted({tuple(p.shape) for _, p in params})
    out["partition_numel"] = sum(p.ds_tensor.numel() for _, p in params)
    out["rank"] = dist.get_rank()

    probe = dict(params)["model.layers.0.self_attn.q_proj.weight"]
    probe.ds_tensor.fill_(0.25)  # no_init_weights leaves torch.empty's values, NaN among them
    out["errors"] = {
        name: _error(
            lambda name=name: load_state(model, os.path.join(case_dir, "broken", name), names="hf", config=config)
        )
        for name in ("missing", "extra", "misshapen")
    }
    out["untouched_after_errors"] = bool((probe.ds_tensor == 0.25).all())

    for source in ("hf", "k3"):
        model = _partitioned_model(deepspeed)
        stats = load_state(model, os.path.join(case_dir, source), names="hf", config=config)
        out[source] = {"stats": vars(stats), "state": _gathered(deepspeed, model)}
    out["padding"] = _padding_check(deepspeed)
    return out
