"""Rank 0's logger for a run: the console, the expert-load plot and the W&B run behind one ``Logger``.

Apart from ``logger.py`` because it builds on the loggers that build on that interface (``load_plot``,
``wandb_logger``); both trainers (the recipe loop and ``moe_plugin.hf_trainer``) take their logger from here.
"""

from __future__ import annotations

import os
from typing import Optional

from .load_plot import LoadPlotLogger
from .logger import ConsoleLogger, Logger, MultiLogger, NullLogger
from .wandb_logger import wandb_logger

__all__ = ["make_logger"]


def make_logger(
    rank: int,
    logging=True,
    output_dir: Optional[str] = None,
    config: Optional[dict] = None,
    wandb_mode: Optional[str] = None,
) -> Logger:
    """Rank 0's logger; the other ranks get a ``NullLogger``.

    ``logging``: the recipe's ``LoggingSection`` (or, as before, just the progress-bar flag: console only).
    With a section and ``output_dir``, rank 0 also writes ``output_dir/expert_load.png`` at the end and a W&B run
    (``logging.wandb``: offline by default, in ``output_dir`` unless ``wandb.dir`` says otherwise; no run when
    its mode is ``"disabled"``). ``wandb_mode`` overrides the section's mode (the caller says online).
    ``config`` is stored as the W&B run's config.
    """
    if rank != 0:
        return NullLogger()
    if isinstance(logging, bool):
        return ConsoleLogger(logging)
    console = ConsoleLogger(logging.progress_bar)
    if output_dir is None:
        return console
    tracker = wandb_logger(logging.wandb, output_dir, config, mode=wandb_mode)
    # the plot goes first: its close() hands the PNG to the console and to W&B before they close
    return MultiLogger(
        [LoadPlotLogger(os.path.join(output_dir, "expert_load.png"), [console, tracker]), console, tracker]
    )
