"""The recipe: one JSON file that says which model, which adapters, which data, how to train and where to write.

Every section is a strict pydantic model: a wrong type ("10" for an integer), an out-of-range number or an
unknown key at any depth is an error. All of a recipe's problems come back together in one ``RecipeError``
(a ``ValueError``), one line per problem: ``<dotted.path>: <what is wrong>; <what would fix it>``.

Validation runs in two passes so that a bad recipe is refused before torch loads. The first is pydantic alone
(types, ranges, unknown keys, files that must exist, checks across fields): importing this module loads
neither torch nor transformers. The second checks the ``model`` section against the model's config (the
preset's name, the override keys, the config those overrides build); it needs transformers, which imports
torch, so it runs only once the first pass found nothing, and its problems come in a second error.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import Field, ValidationError

from ..limits import LIMITS
from .guards_section import GuardsSection
from .errors import describe_errors
from .model_section import ModelSection
from .section import DEFER_MODEL_CHECKS, Problem, _field, _Section

# the sizes a run accepts are the planner's (limits.py), so whatever trains can be planned; steps: a
# billion optimizer steps is centuries of any real run, and keeps every count exact in float64 metrics
MAX_STEPS = 10**9


class RecipeError(ValueError):
    """Every problem of one recipe; ``problems`` holds ``(dotted.path, message)`` pairs."""

    def __init__(self, source: str, problems: List[Tuple[str, str]]):
        self.source, self.problems = source, list(problems)
        lines = [f"{path}: {message}" for path, message in self.problems]
        super().__init__(
            f"recipe {source}: {lines[0]}"
            if len(lines) == 1
            else f"recipe {source}: {len(lines)} problems\n" + "\n".join(f"  {line}" for line in lines)
        )


# DeepSeek-V3's sequence-wise balance loss under LoRA when an adapter is on the router, measured on the main job
# (docs/router-balance.md): the smallest of 1e-3, 1e-2, 3e-2, 0.1 that kept every layer within 1.5x the mean load
# and every EP rank within the capacity factor 1.25 after the first 25 steps (busiest expert 3.1x -> 1.2x at
# step 150, held-out accuracy 0.98 either way)
DEFAULT_ROUTER_AUX_LOSS_COEFF = 0.1


class RouterBalanceSection(_Section):
    """The sequence-wise auxiliary balance loss (``moe_plugin.layers.moe.balancing``, per document): its
    coefficient, 0 for none; null under ``lora`` is the default (on when a LoRA target is a router)."""

    aux_loss_coeff: Optional[float] = _field(
        None, "use 0 (no balance loss) or a positive coefficient up to 1, e.g. 0.1", ge=0, le=1
    )


def targets_router(target_modules: List[str]) -> bool:
    """Whether a ``target_modules`` entry names the MoE router ``gate`` (peft matches a name or its suffix)."""
    return any(t == "gate" or t.endswith(".gate") for t in target_modules)


class LoraSection(_Section):
    """LoRA adapters on ``target_modules`` (Linear layers) and ``target_parameters`` (expert weights);
    ``router_balance`` the balance loss that keeps the experts balanced while an adapter moves the router."""

    r: int = _field(8, "use a positive rank, e.g. 8", gt=0)
    alpha: float = _field(
        16.0,
        "alpha 0 scales the adapter by alpha / r = 0, so it trains an adapter that "
        "does nothing; use a positive alpha, e.g. 16",
        gt=0,
    )
    dropout: float = _field(0.0, "use a probability in [0, 1), e.g. 0.05", ge=0, lt=1)
    target_modules: List[str] = _field(default_factory=lambda: ["q_proj", "k_proj", "gate"], example=["q_proj"])
    target_parameters: List[str] = _field(default_factory=list, example=["experts.w1"])
    router_balance: RouterBalanceSection = Field(default_factory=RouterBalanceSection)

    def aux_loss_coeff(self) -> float:
        """The balance loss coefficient: the section's, or by default ``DEFAULT_ROUTER_AUX_LOSS_COEFF`` when a
        target is the router (the frozen selection bias cannot follow the adapter) and 0 otherwise."""
        given = self.router_balance.aux_loss_coeff
        if given is not None:
            return float(given)
        return DEFAULT_ROUTER_AUX_LOSS_COEFF if targets_router(self.target_modules) else 0.0

    def peft_config(self):
        """peft's ``LoraConfig`` for this section (``moe_plugin.lora.lora_config``)."""
        from ..lora import lora_config

        return lora_config(self.r, self.alpha, self.target_modules, self.target_parameters, self.dropout)

    def _problems(self) -> List[Problem]:
        if self.target_modules or self.target_parameters:
            return []
        return [
            (
                "target_modules",
                "lora.target_modules and lora.target_parameters are both empty, so nothing "
                'would train; name at least one target, e.g. ["q_proj"], or set "lora": null '
                "to train every parameter",
            )
        ]


class DataSection(_Section):
    """``arithmetic`` (generated), ``sft`` (chat messages: JSONL or a ``datasets`` file with a ``messages``
    column) or ``text`` (JSONL with a ``text`` field)."""

    kind: Literal["arithmetic", "sft", "text"] = "arithmetic"
    path: Optional[str] = _field(None, example="data/train.jsonl")
    operation: Literal["+", "-", "*"] = "+"
    num_documents: int = _field(
        2000, f"use a positive count up to {LIMITS['num_documents']:,}, e.g. 2000", gt=0, le=LIMITS["num_documents"]
    )
    seq_len: int = _field(
        256,
        "a window needs at least 2 tokens (an input and its next token), and at most "
        f"{LIMITS['seq_len']:,}; use e.g. 256",
        gt=1,
        le=LIMITS["seq_len"],
    )
    eval_fraction: float = _field(0.05, "use a fraction in [0, 0.5], e.g. 0.05 (0: no held-out set)", ge=0, le=0.5)
    pack: bool = True
    # sft: OpenAI tool specs for every record without its own "tools", and the base's chat template switches
    # (e.g. {"thinking": false, "thinking_effort": "high"}), passed to every rendering (docs/training.md)
    tools: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Dict[str, Any] = {}

    def _problems(self) -> List[Problem]:
        if self.kind == "arithmetic":
            return (
                []
                if self.path is None
                else [
                    (
                        "path",
                        'is not read when data.kind is "arithmetic" (its data '
                        "is generated); remove it, or set data.kind",
                    )
                ]
            )
        if self.kind != "sft" and (self.tools is not None or self.chat_template_kwargs):
            return [
                (
                    "tools" if self.tools is not None else "chat_template_kwargs",
                    f'is read only when data.kind is "sft" (chat records), not {self.kind!r}; remove it',
                )
            ]
        if self.path is None:
            return [("path", f"is required when data.kind is {self.kind!r}; give the data file")]
        if os.path.isdir(self.path) and self.kind == "sft":
            return []  # a datasets save_to_disk directory; the reader names anything else it finds there
        if not os.path.isfile(self.path):
            what = "is a directory" if os.path.isdir(self.path) else "does not exist"
            return [
                (
                    "path",
                    f"{self.path!r} {what} (relative paths resolve against {os.getcwd()}); give an existing data file",
                )
            ]
        return []


class ParallelSection(_Section):
    """``capacity_factor``: the per-rank load, over its balanced share, that the plan's dispatch buffers assume
    (``moe-plugin plan`` reads it); the trainer warns when a rank's measured load goes past it.
    ``moe_overlap_chunks``: N > 1 sends a rank's experts' tokens in N chunks, each chunk's experts running while
    the next chunk travels (``megatron.expert_dispatch``); the numbers are bitwise those of 1.
    ``sharding``: the engine that shards the model (``training/engines``): ``"zero3"``, DeepSpeed's ZeRO-3 (the
    recipe's ``deepspeed`` config), or ``"fsdp2"``, torch's ``fully_shard`` per decoder layer and the root over the
    data x context ranks, routed experts kept whole on their expert-parallel rank (docs/training.md, "FSDP2")."""

    backend: Literal["megatron", "hf"] = "megatron"
    sharding: Literal["zero3", "fsdp2"] = "zero3"
    # FSDP2: whether each layer frees its gathered parameters after its forward (gathered again for the backward)
    reshard_after_forward: bool = True
    expert_parallel_size: int = _field(
        1, "use 1 (no expert parallelism) or a divisor of the experts and the world size", ge=1
    )
    capacity_factor: float = _field(
        1.25, f"use a factor from 1 (exact balance) to {LIMITS['capacity']:g}, e.g. 1.25", ge=1, le=LIMITS["capacity"]
    )
    # ranks that split every packed row into contiguous slices (docs/context-parallel.md); both backends
    context_parallel_size: int = _field(1, "use 1 (no context parallelism) or a divisor of the world size", ge=1)
    # the expert-parallel dispatch in this many overlapped chunks of a rank's experts (docs/moe-overlap.md)
    moe_overlap_chunks: int = _field(
        1, "use 1 (each all-to-all waited in turn) or up to the experts a rank holds, e.g. 2 or 4", ge=1
    )

    def _problems(self) -> List[Problem]:
        if self.sharding == "fsdp2" and self.backend != "megatron":
            return [
                (
                    "sharding",
                    '"fsdp2" runs on the megatron backend (the hf backend shards with ZeRO-3); use parallel.backend '
                    '"megatron", or sharding "zero3"',
                )
            ]
        return []


class ScheduleSection(_Section):
    """Optimizer steps; one step is ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size``
    windows on every data-parallel rank."""

    steps: int = _field(
        60, f"use a positive number of optimizer steps up to {MAX_STEPS:,}, e.g. 60", gt=0, le=MAX_STEPS
    )
    micro_batch_size: int = _field(
        2, f"use a positive batch size up to {LIMITS['micro_batch']:,}, e.g. 2", gt=0, le=LIMITS["micro_batch"]
    )
    gradient_accumulation_steps: int = _field(
        1, f"use 1 (no accumulation) or more, up to {LIMITS['grad_accum']:,}", gt=0, le=LIMITS["grad_accum"]
    )
    lr: float = _field(3e-3, "use a positive learning rate, e.g. 0.003", gt=0)
    min_lr: float = _field(0.0, "use 0 or a positive floor for the decayed learning rate", ge=0)
    warmup_steps: int = _field(0, "use 0 (no warm-up) or a positive number of steps", ge=0)
    decay: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = _field(0.0, "use 0 (no weight decay) or a positive coefficient, e.g. 0.01", ge=0)
    clip_grad_norm: Optional[float] = _field(1.0, "use a positive norm, e.g. 1.0, or null for no clipping", gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    # what the backward recomputes instead of keeping (moe_plugin/layers/recompute.py; the router never is)
    activation_checkpointing: Literal["off", "selective", "full", "full_routing"] = "off"

    def _problems(self) -> List[Problem]:
        problems: List[Problem] = []
        if self.min_lr > self.lr:
            problems.append(("min_lr", f"{self.min_lr} is above schedule.lr ({self.lr}); use a floor <= lr"))
        if self.warmup_steps >= self.steps:
            problems.append(
                (
                    "warmup_steps",
                    f"{self.warmup_steps} leaves no step after the warm-up "
                    f"(schedule.steps is {self.steps}); use fewer than {self.steps}",
                )
            )
        return problems


class AnswersSection(_Section):
    """Held-out answers by greedy generation at the end of a LoRA run (``moe_plugin/training/metrics/answer_eval.py``):
    ``path`` is a chat JSONL whose records end with the expected assistant answer."""

    path: str = _field(
        fix='give the held-out chat JSONL, e.g. "recipes/data/shapes_heldout.jsonl"',
        example="recipes/data/shapes_heldout.jsonl",
        min_length=1,
    )
    limit: Optional[int] = _field(None, "use a positive number of records, or null for all of them", gt=0)
    max_new_tokens: int = _field(16, "use a positive number of tokens, longer than any answer, e.g. 16", gt=0)

    def _problems(self) -> List[Problem]:
        if not os.path.isfile(self.path):
            what = "is a directory" if os.path.isdir(self.path) else "does not exist"
            return [
                (
                    "path",
                    f"{self.path!r} {what} (relative paths resolve against {os.getcwd()}); give an "
                    "existing held-out chat JSONL",
                )
            ]
        return []


class EvalSection(_Section):
    every: int = _field(0, "use 0 (evaluate only at the end) or a positive number of steps", ge=0)
    batches: int = _field(4, "use a positive number of held-out batches, e.g. 4", gt=0)
    answers: Optional[AnswersSection] = None  # generated answers at the end: before/after LoRA, or the full model


class CheckpointSection(_Section):
    every: int = _field(0, "use 0 (save only at the end) or a positive number of steps", ge=0)
    keep: int = _field(2, "use a positive number of checkpoints to keep, e.g. 2", gt=0)


class WandbSection(_Section):
    """The run's W&B record (docs/hf-trainer.md section 2): ``offline`` writes it under ``dir`` with no
    network (``wandb sync`` uploads it later), ``online`` streams it (needs a W&B login), ``disabled`` writes
    none. ``dir`` defaults to the run's ``output_dir``, ``name`` to that directory's name."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = _field(
        "moe_plugin", 'give the W&B project name, e.g. "moe_plugin"', example="moe_plugin", min_length=1
    )
    name: Optional[str] = _field(
        None,
        'give the run a name, e.g. "tiny_lora", or null for the output directory\'s name',
        example="tiny_lora",
        min_length=1,
    )
    dir: Optional[str] = _field(
        None,
        "give a directory for the W&B run files, or null for the run's output_dir",
        example="outputs/wandb",
        min_length=1,
    )

    def _problems(self) -> List[Problem]:
        if self.project.strip() == "" or "/" in self.project:
            return [
                (
                    "project",
                    f'{self.project!r} is not a W&B project name; use a non-blank name without "/", e.g. "moe_plugin"',
                )
            ]
        if self.dir is not None and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            return [
                (
                    "dir",
                    f"{self.dir!r} is a file; give a directory for the W&B run files, or null for the run's output_dir",
                )
            ]
        return []


class LoggingSection(_Section):
    every: int = _field(10, "it is the number of steps between log lines; use a positive number, e.g. 10", gt=0)
    progress_bar: bool = True
    wandb: WandbSection = Field(default_factory=WandbSection)


class Recipe(_Section):
    output_dir: str = _field(
        fix='give the directory this run writes to, e.g. "outputs/my_run"', example="outputs/my_run", min_length=1
    )
    seed: int = _field(0, "use 0 or a positive seed", ge=0)
    deepspeed: Optional[str] = _field(None, example="ds_configs/zero3_lora.json")
    model: ModelSection = _field(fix='add a model section, e.g. "model": {"preset": "tiny"}')
    lora: Optional[LoraSection] = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    guards: GuardsSection = Field(default_factory=GuardsSection)  # when a run stops itself (training/guards.py)
    # full training's balance loss, beside the selection-bias rule (LoRA runs: lora.router_balance)
    router_balance: Optional[RouterBalanceSection] = None

    def _problems(self) -> List[Problem]:
        problems: List[Problem] = []
        if not self.output_dir.strip():
            problems.append(("output_dir", 'is empty; give the directory this run writes to, e.g. "outputs/my_run"'))
        cp = self.parallel.context_parallel_size
        if self.data.seq_len % cp:
            problems.append(
                (
                    "parallel.context_parallel_size",
                    f"{cp} does not divide data.seq_len {self.data.seq_len}; every rank holds an equal slice of "
                    f"each row: make seq_len a multiple of {cp}",
                )
            )
        if self.deepspeed is not None and self.parallel.sharding != "zero3":
            problems.append(
                (
                    "deepspeed",
                    f"is a DeepSpeed config, but parallel.sharding is {self.parallel.sharding!r}, which does not "
                    'run DeepSpeed; remove "deepspeed", or set parallel.sharding "zero3"',
                )
            )
        if self.router_balance is not None and self.lora is not None:
            problems.append(
                (
                    "router_balance",
                    'is for full training ("lora": null); under LoRA set lora.router_balance.aux_loss_coeff instead',
                )
            )
        return problems

    def router_aux_loss_coeff(self) -> float:
        """The balance loss coefficient this run trains with (0: none): ``lora.router_balance`` under LoRA
        (``LoraSection.aux_loss_coeff``), else the top-level ``router_balance`` (default 0, the bias balances)."""
        if self.lora is not None:
            return self.lora.aux_loss_coeff()
        given = self.router_balance.aux_loss_coeff if self.router_balance is not None else None
        return float(given or 0.0)

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON values; ``recipe_from_dict(recipe.to_dict())`` gives the recipe back."""
        return self.model_dump()


def recipe_from_dict(values: Any, source: str = "(from a dict)") -> Recipe:
    """The validated recipe; raises ``RecipeError`` listing every problem (``source`` names it there): first
    those pydantic finds without torch, then, once there are none, those of the model section's config."""
    try:
        recipe = Recipe.model_validate(values, context={DEFER_MODEL_CHECKS: True})
    except ValidationError as err:
        raise RecipeError(source, describe_errors(err, Recipe)) from None
    problems = recipe.model._model_config_problems()
    if problems:
        raise RecipeError(source, [(f"model.{path}" if path else "model", message) for path, message in problems])
    return recipe


def load_recipe(path: str) -> Recipe:
    """Read and validate a recipe JSON file; errors name the file (and the line of a JSON syntax error)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise ValueError(
            f"recipe {path}: cannot read it ({err.strerror}; relative paths resolve against "
            f"{os.getcwd()}); check the path"
        ) from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"recipe {path}, line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); "
            "fix the syntax (JSON allows no comments and no trailing commas)"
        ) from None
    return recipe_from_dict(values, source=path)
