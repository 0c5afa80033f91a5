"""The training recipes the tests run, built in one place: ``recipe(output_dir, ...)`` is the shape most of the
suite's runs share (the tiny model, LoRA r=4 alpha=8 on attention, router and experts, 300 arithmetic documents
of 64 tokens, one evaluation batch, no checkpoints, a log line a step), and a test says only what its run does
differently. The dicts are the ones ``moe_plugin.recipe.schema.recipe_from_dict`` reads (docs/testing.md).

How a test's sections combine with the shape (``recipe(out, schedule={"steps": 4})``):

* a dict merges into the shape's section key by key, nested dicts too (``logging={"wandb": {...}}`` keeps
  ``every`` and ``progress_bar``);
* any other value (a list, a number, a string, ``None``) replaces what the shape has: ``lora=None`` is
  ``"lora": null`` (every parameter trains), ``deepspeed=None`` runs without DeepSpeed;
* ``OMIT`` leaves the key out of the recipe, so the schema's default applies (``eval=OMIT``,
  ``schedule={"warmup_steps": OMIT}``);
* ``whole(value)`` takes ``value`` as it is, unmerged: another model (``model=whole({"preset": "tiny"})``) or
  another kind of data (``data=whole({"kind": "sft", ...})``).

``minimal(output_dir, ...)`` is the other family's start: a run as a user writes it, the tiny preset without
AttnRes (or ``base``) and no progress bar, every other value the schema's default; the test adds what it sets.

``smallest(**sections)`` is the smallest recipe that parses (``outputs/test``, the tiny preset as it ships), for
tests of the recipe's own checks; there each given section replaces the shape's whole, as the test writes it.

Recipes that test the recipe format itself (malformed or minimal dicts in tests/training/test_recipe.py and the
like) stay literal: there the literal is the point.
"""

from __future__ import annotations

import copy

ZERO3 = "ds_configs/zero3_lora.json"
ATTENTION_ROUTER = ["q_proj", "k_proj", "gate"]
EXPERTS = ["experts.w1", "experts.w2", "experts.w3"]
TINY = {"preset": "tiny", "overrides": {"attn_res": False}}  # the tiny preset without AttnRes


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT = _Omit()
"""A section or key given as ``OMIT`` is left out of the recipe: the schema's default applies."""


class whole:  # noqa: N801 (used like a function: whole({...}))
    """``value`` as it is, not merged into the shape's section or key."""

    def __init__(self, value):
        self.value = value


def recipe(output_dir, *, world: int = 1, ep: int = 1, batch: int = 4, base=None, **sections) -> dict:
    """The common training recipe for a run into ``output_dir``, with ``sections`` merged in (module docstring).

    world: the processes the run takes: above 1, ZeRO-3 (``ds_configs/zero3_lora.json``) and a micro-batch of
        ``batch // world``, so that every layout trains the same ``batch`` rows a step.
    ep: ``parallel.expert_parallel_size`` (the backend is megatron unless ``parallel`` says otherwise).
    batch: the global batch, in rows of ``data.seq_len``.
    base: a saved model to start from (``model.from_pretrained``) instead of the tiny preset without AttnRes.
    """
    shape = {
        "output_dir": str(output_dir),
        "seed": 3,
        "deepspeed": ZERO3 if world > 1 else None,
        "model": {"from_pretrained": str(base)} if base is not None else TINY,
        "lora": {"r": 4, "alpha": 8, "target_modules": ATTENTION_ROUTER, "target_parameters": EXPERTS},
        "data": {"kind": "arithmetic", "operation": "-", "num_documents": 300, "seq_len": 64, "eval_fraction": 0.05},
        "parallel": {"backend": "megatron", "expert_parallel_size": ep},
        "schedule": {"steps": 2, "micro_batch_size": batch // world, "lr": 2e-2, "warmup_steps": 0},
        "eval": {"every": 0, "batches": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": 1, "progress_bar": False},
    }
    return _merged(shape, sections)


def minimal(output_dir, *, base=None, **sections) -> dict:
    """The smallest recipe that trains, with ``sections`` merged in as for ``recipe``: ``output_dir``, the tiny
    preset without AttnRes (or ``base``, ``model.from_pretrained``) and ``logging.progress_bar`` off; every other
    value is the schema's default (one process, megatron, arithmetic data, ``lora`` on by default)."""
    shape = {
        "output_dir": str(output_dir),
        "model": {"from_pretrained": str(base)} if base is not None else TINY,
        "logging": {"progress_bar": False},
    }
    return _merged(shape, sections)


SMALLEST = {"output_dir": "outputs/test", "model": {"preset": "tiny"}}


def smallest(**sections) -> dict:
    """The smallest recipe that parses, ``SMALLEST``, with each of ``sections`` in place of its own (not merged:
    a test of the recipe's checks gives the section under test exactly)."""
    values = copy.deepcopy(SMALLEST)
    values.update(sections)
    return values


def _merged(shape: dict, changes: dict) -> dict:
    """``shape`` with ``changes`` merged in (the rules in the module docstring); neither is modified."""
    out = copy.deepcopy(shape)
    for key, value in changes.items():
        if value is OMIT:
            out.pop(key, None)
        elif isinstance(value, whole):
            out[key] = copy.deepcopy(value.value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = _plain(value)
    return out


def _plain(value):
    """``value`` deep-copied, with any ``OMIT`` keys in its dicts left out and ``whole`` unwrapped."""
    if isinstance(value, whole):
        return copy.deepcopy(value.value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not OMIT}
    return copy.deepcopy(value)
