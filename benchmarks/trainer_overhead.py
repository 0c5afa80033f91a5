"""The trainer's own overhead: the product's ``Trainer.train_step`` against a bare step of the same model, 1 process.

Both run in this one process on the same built model (``Trainer.engine.module``: the megatron backend's
``GPTModel`` of ``plan_measure.SHAPE``, about 20 M parameters, LoRA r=8 on ``q_proj``, ``k_proj`` and ``gate``
as ``plan_measure.layout_recipe`` puts it, no DeepSpeed config: EP 1, ZeRO stage 0, fp32) and the same
micro-batch of 2 packed rows of ``--seq`` tokens:

* trainer step: ``trainer.train_step()`` (DeepSpeed's engine forward/backward/step, the LR scheduler, the
  MoE metrics' router hooks, the gradient norm, the loss all-reduce, the expert loads, the guard);
* bare step: ``backend.loss(module, micro, scale)`` (the model's forward and its loss, balance term included:
  the numerics of a step) -> ``loss.backward()`` -> ``torch.optim.AdamW(trainable).step()`` ->
  ``zero_grad()``, with the trainer's forward hooks (routing drift) detached; no DeepSpeed, no metrics.

The bare step reuses the trainer's first micro-batch (the arithmetic rows pack to the same ``[1, 2 * seq]``
shape every step). After 2 warm-up steps of each, ``--steps`` steps of each are timed alternately (trainer,
bare, bare, trainer, ...) so the machine's load hits both alike; printed: the median of the pairs' ratios (goal <=
1.15), the medians' ratio and the fastest steps'. Then ``--profile`` steps of each run alternately under cProfile, one
profile a step, and the top 5 sources of the trainer's own work are printed (``trainer_only``: the functions
the bare step never ran, with the built-ins they called, rolled up to the step's callees; the median step
per source).

``OMP_NUM_THREADS=1 python -m benchmarks.trainer_overhead`` (a few minutes here); ``--seq``, ``--steps``,
``--profile``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

from .harness import machine_line


def _detached_hooks(handles):
    """Take the ``RemovableHandle``s' hooks out of their modules; returns a function that puts them back."""
    taken = []
    for h in handles:
        hooks = h.hooks_dict_ref()
        if hooks is not None and h.id in hooks:
            taken.append((hooks, h.id, hooks.pop(h.id)))

    def restore():
        for hooks, key, fn in taken:
            hooks[key] = fn

    return restore


def bare_stepper(trainer, torch):
    """A plain loop's step on the trainer's own module and batch (see the module docstring)."""
    module, backend = trainer.engine.module, trainer.backend
    micro_batches, label_tokens = trainer.stream.next_step(0)
    micro = micro_batches[0]
    scale = max(label_tokens, 1)  # step_scale at 1 rank, no accumulation
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)

    def bare_step():
        restore = _detached_hooks(trainer.moe_metrics._handles)
        try:
            loss, _ = backend.loss(module, micro, scale)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        finally:
            restore()
        return float(loss.detach())

    return bare_step


# what the roll-up stops below: the step itself, DeepSpeed's nvtx wrapper, torch's no_grad decorator
SEEN_THROUGH = {"train_step", "wrapped_fn", "decorate_context"}


def trainer_only(trainer: pstats.Stats, bare: pstats.Stats, steps: int) -> dict:
    """The trainer's extra work, from the two profiles: the Python functions only the trainer step ran (not
    the model's: the bare step runs all of those), each with its own time plus that of the built-ins
    (``{method ...}``, C ops) it called, rolled up to the outermost such function below shared code (the
    caller of most time when several), each callee of the step its own (``SEEN_THROUGH``); ``{label: s per step}``."""
    t, shared = trainer.stats, set(bare.stats)
    only = {f for f in t if f not in shared and f[0] != "~"}
    own = dict.fromkeys(only, 0.0)
    for f, (_, _, tt, _, callers) in t.items():
        if f in only:
            own[f] += tt
        elif f[0] == "~":  # a built-in: its time is its caller's
            for c, (_, _, ctt, _) in callers.items():
                if c in only:
                    own[c] += ctt

    def root(f, seen=()):
        callers = t[f][4]
        up = max(callers, key=lambda c: callers[c][3]) if callers else None
        if up is None or up not in only or up in seen or up[2] in SEEN_THROUGH or f[2] in SEEN_THROUGH:
            return f
        return root(up, seen + (f,))

    out: dict = {}
    for f, s in own.items():
        label = _label(root(f))
        out[label] = out.get(label, 0.0) + s / steps
    return out


def _label(f) -> str:
    file, line, name = f
    short = file.split("site-packages/")[-1].split("/work/main/")[-1]
    return f"{name} ({short}:{line})" if line else name


def profiled(fn) -> pstats.Stats:
    """One call of ``fn`` under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=4)
    args = parser.parse_args(argv)

    import torch

    from moe_plugin.recipe.schema import recipe_from_dict
    from moe_plugin.testing.plan_measure import SHAPE, layout_recipe
    from moe_plugin.training.loop import Trainer

    torch.set_num_threads(1)
    print(machine_line(1))
    with tempfile.TemporaryDirectory() as tmp:
        total = 2 + args.steps + args.profile
        values = layout_recipe(f"{tmp}/run", 1, 1, args.seq, steps=total, ds_config=None)
        with Trainer(recipe_from_dict(values)) as trainer:
            n_total = trainer.counts[1]
            bare_step = bare_stepper(trainer, torch)
            for _ in range(2):  # warm-up
                trainer.train_step()
                bare_step()
            times = {"trainer": [], "bare": []}
            pair = [("trainer", trainer.train_step), ("bare", bare_step)]
            for i in range(args.steps):  # alternately, each first in every other pair
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    clock = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - clock)
            t, b = statistics.median(times["trainer"]), statistics.median(times["bare"])
            # each pair's ratio (its two steps next to each other in time), the median pair: load drifts cancel
            ratio = statistics.median(x / y for x, y in zip(times["trainer"], times["bare"]))
            shape = f"{n_total / 1e6:.1f} M params ({SHAPE['num_experts']} experts, hidden {SHAPE['hidden_size']})"
            print(
                f"trainer step / bare step, 1 process, {shape}, T {args.seq}: {ratio:.3f}x "
                f"(trainer {t:.3f} s/step, bare {b:.3f} s/step; goal <= 1.15)"
            )
            spread = [(max(v) - min(v)) / statistics.median(v) for v in times.values()]
            fastest = min(times["trainer"]) / min(times["bare"])
            print(
                f"{args.steps} pairs, the median pair's ratio; of the medians {t / b:.3f}x, of the fastest steps "
                f"{fastest:.3f}x; spread (max - min) / median: trainer {spread[0]:.0%}, bare {spread[1]:.0%}"
            )
            ts, bs = [], []
            for _ in range(args.profile):  # alternately too; each step its own profile
                ts.append(profiled(trainer.train_step))
                bs.append(profiled(bare_step))
    bare = bs[0]
    for other in bs[1:]:
        bare.add(other)  # every function the bare step ran
    per_step = [trainer_only(one, bare, 1) for one in ts]
    # the median step per source: a busy moment of the machine lands in one step's source, not in the report
    extra = {k: statistics.median(d.get(k, 0.0) for d in per_step) for k in set().union(*per_step)}
    step_s = [statistics.median(p.total_tt for p in x) for x in (ts, bs)]
    print(
        f"the trainer's own work (cProfile, median of {args.profile} steps each): {sum(extra.values()) * 1e3:.1f} "
        f"ms/step; profiled steps {step_s[0]:.3f} s (trainer) and {step_s[1]:.3f} s (bare); top 5:"
    )
    for label, s in sorted(extra.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {s * 1e3:7.2f} ms/step  {label}")


if __name__ == "__main__":
    main()
