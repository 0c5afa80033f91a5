"""The training logger interface: one object the loop (and later the Trainer callback) reports metrics to.

``Logger.log(step, metrics)`` takes a flat ``{name: value}`` dict once per logged optimizer step (a value is
a number, or a ``Distribution`` that trackers draw as a histogram and the console leaves out), ``image`` hands
over a PNG and ``close()`` ends the run. ``NullLogger`` is the disabled logger (every rank but 0 gets it),
``ConsoleLogger`` prints one line per logged step and drives a progress bar, ``WandbLogger``
(``wandb_logger.py``) writes a W&B run (offline unless the recipe says online) and ``LoadPlotLogger``
(``load_plot.py``) draws the expert load per layer over training. ``run_logger.make_logger`` puts them
together behind one ``Logger`` (docs/hf-trainer.md section 2); it sits in its own module because the loggers it
puts together build on this one.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

__all__ = ["Logger", "NullLogger", "ConsoleLogger", "MultiLogger", "Distribution", "Value"]


@dataclass(frozen=True)
class Distribution:
    """Values logged as one histogram (``values`` ``[n]``, e.g. every expert's load share of a layer): a
    tracker stores a fixed number of bins however long ``values`` is."""

    values: Sequence[float]


Value = Union[float, Distribution]


class Logger:
    """Interface: a no-op. Subclasses override what they use."""

    def start(self, total_steps: int, first_step: int = 0) -> None:
        """The run has ``total_steps`` optimizer steps, of which ``first_step`` are already done (a resume)."""

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Every optimizer step (cheap: progress only)."""

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        """A logged step's metrics (``train/loss``, ``train/lr``, ``eval/loss``, ``moe/...``)."""

    def image(self, step: int, name: str, path: str) -> None:
        """A PNG file written at ``step`` (the expert-load plot)."""

    def message(self, text: str) -> None:
        """A line for the user."""

    def close(self) -> None:
        """End of the run."""


class NullLogger(Logger):
    """Logs nothing (ranks other than 0, or logging disabled)."""


def _format(metrics: Dict[str, Value]) -> str:
    parts = []
    for name, value in metrics.items():
        if isinstance(value, Distribution) or (name.startswith("moe/layer") and "/" in name[4:]):
            continue  # one line per step: the per-layer details are for the trackers and the plot
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

            self.bar = tqdm(
                total=total_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        self.message(f"step {step:5d}  {_format(metrics)}")

    def image(self, step: int, name: str, path: str) -> None:
        self.message(f"{name}: {path}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class MultiLogger(Logger):
    """Every call goes to each of ``loggers`` in order (so an earlier one's ``close`` may still hand an image
    to a later one)."""

    def __init__(self, loggers: List[Logger]):
        self.loggers = list(loggers)

    def start(self, total_steps: int, first_step: int = 0) -> None:
        for logger in self.loggers:
            logger.start(total_steps, first_step)

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        for logger in self.loggers:
            logger.step(step, loss, tokens_per_s)

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def image(self, step: int, name: str, path: str) -> None:
        for logger in self.loggers:
            logger.image(step, name, path)

    def message(self, text: str) -> None:
        for logger in self.loggers:
            logger.message(text)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
