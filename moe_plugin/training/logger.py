"""The training logger interface: one object the loop (and later the Trainer callback) reports metrics to.

``Logger.log(step, metrics)`` takes a flat ``{name: number}`` dict once per logged optimizer step and
``close()`` ends the run. ``NullLogger`` is the disabled logger (every rank but 0 gets it), ``ConsoleLogger``
prints one line per logged step and drives a progress bar. Experiment trackers plug in by implementing
``log``/``close`` (W&B is the next one).
"""

from __future__ import annotations

import sys
import time
from typing import Dict, Optional

__all__ = ["Logger", "NullLogger", "ConsoleLogger"]


class Logger:
    """Interface: a no-op. Subclasses override what they use."""

    def start(self, total_steps: int, first_step: int = 0) -> None:
        """The run has ``total_steps`` optimizer steps, of which ``first_step`` are already done (a resume)."""

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Every optimizer step (cheap: progress only)."""

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        """A logged step's metrics (``train/loss``, ``train/lr``, ``eval/loss``, ...)."""

    def message(self, text: str) -> None:
        """A line for the user."""

    def close(self) -> None:
        """End of the run."""


class NullLogger(Logger):
    """Logs nothing (ranks other than 0, or logging disabled)."""


def _format(metrics: Dict[str, float]) -> str:
    parts = []
    for name, value in metrics.items():
        short = name.split("/", 1)[-1] if name.startswith("train/") else name
        parts.append(f"{short} {value:,.0f}" if abs(value) >= 1000 else f"{short} {value:.4g}")
    return "  ".join(parts)


class ConsoleLogger(Logger):
    """Lines on stdout and, when ``progress_bar``, a tqdm bar with loss, tokens/s and ETA (on stderr)."""

    def __init__(self, progress_bar: bool = True, stream=None):
        self.progress_bar = progress_bar
        self.stream = stream or sys.stdout
        self.bar = None
        self.started = time.perf_counter()

    def start(self, total_steps: int, first_step: int = 0) -> None:
        if self.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.message(f"step {step:5d}  {_format(metrics)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def make_logger(rank: int, progress_bar: bool = True) -> Logger:
    """Rank 0 logs to the console; the other ranks get a ``NullLogger``."""
    return ConsoleLogger(progress_bar) if rank == 0 else NullLogger()
