"""The ``moe-plugin`` command: ``moe-plugin <subcommand> [arguments]``.

Each subcommand is one function taking the arguments after its name, registered with ``@subcommand``; it
imports what it needs inside the function, so ``moe-plugin --help`` and ``--version`` stay fast and one
subcommand's dependencies never load for another. Adding one (``plan``, ``export``) is adding one function:

    @subcommand("export", "merge a trained adapter into a base checkpoint")
    def export(argv):
        from .training.exporting import main
        return main(argv)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from . import __version__

__all__ = ["main", "subcommand", "SUBCOMMANDS", "Subcommand"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    summary: str  # one line for ``moe-plugin --help``
    run: Callable[[List[str]], Optional[int]]  # the arguments after the name -> exit status (None: 0)


SUBCOMMANDS: Dict[str, Subcommand] = {}


def subcommand(
    name: str, summary: str
) -> Callable[[Callable[[List[str]], Optional[int]]], Callable[[List[str]], Optional[int]]]:
    """Register the decorated function as ``moe-plugin <name>``."""
    if name in SUBCOMMANDS or name.startswith("-"):
        raise ValueError(f"subcommand: {name!r} is already registered or looks like an option")

    def register(run: Callable[[List[str]], Optional[int]]) -> Callable[[List[str]], Optional[int]]:
        SUBCOMMANDS[name] = Subcommand(name, summary, run)
        return run

    return register


@subcommand("train", "fine-tune (LoRA or full) from a recipe JSON: moe-plugin train --recipe R [options]")
def train(argv: List[str]) -> Optional[int]:
    from .train import main as train_main  # torch, transformers, the trainer: only when training

    return train_main(argv)


@subcommand(
    "export",
    "export a run's adapters (peft, per-expert, merged-hf, merged-k3): moe-plugin export --run DIR --to FORMAT OUT",
)
def export(argv: List[str]) -> Optional[int]:
    from .export.command import main as export_main  # peft, safetensors, the models: only when exporting

    return export_main(argv)


@subcommand(
    "plan",
    "plan memory, tokens, FLOPs and all-to-all bytes of a recipe's layout before launch: moe-plugin "
    "plan --recipe R [--devices N --device-memory 141GB --json]",
)
def plan(argv: List[str]) -> Optional[int]:
    from .plan.command import main as plan_main  # builds the model on the meta device: only when planning

    return plan_main(argv)


@subcommand(
    "data",
    "show what a recipe trains on, record by record (ids, labels, trained spans) without loading the model: "
    "moe-plugin data --recipe R [--records N --ids --dump FILE.jsonl]",
)
def data(argv: List[str]) -> Optional[int]:
    from .training.data.command import main as data_main  # the tokenizer and the data: only when asked

    return data_main(argv)


def parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the subcommands; their own arguments are parsed by each subcommand."""
    p = argparse.ArgumentParser(
        prog="moe-plugin",
        description="LoRA fine-tuning of mixture-of-experts models "
        "(megatron-core expert parallelism, DeepSpeed ZeRO-3).",
        epilog="Run 'moe-plugin <subcommand> --help' for a subcommand's arguments.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    choices = p.add_subparsers(dest="subcommand", metavar="<subcommand>", required=True, title="subcommands")
    for entry in SUBCOMMANDS.values():
        choices.add_parser(entry.name, help=entry.summary, add_help=False)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``moe-plugin`` with ``argv`` (default: the command line); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        status = SUBCOMMANDS[argv[0]].run(argv[1:])
        return 0 if status is None else int(status)
    parser().parse_args(argv)  # prints help / the version, or names the valid subcommands, and exits
    return 2  # not reached: without a known subcommand argparse always exits


if __name__ == "__main__":
    sys.exit(main())
