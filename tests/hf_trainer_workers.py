"""Rank-side code of tests/test_hf_trainer.py (run by ``moe_plugin.testing.launch.run_distributed``).

Each run trains the saved base with peft LoRA through ``transformers.Trainer`` and the project's
``MoEMetricsCallback``, as a user writes it (docs/hf-trainer.md), saves the adapter with ``save_model`` and
returns the logged losses and gradient norms, the trained model's logits on a fixed probe and where the W&B
run is. Nothing here asserts.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import TrainerCallback

LEARNING_RATE = 2e-2  # constant: the tests' tolerances take it (tests/tolerances.py)

PROBE_TEXT = "Q: 73 - 18 = ? A:"


def probe_ids() -> torch.Tensor:
    """``[1, T]``: bos and the probe question, as the training documents start."""
    from moe_plugin.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return torch.tensor([[tok.bos_token_id] + list(tok.encode(PROBE_TEXT, add_special_tokens=False))])


def train_runs(runs: list) -> list:
    """``[{"base", "output_dir", "deepspeed", "per_device", "steps", "wandb"[, "ep", "expert_adapters",
    "checkpointing", "record_metrics", "record_steps"]}]`` -> one result per run. ``ep`` > 1:
    ``parallelize_experts`` after the load; ``expert_adapters``: LoRA on ``experts.w1/w2/w3`` too, drawn per global
    expert (``prepare_expert_adapters``); ``record_metrics``: the callback's logged rows are returned (rank 0's);
    ``record_steps``: each step's routing and the whole adapter after it (``_StepRecord``).
    ``{"refuse_wandb": dir, "base"}``: ``report_to="wandb"`` run from ``dir`` (see ``_refuse_wandb``)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # accelerate checks it; the group is already up
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]
    return [_refuse_wandb(run["refuse_wandb"], run["base"]) if "refuse_wandb" in run else _train(**run) for run in runs]


class _Rows:
    """A ``Logger`` that keeps what the callback logs: ``[(step, {key: value})]``, a ``Distribution`` as its
    list of values."""

    def __init__(self):
        self.rows = []

    def log(self, step, metrics):
        self.rows.append((step, {k: list(getattr(v, "values", [])) or v for k, v in metrics.items()}))

    def __getattr__(self, name):  # start, step, image, message, close: nothing to keep
        return lambda *args, **kwargs: None


def _deprecations(caught) -> list:
    """The distinct deprecation warnings (FutureWarning, DeprecationWarning) among ``caught``."""
    kinds = (FutureWarning, DeprecationWarning)
    return sorted({f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, kinds)})


def _refuse_wandb(directory: str, base: str) -> dict:
    """As a user runs it from ``directory``: ``TrainingArguments(report_to="wandb")`` with the callback, W&B
    offline (no network). Returns the refusal's message and the W&B run folders left under ``directory``."""
    import glob

    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from moe_plugin.hf_trainer import CausalLMDataset, MoEMetricsCallback, collate_causal_lm
    from moe_plugin.training.data.pipeline import arithmetic_examples

    here, mode = os.getcwd(), os.environ.get("WANDB_MODE")
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    os.environ["WANDB_MODE"] = "offline"
    refused = None
    try:
        args = TrainingArguments(output_dir="out", use_cpu=True, max_steps=1, report_to="wandb", disable_tqdm=True)
        trainer = Trainer(  # docs/hf-trainer.md section 1's
            model=_peft(AutoModelForCausalLM.from_pretrained(base), expert_adapters=False),
            args=args,
            train_dataset=CausalLMDataset(arithmetic_examples(8, 0, "-")),
            data_collator=collate_causal_lm,
            callbacks=[MoEMetricsCallback(wandb="disabled")],
        )
        trainer.train()
    except ValueError as e:
        refused = str(e)
    finally:
        os.chdir(here)
        if mode is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = mode
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:  # a run transformers' callback started: end it here
            wandb.finish()
    return {
        "refused": refused,
        "wandb_dirs": sorted(glob.glob(os.path.join(directory, "**", "*run-*"), recursive=True)),
    }


def _peft(model, expert_adapters: bool):
    """``model`` with the tests' LoRA (as docs/hf-trainer.md's, r = 4; ``task_type`` left unset, as peft allows),
    seeded after the load, which draws differently under zero.Init: the same lora_A in every layout."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    params = ["experts.w1", "experts.w2", "experts.w3"] if expert_adapters else None
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate"], target_parameters=params)
    )


def _train(
    base: str,
    output_dir: str,
    deepspeed,
    per_device: int,
    steps: int,
    wandb: str,
    ep: int = 1,
    expert_adapters: bool = False,
    checkpointing: bool = False,
    record_metrics: bool = False,
    record_steps: bool = False,
) -> dict:
    import warnings

    from transformers import AutoModelForCausalLM, TrainingArguments

    import moe_plugin  # noqa: F401  (registers the Auto classes)
    from moe_plugin.hf_trainer import CausalLMDataset, MoEMetricsCallback, MoETrainer, collate_causal_lm
    from moe_plugin.training.data.pipeline import arithmetic_examples

    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        deepspeed=deepspeed,
        per_device_train_batch_size=per_device,
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        average_tokens_across_devices=True,
        dataloader_drop_last=True,
        max_grad_norm=1.0,
        disable_tqdm=True,
        gradient_checkpointing=checkpointing,
    )
    model = AutoModelForCausalLM.from_pretrained(base)  # under zero.Init when the config is ZeRO-3
    local_experts = bad_size = partitioned = None
    if ep > 1:
        from moe_plugin.parallel.hf_expert_parallel import parallelize_experts

        try:  # a size that does not divide the world: the message is checked by the test
            parallelize_experts(model, ep + 1, device="cpu")
        except ValueError as e:
            bad_size = str(e)
        parallelize_experts(model, ep, device="cpu")
        w1 = model.model.layers[1].block_sparse_moe.experts.w1
        local_experts = int(getattr(w1, "ds_shape", w1.shape)[0])
        partitioned = hasattr(w1, "ds_id")  # read per rank from the checkpoint, then partitioned by ZeRO-3
    model = _peft(model, expert_adapters)
    if expert_adapters:
        from moe_plugin.parallel.hf_expert_parallel import prepare_expert_adapters

        prepare_expert_adapters(model, seed=0)
    rows = _Rows() if record_metrics else None
    callback = MoEMetricsCallback(wandb=wandb, logger=rows)
    steps_record = _StepRecord(model) if record_steps else None
    from moe_plugin.training.metrics.routing import moe_layers

    router_calls = [0]
    hooks = [
        layer.router.register_forward_pre_hook(lambda *_: router_calls.__setitem__(0, router_calls[0] + 1))
        for layer in moe_layers(model)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, each time: what the progress bar would show
        trainer = MoETrainer(
            model=model,
            args=args,
            train_dataset=CausalLMDataset(arithmetic_examples(400, 0, "-")),
            data_collator=collate_causal_lm,
            callbacks=[callback] + ([steps_record] if steps_record else []),
        )
        trainer.train()
        for hook in hooks:
            hook.remove()
        modes = sorted({m.recompute_mode for m in model.modules() if hasattr(m, "recompute_mode")})
        adapter = os.path.join(output_dir, "adapter")
        trainer.save_model(adapter)  # collective under ZeRO-3: the adapter is gathered, rank 0 writes it
    model.eval()
    with torch.no_grad():  # every rank runs the forward: under ZeRO-3 each layer's weights are gathered
        logits = trainer.model_wrapped(input_ids=probe_ids()).logits.detach().clone()
    history = trainer.state.log_history
    from accelerate.state import AcceleratorState

    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "logits": logits,
        "adapter": adapter,
        "world": trainer.args.world_size,
        "deepspeed": trainer.is_deepspeed_enabled,
        "distributed_type": str(AcceleratorState().distributed_type),
        "wandb_dirs": _wandb_dirs(output_dir),
        "local_experts": local_experts,
        "bad_ep_size": bad_size,
        "experts_partitioned": partitioned,
        "router_calls_per_layer": router_calls[0] / max(1, len(hooks)),
        "recompute_modes": modes,
        "deprecations": _deprecations(caught),
        "metric_rows": rows.rows if rows is not None else None,
        "step_routes": steps_record.routes if steps_record else None,
        "step_adapters": steps_record.adapters if steps_record else None,
    }


class _StepRecord(TrainerCallback):
    """A ``TrainerCallback`` keeping, per optimizer step, the experts each MoE layer's training forward chose for
    each of this rank's tokens (``[N, k]`` sorted, one tensor a router call) and the whole adapter after the step
    (``adapter_state``: gathered over ZeRO-3 and the expert-parallel group). A routing choice is discrete: two
    layouts whose logits differ by rounding choose differently where two experts' scores nearly tie, and from
    there their trajectories part by more than rounding; the tests compare the steps before that."""

    def __init__(self, model):
        from moe_plugin.training.metrics.routing import moe_layers

        self.routes, self.adapters, self._calls = [], [], []
        for layer in moe_layers(model):
            layer.route_tokens = self._recording(layer.route_tokens)

    def _recording(self, route_tokens):
        def route(x_flat):
            weights, indices, scores = route_tokens(x_flat)
            if torch.is_grad_enabled():  # the training forward, not the probe's
                self._calls.append(indices.detach().sort(-1).values.clone())
            return weights, indices, scores

        return route

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from moe_plugin.parallel.hf_expert_parallel import adapter_state

        self.routes.append(self._calls)
        self._calls = []
        self.adapters.append(adapter_state(model))  # collective: every rank


def _wandb_dirs(output_dir: str) -> list:
    import glob

    return sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*")))


def count_checkpoint_reads(base: str) -> dict:
    """``parallelize_experts`` on ``base`` built under ``deepspeed.zero.Init`` (so each MoE layer's experts are
    read again from the checkpoint), with the checkpoint's index and shard-header readers counted: how often
    each ran, and whether the local experts equal the checkpoint's."""
    import collections

    import deepspeed
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from moe_plugin import fileio
    from moe_plugin.parallel.distributed import prepare_device
    from moe_plugin.parallel.hf_expert_parallel import parallelize_experts
    from moe_plugin.weights import plan as weights_plan

    index_reads, header_reads = [0], collections.Counter()
    real_map, real_header = fileio.safetensors_weight_map, weights_plan.read_safetensors_header

    def weight_map(path):
        index_reads[0] += 1
        return real_map(path)

    def header(path):
        header_reads[os.fspath(path)] += 1
        return real_header(path)

    fileio.safetensors_weight_map, weights_plan.read_safetensors_header = weight_map, header
    try:
        prepare_device("cpu")
        # alive during the load: from_pretrained builds under zero.Init, as under the Trainer's deepspeed=
        zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
        model = AutoModelForCausalLM.from_pretrained(base)
        parallelize_experts(model, 1, device="cpu", checkpoint=base)
        del zero3
    finally:
        fileio.safetensors_weight_map, weights_plan.read_safetensors_header = real_map, real_header
    stored = {}
    for file in sorted(f for f in os.listdir(base) if f.endswith(".safetensors")):
        stored.update(load_file(os.path.join(base, file)))
    layers = [m for m in model.modules() if type(m).__name__ == "StableLatentMoE"]
    match = True
    for name, p in model.named_parameters():
        if ".experts.w" in name:
            with deepspeed.zero.GatheredParameters([p]):
                match &= torch.equal(p.detach(), stored[name])
    return {
        "index_reads": index_reads[0],
        "header_reads": dict(header_reads),
        "moe_layers": len(layers),
        "partitioned": all(hasattr(m.experts.w1, "ds_id") for m in layers),
        "experts_match": bool(match),
    }
