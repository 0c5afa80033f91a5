"""``moe-plugin train --recipe R``: LoRA (or full) fine-tuning from one recipe JSON.

Run it as one process, or under a launcher that starts one process per device:

    python -m moe_plugin.train --recipe recipes/tiny_lora.json
    deepspeed --num_accelerators 2 --module moe_plugin.train --recipe recipes/tiny_lora.json   # CPU
    deepspeed --num_gpus 8 --module moe_plugin.train --recipe R                                 # GPUs
    torchrun --nproc_per_node 2 -m moe_plugin.train --recipe recipes/tiny_lora.json

The loop and its backends live in ``moe_plugin.training``; this module only parses the command line.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-plugin train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="path to a recipe JSON (see recipes/)")
    # the deepspeed launcher passes --local_rank=N (unless --no_local_rank); the rank also comes from the
    # environment (LOCAL_RANK), which is what the trainer reads
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    from .training.loop import train
    from .training.recipe import load_recipe

    train(load_recipe(args.recipe))


if __name__ == "__main__":
    main()
