"""``moe-plugin train --recipe R``: LoRA (or full) fine-tuning from one recipe JSON.

Run it as one process, or under a launcher that starts one process per device:

    python -m moe_plugin.train --recipe recipes/tiny_lora.json
    deepspeed --num_accelerators 2 --module moe_plugin.train --recipe recipes/tiny_lora.json   # CPU
    deepspeed --num_gpus 8 --module moe_plugin.train --recipe R                                 # GPUs
    torchrun --nproc_per_node 2 -m moe_plugin.train --recipe recipes/tiny_lora.json

A bad input (the command line, the recipe, a file it names) is one line on stderr and exit status 2, on any
rank; --debug (or MOE_PLUGIN_DEBUG=1) shows its traceback. The recipe is validated before torch, DeepSpeed or
megatron-core load. The loop and its backends live in ``moe_plugin.training``; this module only parses the
command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .cli_errors import ArgumentParser, run_command

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="moe-plugin train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", required=True, help="path to a recipe JSON (see recipes/)")
    p.add_argument(
        "--allow-changed-inputs",
        action="store_true",
        help="resume even though an input of the run (its data, base or DeepSpeed config) changed since "
        "the run started",
    )
    # the deepspeed launcher passes --local_rank=N (unless --no_local_rank); the rank also comes from the
    # environment (LOCAL_RANK), which is what the trainer reads
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _train(argv: List[str]) -> None:
    args = parser().parse_args(argv)
    from .recipe.schema import load_recipe

    recipe = load_recipe(args.recipe)  # before the loop's import: a bad recipe is refused without torch
    _quiet_cpu_imports()
    from .training.loop import train

    train(recipe, allow_changed_inputs=args.allow_changed_inputs)


def _quiet_cpu_imports() -> None:
    """On a machine without CUDA, keep the lines DeepSpeed and megatron-core print as they load on a CPU off the
    command's output (above every run's first line, and above an error's one line): tell DeepSpeed its accelerator
    (``DS_ACCELERATOR``, its documented setting; the one its guess would pick, but without the warning), and
    drop megatron-core's "Apex is not installed" / "Transformer Engine and Apex are not installed" warnings, which on a
    CPU say nothing (neither ever runs there). A GPU machine, or a user's own DS_ACCELERATOR, is left alone."""
    import warnings

    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings(
        "ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``moe-plugin train`` with ``argv`` (default: the command line); the exit status (2: a bad input)."""
    return run_command("train", _train, argv)


if __name__ == "__main__":
    sys.exit(main())
