"""Training the Hugging Face model with ``transformers.Trainer``: the MoE metrics callback and the data helpers.

``MoEMetricsCallback`` logs, through the project's one ``Logger`` (``moe_plugin.training.metrics.logger``: console
lines, a W&B run, offline unless told otherwise, and the expert-load plot), what the Trainer's own logs do not
have: per-layer expert load (bounded summaries and histograms), dead and overloaded experts, routing drift
from the base router, the indexer KL where the DSA indexer trains, and tokens/s, beside the Trainer's loss,
learning rate and gradient norm. ``CausalLMDataset`` and ``collate_causal_lm`` turn the project's examples
(``moe_plugin.training.data.pipeline``) into padded batches the model packs itself; ``datasets_for`` makes them from a
recipe's data section with the resolved base's tokenizer. ``MoETrainer`` is the Trainer whose
``save_model`` writes the whole adapter of a model given expert parallelism by
``moe_plugin.parallel.hf_expert_parallel.parallelize_experts``. Usage, and the settings a CPU machine needs
(``use_cpu=True`` with a ``ds_configs/`` file): docs/hf-trainer.md (expert parallelism: section 3).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from .compat import check_all
from .compat.transformers import save_trainer_output
from .training.data.pipeline import IGNORE, Example
from .training.metrics.logger import Logger, NullLogger
from .training.metrics.moe import MoEMetrics
from .training.metrics.run_logger import make_logger

__all__ = [
    "MoEMetricsCallback",
    "MoETrainer",
    "CausalLMDataset",
    "collate_causal_lm",
    "datasets_for",
    "loadable_adapter_config",
]


class CausalLMDataset(torch.utils.data.Dataset):
    """``examples`` (``Example``: ``input_ids``/``labels``, -100 where untrained) as ``{"input_ids", "labels"}``
    rows of Python lists."""

    def __init__(self, examples: Sequence[Example]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        return {"input_ids": list(self.examples[i].input_ids), "labels": list(self.examples[i].labels)}


def collate_causal_lm(rows: Sequence[Dict[str, List[int]]], pad_id: int = 256) -> Dict[str, torch.Tensor]:
    """Rows -> ``input_ids``/``labels``/``attention_mask`` ``[B, T]``, right-padded to the longest row (labels
    -100 and mask 0 on the padding; the model packs the real tokens, so padding changes no result)."""
    if not rows:
        raise ValueError("rows: a batch needs at least one row; check the dataset and the batch size")
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        labels[i, :n] = torch.as_tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def datasets_for(resolved, data_section, seed: int = 0):
    """``(train, held_out, collator)`` for the Trainer: the recipe's data section tokenized with the resolved
    base's own tokenizer (``recipe/resolved_model.py``: its chat template, image token, labels) and batches
    padded with its pad id."""
    import functools

    from .training.data.pipeline import load_examples

    train, held_out = load_examples(data_section, seed, resolved.tokenizer, resolved.tokens, resolved.processor)
    collator = functools.partial(collate_causal_lm, pad_id=resolved.tokens.pad_id)
    return CausalLMDataset(train), CausalLMDataset(held_out), collator


class MoETrainer(Trainer):
    """``transformers.Trainer`` whose ``save_model`` writes the whole adapter of an expert-parallel model.

    With ``moe_plugin.parallel.hf_expert_parallel.parallelize_experts`` each rank holds the adapters of its own
    experts only, and the Trainer's own save would write rank 0's. Here every rank takes part in
    ``hf_expert_parallel.adapter_state`` (ZeRO-3 gathered, expert adapters all-gathered over the expert-parallel
    group) and the saving rank writes it through peft's ``save_pretrained``: a plain peft adapter for all ``E``
    experts, loadable on one process. Without expert parallelism it is ``Trainer.save_model`` unchanged.

    Construction checks, once per process, the transformers and peft internals the project reaches
    (``moe_plugin.compat``; DeepSpeed's too when ``args.deepspeed`` is set): a version that moved them fails
    here, naming the upstream name and the pinned version, not in the middle of a save.
    """

    def __init__(self, *args, **kwargs):
        check_all(("torch", "transformers", "peft"))
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            check_all(("deepspeed",))

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        loadable_adapter_config(self.model)
        if _expert_parallel_size(self.model) == 1:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        hep = sys.modules["moe_plugin.parallel.hf_expert_parallel"]
        state = hep.adapter_state(self.model)  # collective: every rank
        if self.args.should_save:
            save_trainer_output(self, output_dir, state)


def _expert_parallel_size(model) -> int:
    """The expert-parallel size ``parallelize_experts`` gave ``model`` (1 without it)."""
    # a model can only be expert-parallel once that module was imported (it imports megatron-core)
    hep = sys.modules.get("moe_plugin.parallel.hf_expert_parallel")
    return 1 if hep is None else hep.expert_parallel_size(model)


def loadable_adapter_config(model) -> None:
    """Make the peft configs of ``model`` (a peft model of this project's ``MoEPluginForCausalLM``) say what plain
    ``peft.AutoPeftModelForCausalLM.from_pretrained(adapter)`` needs of the adapter the Trainer saves: ``task_type``
    "CAUSAL_LM" where the ``LoraConfig`` left it unset. Without it peft 0.21 writes an ``auto_mapping`` naming
    ``moe_plugin.models.modeling``, which ``AutoPeftModel`` refuses as outside its import allowlist (peft/auto.py);
    the adapter's tensors are the same either way. The base's path is absolute already
    (``MoEPluginPreTrainedModel.from_pretrained``); a relative one recorded otherwise is made absolute here,
    against this process's working directory, where it was loaded from. Anything else is left as it is."""
    from .models.modeling import MoEPluginForCausalLM

    configs = getattr(model, "peft_config", None)
    get_base = getattr(model, "get_base_model", None)
    if not isinstance(configs, dict) or get_base is None or not isinstance(get_base(), MoEPluginForCausalLM):
        return
    for config in configs.values():
        if getattr(config, "task_type", "") is None:
            config.task_type = "CAUSAL_LM"
        base = getattr(config, "base_model_name_or_path", None)
        if isinstance(base, str) and not os.path.isabs(base) and os.path.isdir(base):
            config.base_model_name_or_path = os.path.abspath(base)


def _wandb_section(wandb: Union[None, str, dict, object]):
    from .recipe.schema import LoggingSection, recipe_from_dict

    if wandb is None or isinstance(wandb, str):
        wandb = {} if wandb is None else {"mode": wandb}
    if isinstance(wandb, dict):
        # the recipe's schema checks it: the same fields and messages as logging.wandb of a recipe
        values = {"output_dir": "-", "model": {"preset": "tiny"}, "logging": {"wandb": dict(wandb)}}
        return recipe_from_dict(values, source="MoEMetricsCallback(wandb=...)").logging.wandb
    return LoggingSection(wandb=wandb).wandb


class MoEMetricsCallback(TrainerCallback):
    """Logs the MoE metrics of a ``transformers.Trainer`` run of this project's Hugging Face model.

    ``wandb``: ``"offline"`` (the default: no network), ``"online"`` or ``"disabled"``, or the fields of a
    recipe's ``logging.wandb`` (``{"mode", "project", "name", "dir"}``); the run's files go to ``args.output_dir``
    unless ``dir`` says otherwise, beside ``expert_load.png``. ``logger``: a ready ``Logger`` to use instead
    (rank 0's; the other ranks log nothing). Every rank must have the callback: the metrics are summed over the
    ranks at each logging step.
    """

    def __init__(self, wandb: Union[None, str, dict, object] = None, logger: Optional[Logger] = None):
        self.wandb = _wandb_section(wandb)
        self.logger, self._given_logger = logger, logger is not None
        self.metrics: Optional[MoEMetrics] = None
        self._handles = []

    def on_init_end(self, args, state, control, **kwargs):
        # at the end of Trainer(...): before transformers' own W&B callback starts a run at on_train_begin, and
        # before the DeepSpeed engine is built in train(), whose ZeRO-3 set-up gathers
        _prepare(args)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _prepare(args)  # again: a callback added after the Trainer was made never saw on_init_end
        if model is None:
            raise ValueError(
                "MoEMetricsCallback: the Trainer passed no model to on_train_begin; add the callback "
                "through Trainer(callbacks=[...])"
            )
        self.rank = args.process_index
        if self.logger is None:
            from .recipe.schema import LoggingSection

            section = LoggingSection(progress_bar=False, wandb=self.wandb)  # the Trainer draws its own bar
            self.logger = (
                make_logger(self.rank, section, os.path.abspath(args.output_dir), config=args.to_dict())
                if self.rank == 0
                else NullLogger()
            )
        elif self.rank != 0:
            self.logger = NullLogger()
        loadable_adapter_config(model)  # before any save: checkpoints of save_strategy too
        # the expert-parallel size: each EP rank's share of the load (moe/rank_load_max_over_mean)
        self.metrics = MoEMetrics(model, ep_size=_expert_parallel_size(model))
        self._layers = [layer for _, layer in self.metrics.layers]
        for layer in self._layers:
            layer.reset_load()  # nothing counted before training belongs to the first window
        self._loads = None
        self._tokens = 0.0
        self._handles.append(model.register_forward_pre_hook(self._count_tokens, with_kwargs=True))
        self._clock = time.perf_counter()

    def _count_tokens(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
        self._tokens += float(mask.sum()) if mask is not None else float(ids.numel()) if ids is not None else 0.0

    def on_step_end(self, args, state, control, **kwargs):
        loads = [layer.pop_load() for layer in self._layers]
        if self._layers and all(load is not None for load in loads):
            stacked = torch.stack([load.detach().double().cpu() for load in loads])
            self._loads = stacked if self._loads is None else self._loads + stacked

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        step = state.global_step
        if "loss" in logs:  # a training log line; every rank gets it, so the sums below may be collective
            tokens = _summed(self._tokens)
            elapsed = max(time.perf_counter() - self._clock, 1e-9)
            loads = None if self._loads is None else torch.as_tensor(_summed(self._loads))
            metrics = {"train/loss": float(logs["loss"])}
            for key, name in (("learning_rate", "train/lr"), ("grad_norm", "train/grad_norm")):
                if logs.get(key) is not None:
                    metrics[name] = float(logs[key])
            metrics["train/tokens_per_s"] = tokens / elapsed
            metrics.update(self.metrics.collect(loads))
            self.logger.log(step, metrics)
            self._loads, self._tokens, self._clock = None, 0.0, time.perf_counter()
        evals = {
            f"eval/{k[len('eval_') :]}": float(v)
            for k, v in logs.items()
            if k.startswith("eval_") and isinstance(v, (int, float))
        }
        if evals:
            self.logger.log(step, evals)

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.metrics is not None:
            self.metrics.close()
        if self.logger is not None:
            self.logger.close()  # writes expert_load.png and ends the W&B run
            if not self._given_logger:
                self.logger = None


def _summed(value):
    """``value`` (a float or a tensor) summed over every rank (a collective when several are up)."""
    t = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        t = t.cpu()
    return float(t) if t.dim() == 0 else t


def _prepare(args) -> None:
    """Refuse the settings ``_check_args`` names; under DeepSpeed (its communication layer is up once the
    ``TrainingArguments`` exist) make ZeRO-3 call torch's current collectives, as the recipe trainer does: their
    deprecated aliases printed a FutureWarning per step and rank into the progress bar."""
    _check_args(args)
    if args.deepspeed:
        from .compat.deepspeed import use_current_collectives

        use_current_collectives()


def _check_args(args) -> None:
    """Settings that would make the run silently different from what was asked."""
    report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
    if "wandb" in report_to:
        raise ValueError(
            'TrainingArguments.report_to includes "wandb": transformers\' own W&B callback would '
            'start a second run beside MoEMetricsCallback\'s; set report_to="none" and pass '
            'MoEMetricsCallback(wandb="online") (or "offline") instead'
        )
    if args.deepspeed:
        from accelerate.state import AcceleratorState, DistributedType

        if AcceleratorState().distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                f"TrainingArguments.deepspeed is {args.deepspeed!r}, but accelerate runs without "
                "DeepSpeed (ACCELERATE_USE_CPU makes it ignore the DeepSpeed config); unset "
                "ACCELERATE_USE_CPU and pass use_cpu=True to TrainingArguments instead"
            )
    if dist.is_available() and dist.is_initialized() and args.world_size != dist.get_world_size():
        # without use_cpu on a machine without GPUs, accelerate finds no backend and counts one process
        raise ValueError(
            f"TrainingArguments: the Trainer counts {args.world_size} process(es) but "
            f"{dist.get_world_size()} are running, so every rank would read the same batches; on "
            "a CPU machine pass use_cpu=True"
        )
