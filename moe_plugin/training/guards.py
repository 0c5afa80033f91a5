"""Stopping a run that has gone wrong, before it writes anything of the bad steps (docs/training.md, "Guards").

Two rules, checked after every optimizer step on every rank (the loss is the global mean, so every rank
decides alike):

* **Non-finite**: a loss or gradient norm that is NaN or infinite stops the run at once.
* **Divergence**: with ``L0`` the loss of the run's first step (resumed parts included), the step is
  *diverging* when the mean loss of the last ``window`` steps exceeds ``factor x L0`` (checked once the run
  has more than ``window`` steps, so the window never holds ``L0`` alone). The first diverging step warns
  (once per run); when more than ``stop_after`` steps in a row diverge the run stops. A NaN-only check misses
  what a far too high learning rate does: at lr 1e6 the loss climbs (1.65 -> 4.7) while the clipped gradient
  norm collapses toward 0 (at lr 1e30 the loss settles near 1.8x its start with a zero norm), so the rule
  watches the loss, not the norm. The defaults (factor 1.5, window 5, stop_after 10) stop both within 16
  steps; a healthy fine-tune's loss falls from its first step, and a spike is averaged over the window.

A stop is ``TrainingStopped`` (a ValueError: the recipe's schedule is the input at fault), raised before the
step is checkpointed, so the newest checkpoint is the last good one and no adapter is written. The settings
are the recipe's ``guards.divergence`` section (``moe_plugin.recipe.guards_section``); no torch here.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

from ..recipe.guards_section import DivergenceSection, GuardsSection

__all__ = ["DivergenceSection", "GuardsSection", "TrainingStopped", "StepGuard"]


class TrainingStopped(ValueError):
    """The run stopped at ``step`` (1-based) for ``reason`` ("non-finite" or "diverged")."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason


class StepGuard:
    """Checks each step's loss and gradient norm; ``warn`` receives the divergence warning (once)."""

    def __init__(self, settings: Optional[DivergenceSection], warn: Callable[[str], None]):
        self.settings = settings if settings is not None else DivergenceSection()
        self.warn, self.warned, self.diverging = warn, False, 0

    def check(self, step: int, losses: List[float], grad_norm: Optional[float], last_checkpoint: Optional[int]) -> None:
        """``losses``: every step's loss so far, this ``step``'s last. Raises TrainingStopped to stop."""
        loss = losses[-1]
        kept = f"the newest checkpoint is step {last_checkpoint}'s" if last_checkpoint else "no checkpoint was written"
        bad = [] if math.isfinite(loss) else [f"the loss is {loss}"]
        if grad_norm is not None and not math.isfinite(grad_norm):
            bad.append(f"the gradient norm is {grad_norm}")
        if bad:
            raise TrainingStopped(
                f"step {step}: {' and '.join(bad)}; the run stopped before saving this step "
                f"or writing the adapter, {kept}; lower schedule.lr (or raise "
                "schedule.warmup_steps), or check the base and the data",
                step,
                "non-finite",
            )
        s = self.settings
        if len(losses) <= s.window:
            return
        mean, limit = sum(losses[-s.window :]) / s.window, s.factor * losses[0]
        if not mean > limit:
            self.diverging = 0
            return
        self.diverging += 1
        rule = (
            f"the mean loss of the last {s.window} steps ({mean:.4g}) is above guards.divergence.factor "
            f"{s.factor:g} x the first step's loss ({losses[0]:.4g})"
        )
        if not self.warned:
            self.warned = True
            limit_text = (
                ""
                if s.stop_after is None
                else f"; the run stops if it stays so for more than {s.stop_after} steps (guards.divergence.stop_after)"
            )
            self.warn(f"warning: step {step}: the loss is diverging: {rule}{limit_text}")
        if s.stop_after is not None and self.diverging > s.stop_after:
            raise TrainingStopped(
                f"step {step}: the loss diverged: {rule} for {self.diverging} steps in a row, "
                f"more than guards.divergence.stop_after ({s.stop_after}); the run stopped "
                f"before writing the adapter, {kept}; lower schedule.lr, or raise "
                "guards.divergence.factor or stop_after",
                step,
                "diverged",
            )
