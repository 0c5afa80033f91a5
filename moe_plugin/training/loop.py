"""The training loop: one loop for every backend and layout (see ``backends/base.py`` for the seam).

``train(recipe)`` validates everything it can before any process group or model exists (the recipe, the
layout against the world size, the engine's config, the output directory), then builds the backend's model,
hands it to the sharding engine of ``parallel.sharding`` (``engines/``: DeepSpeed ZeRO-3 or torch's FSDP2) with
a torch AdamW and the recipe's schedule, and runs optimizer steps of ``gradient_accumulation_steps``
micro-batches. The engine reduces gradients (within the groups ``moe_plugin.parallel.layout`` owns), clips them
with one global norm on every rank and steps. The loss of a step is the mean over every label token of the
global batch, whatever the layout: each micro-batch's token-loss sum is divided by the step's global token
count times the engine's averaging factors (``step_scale``).

Checkpoints (every ``checkpoint.every`` steps and at the end) hold the adapters (or, for full training, every
trainable parameter), optimizer state, scheduler, step, data position and RNG states, never the frozen base;
a run started again on the same ``output_dir`` continues from the newest complete one. Nothing read back from a
checkpoint is unpickled (``engine_state.py`` writes and reads a step): the trainer's own state is JSON and
safetensors (``checkpoint.py``), DeepSpeed's engine files load with ``weights_only=True``
(``compat/deepspeed.py``). ``losses.json`` holds every optimizer step's loss, ``results.json`` the
final and held-out losses and the timings; the adapter is written in PEFT format to ``output_dir/adapter``
(``exporting.py``).

Safety (docs/training.md): the data is read before ``output_dir`` is claimed; a run records the inputs it read
(``inputs.py``) and a resume refuses changed ones unless ``allow_changed_inputs``; a non-finite or diverging
loss stops the run before the step is saved or any adapter written (``guards.py``); a finished run started
again never rewrites its outputs.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..fileio import write_json_atomic
from ..lora import REPORT_ATTRIBUTE
from ..weights.base_loading import PRECISION_NOTE
from ..compat import check_all
from ..parallel.distributed import choose_device
from ..parallel.layout import ParallelLayout
from .backends import get_backend
from .checkpoint import CheckpointManager
from .engines import engine_class
from .engine_state import agree, load_latest, rng_state, save_step, set_rng_state
from .trainable_state import layout_free_state
from .data.pipeline import StepBatches, eval_batches, label_token_count, load_examples, pack_examples
from .exporting import write_outputs
from .guards import StepGuard, TrainingStopped
from .metrics.moe import MoEMetrics, global_parameter_counts
from ..recipe.schema import Recipe
from ..recipe.world import check_layout, env_world_size
from ..recipe.resolved_model import resolve_model
from .run_dir import claim_for_training
from .metrics.run_logger import make_logger
from .runtime import all_ok, forget_processes, start_processes, stop_processes
from .step_math import balance_loads, global_sum, step_scale

__all__ = ["TrainResult", "Trainer", "TrainingStopped", "train"]


@dataclass
class TrainResult:
    losses: List[float] = field(default_factory=list)  # every optimizer step's loss, resumed parts included
    grad_norms: List[float] = field(default_factory=list)  # this run's steps only
    eval_loss: Optional[float] = None
    output_dir: str = ""
    resumed_from: Optional[int] = None  # the step of the checkpoint this run continued from
    step_time_s: float = 0.0  # mean wall time of this run's steps (start-up excluded)
    answers: Optional[dict] = None  # rank 0: the held-out answers record of eval.answers (answer_eval.py)


def train(recipe: Recipe, allow_changed_inputs: bool = False) -> TrainResult:
    """Run ``recipe`` on this process's share of the job (see the module docstring); every rank calls it.
    ``allow_changed_inputs``: resume although the base or a data file changed since the run recorded them."""
    with Trainer(recipe, allow_changed_inputs=allow_changed_inputs) as trainer:
        return trainer.run()


class Trainer:
    """One run of a recipe on this process: ``run()`` does all of it; tests drive ``train_step`` themselves.

    Construction validates the recipe against the world size and the engine's config before any process group
    exists, then starts the processes, reads the data, claims ``output_dir`` (rank 0: ``claim_for_training``),
    builds the backend's model, the engine and the data stream, and resumes from the newest complete checkpoint.
    """

    def __init__(self, recipe: Recipe, allow_changed_inputs: bool = False):
        started = time.perf_counter()
        # DeepSpeed's, peft's and transformers' internals the run reaches, once (megatron's: its backend)
        check_all(("torch", "deepspeed", "peft", "transformers"))
        world = env_world_size()
        # the base's configs and tokenizer, read once here; everything after takes this object
        self.recipe, self.resolved = recipe, resolve_model(recipe.model)
        self.model_config = self.resolved.model_config
        check_layout(recipe, world, self.model_config.moe.num_experts, self.model_config.moe.expert_format)
        layout = ParallelLayout.from_recipe(recipe.parallel, world)  # the one layout object of the run
        self.engine_class = engine_class(layout.sharding)
        self.engine_config = self.engine_class.config(recipe, world)
        self.device = choose_device()
        self.output_dir = os.path.abspath(recipe.output_dir)
        self.allow_changed_inputs = bool(allow_changed_inputs)
        self._owns_processes = start_processes(self.device)
        self.rank = dist.get_rank()
        self.run_dir, self.backend, self.logger, self.moe_metrics, self.engine = None, None, None, None, None
        try:
            schedule, error = recipe.schedule, None
            # read and checked before output_dir is claimed, so that a bad data file leaves no trace there
            torch.manual_seed(recipe.seed)
            random.seed(recipe.seed)
            try:
                resolved, pad = self.resolved, self.resolved.tokens.pad_id
                train_examples, held_out = load_examples(
                    recipe.data, recipe.seed, resolved.tokenizer, resolved.tokens, resolved.processor
                )
                rows = pack_examples(train_examples, recipe.data.seq_len, recipe.data.pack, pad)
                self.eval_rows = pack_examples(held_out, recipe.data.seq_len, recipe.data.pack, pad) if held_out else []
            except ValueError as e:
                error = e
            agree(error, "another rank could not read the data (its error says why)")
            after_data = rng_state()
            self.checkpoints = CheckpointManager(
                os.path.join(self.output_dir, "checkpoints"),
                self.rank,
                dist.get_world_size(),
                dist.barrier,
                keep=recipe.checkpoint.keep,
            )
            if self.rank == 0:
                try:
                    base = recipe.model.from_pretrained
                    self.run_dir = claim_for_training(
                        self.output_dir,
                        recipe.to_dict(),
                        self.checkpoints,
                        os.path.realpath(base) if base else None,
                        self.allow_changed_inputs,
                        world,
                    )
                except ValueError as e:
                    error = e
            agree(error, "rank 0 could not claim output_dir (its error says why)")
            self.backend = get_backend(recipe.parallel.backend)(recipe, self.resolved, self.device, layout)
            self.layout = self.backend.setup_parallel()
            set_rng_state(after_data)  # the model draws what it drew when the data was read right before it
            self.stream = StepBatches(
                rows, schedule.micro_batch_size, schedule.gradient_accumulation_steps, self.layout.data, recipe.seed
            )
            model = self.backend.build_model(self.engine_config)
            self.counts = global_parameter_counts(model, self.layout.expert)  # every EP rank's experts
            self.engine = self.engine_class(model, recipe, self.layout, self.engine_config, self.backend)
            self.optimizer, self.scheduler = self.engine.optimizer, self.engine.lr_scheduler
            self.logger = make_logger(self.rank, recipe.logging, self.output_dir, recipe.to_dict())
            # which LoRA targets matched in which layer kinds (K3's MLA layers have no q_proj/k_proj: lora.py), and
            # what the precision policy did with the tensors the base stores in fp32 (docs/precision.md)
            for attribute in (REPORT_ATTRIBUTE, PRECISION_NOTE):
                if getattr(model, attribute, ""):
                    self.logger.message(getattr(model, attribute))
            # hooks on the routers (drift, indexer KL); per-EP-rank load against the planned capacity factor
            self.moe_metrics = MoEMetrics(
                self.engine.module, self.layout.expert, recipe.parallel.capacity_factor, warn=self.logger.message
            )
            self.result = TrainResult(output_dir=self.output_dir)
            self.guard = StepGuard(recipe.guards.divergence, self.logger.message)
            self.last_saved: Optional[int] = None
            self.step = self._resume()
            self.startup_s = time.perf_counter() - started
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the logger (its W&B run), the router hooks, the output directory and the process groups this
        trainer started. A trainer closed without ``run`` finishing leaves no W&B run open for the next one."""
        if self.logger is not None:
            self.logger.close()  # a no-op after run() closed it
            self.logger = None
        if self.moe_metrics is not None:
            self.moe_metrics.close()
            self.moe_metrics = None
        if self.backend is not None:
            self.backend.teardown()
            self.backend = None
        if self.run_dir is not None:
            self.run_dir.release()
            self.run_dir = None
        if self._owns_processes:
            if dist.is_initialized():
                stop_processes()
            forget_processes()
            self._owns_processes = False

    def describe(self) -> str:
        recipe, (n_trainable, n_total) = self.recipe, self.counts
        what = (
            "every parameter"
            if recipe.lora is None
            else (f"LoRA r={recipe.lora.r} on {list(recipe.lora.target_modules) + list(recipe.lora.target_parameters)}")
        )
        source = recipe.model.from_pretrained or f"preset {recipe.model.preset}"
        world = dist.get_world_size()
        cp = f", context parallel {self.layout.context}" if self.layout.context > 1 else ""
        return (
            f"model: {source} ({self.backend.name} backend, {world} process{'es' * (world != 1)}, expert "
            f"parallel {self.layout.expert}{cp}, {self.engine.describe()}): {n_total:,} parameters, "
            f"{n_trainable:,} trainable ({what})"
        )

    def train_step(self, on_gradients: Optional[Callable[[], None]] = None) -> float:
        """One optimizer step; returns its loss (the global token mean). ``on_gradients`` is called after the
        last backward of the step, before the engine's optimizer step (the reduced gradients are there)."""
        schedule, layout, engine = self.recipe.schedule, self.layout, self.engine
        micro_batches, label_tokens = self.stream.next_step(layout.dp_rank)
        scale = step_scale(label_tokens, layout.gradient_ranks, schedule.gradient_accumulation_steps)
        local, norm = 0.0, None
        self.lr = self.optimizer.param_groups[0]["lr"]  # this step's (the scheduler moves on in engine.step)
        for m, micro in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            loss, metrics = self.backend.loss(engine.forward, micro, scale)
            self.moe_metrics.add_loss_metrics(metrics)  # megatron's indexer KL (the HF model's: by a hook)
            engine.backward(loss, last)
            if last and on_gradients is not None:
                on_gradients()
            stepped = engine.step(last)
            norm = stepped if last else norm
            local = local + loss.detach().double()  # read once, by the step's all-reduce
        step_loss = global_sum(local, self.device) / (layout.gradient_ranks * schedule.gradient_accumulation_steps)
        self.result.losses.append(step_loss)
        self.result.grad_norms.append(norm if norm is not None else float("nan"))
        self.last_loads = balance_loads(self.backend, engine.module, self.recipe.lora is None, self.device)
        self.moe_metrics.add_step(self.last_loads)  # the logged load is over the steps since the last log
        self.step += 1
        # a local norm (no ZeRO) may be finite here and not on another rank: every rank stops alike
        finite = norm is None or math.isfinite(norm)
        self.guard.check(self.step, self.result.losses, norm if all_ok(finite) else float("nan"), self.last_saved)
        return step_loss

    def run(self) -> TrainResult:
        recipe, logger, schedule = self.recipe, self.logger, self.recipe.schedule
        logger.message(self.describe())
        logger.message(self.resolved.tokenizer_note)
        if self.step:
            logger.message(f"resuming from the checkpoint at step {self.step}")
        logger.message(f"start-up {self.startup_s:.1f} s")
        first = self.step
        # output_dir is on one file system for every rank (checkpoint.py), so every rank decides alike
        if first >= schedule.steps and os.path.isdir(
            os.path.join(self.output_dir, "adapter" if recipe.lora else "model")
        ):
            logger.message(
                f"the run had finished (step {first} of {schedule.steps}): its outputs in "
                f"{self.output_dir} stay as they are; raise schedule.steps to train on"
            )
            logger.close()
            return self.result
        logger.start(schedule.steps, self.step)
        tokens_per_step = (
            schedule.micro_batch_size * recipe.data.seq_len * self.layout.data * schedule.gradient_accumulation_steps
        )
        clock = time.perf_counter()
        self.engine.train()
        while self.step < schedule.steps:
            loss = self.train_step()
            done = self.step
            rate = tokens_per_step * (done - first) / max(time.perf_counter() - clock, 1e-9)
            logger.step(done, loss, rate)
            if done % recipe.logging.every == 0 or done == first + 1 or done == schedule.steps:
                metrics = {
                    "train/loss": loss,
                    "train/lr": self.lr,
                    "train/grad_norm": self.result.grad_norms[-1],
                    "train/tokens_per_s": rate,
                }
                metrics.update(self.moe_metrics.collect())  # collective: on every rank
                logger.log(done, metrics)
            if recipe.eval.every and done % recipe.eval.every == 0 and done != schedule.steps:
                logger.log(done, {"eval/loss": self.evaluate()})
            if recipe.checkpoint.every and done % recipe.checkpoint.every == 0 and done != schedule.steps:
                self.save()
        self.result.step_time_s = (time.perf_counter() - clock) / max(schedule.steps - first, 1)
        if self.eval_rows:
            self.result.eval_loss = self.evaluate()
            logger.log(schedule.steps, {"eval/loss": self.result.eval_loss})
        if first < schedule.steps or self.checkpoints.latest() is None:
            self.save()
        where = write_outputs(self.backend, self.engine.module, recipe, self.output_dir, self.rank)
        if self.rank == 0:
            write_json_atomic(
                os.path.join(self.output_dir, "results.json"),
                {
                    "steps": len(self.result.losses),
                    "final_loss": self.result.losses[-1] if self.result.losses else None,
                    "eval_loss": self.result.eval_loss,
                    "resumed_from": self.result.resumed_from,
                    "startup_s": self.startup_s,
                    "step_time_s": self.result.step_time_s,
                },
            )
        logger.close()
        if self.rank == 0 and self.result.losses:
            losses = self.result.losses
            print(
                f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps "
                f"({self.result.step_time_s:.2f} s a step after {self.startup_s:.1f} s of start-up); {where}",
                flush=True,
            )
        if recipe.eval.answers is not None:  # generated answers on held-out examples (answer_eval.py)
            from .metrics.answer_eval import report_answers

            self.result.answers = report_answers(
                recipe.eval.answers, self.output_dir, self.rank, dist.get_world_size(), self.device, self.resolved
            )
        return self.result

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over ``eval.batches`` held-out micro-batches per data-parallel rank. Every rank runs
        the same number of forwards (expert parallelism makes each forward a collective)."""
        layout, engine = self.layout, self.engine
        batches = eval_batches(
            self.eval_rows, self.recipe.schedule.micro_batch_size, self.recipe.eval.batches * layout.data
        )
        if not batches:
            return float("nan")
        each = max(1, len(batches) // layout.data)
        mine = [batches[(layout.dp_rank * each + i) % len(batches)] for i in range(each)]
        engine.eval()
        total, count = 0.0, 0
        for micro in mine:
            loss, _ = self.backend.loss(engine.forward, micro, 1.0)
            total += float(loss)
            count += label_token_count(micro.labels, micro.cu_seqlens) / layout.context  # each CP rank has the row
        engine.train()
        for layer in self.backend.moe_layers(engine.module):
            layer.reset_load()
        return global_sum(total, self.device) / max(global_sum(count, self.device), 1.0)

    def save(self) -> str:
        """A complete checkpoint of this step (collective; atomic across ranks)."""
        path = save_step(
            self.checkpoints,
            self.engine,
            self.step,
            self.rank,
            lambda: {"losses": self.result.losses, "data": self.stream.state_dict()},
            lambda: layout_free_state(
                self.engine, self.layout, self._lora_rank(), self.stream.rows_per_step, self._trained_buffers()
            ),
        )
        self.last_saved = self.step
        if self.rank == 0:
            write_json_atomic(os.path.join(self.output_dir, "losses.json"), self.result.losses)
        return path

    def _lora_rank(self) -> int:
        return self.recipe.lora.r if self.recipe.lora is not None else 0

    def _trained_buffers(self) -> list:
        """The buffers training changes: with the base training, the routers' selection bias (``_balance``)."""
        if self.recipe.lora is not None:
            return []
        biases = {id(layer.router.e_score_correction_bias) for layer in self.backend.moe_layers(self.engine.module)}
        return [n for n, b in self.engine.module.named_buffers() if id(b) in biases]

    def _resume(self) -> int:
        """Continue from the newest complete checkpoint, if any; the step it continues from (0: none)."""
        latest = load_latest(
            self.checkpoints, self.engine, self.rank, self.layout, self._lora_rank(), self.logger.message
        )
        if latest is None:
            return 0
        step, path, state = latest
        error = None
        try:
            self.stream.load_state_dict(state["data"])
        except ValueError as e:
            error = e
        agree(error, f"another rank could not restore the data position of {path} (its error says why)")
        self.result.losses = list(state["losses"])
        self.result.resumed_from = self.last_saved = step
        return step
