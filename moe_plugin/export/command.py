"""``moe-plugin export --run DIR --to {peft, per-expert, merged-hf, merged-k3} OUT`` (docs/exports.md)."""

from __future__ import annotations

import argparse
from typing import List, Optional

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    from .exporter import FORMATS

    p = argparse.ArgumentParser(
        prog="moe-plugin export",
        description="Export a training run's adapters: as a "
        "PEFT adapter, as per-expert adapters, or merged into the base weights (Hugging "
        "Face or K3 layout). Every export reloads what it wrote and compares it with the "
        "adapted model before it appears at OUT.",
    )
    p.add_argument("--run", required=True, help="the run's output_dir (holds moe_plugin_run.json)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the export format")
    p.add_argument(
        "out",
        help="the directory to write: new, empty, or an earlier export of this run in this format "
        "(replaced as a whole, only once the check passed); never the run, its base or a parent of either",
    )
    p.add_argument("--step", type=int, default=None, help="export checkpoint N instead of the final adapter")
    p.add_argument(
        "--targets",
        default=None,
        help="comma-separated module/parameter names to export (default: "
        "every trained target); a list that leaves a trained target out is refused",
    )
    p.add_argument("--max-shard-size", default="5GB", help="merged exports: largest shard (default 5GB)")
    p.add_argument(
        "--requantise",
        action="store_true",
        help="merged exports over a packed (MXFP4 or INT4) base: "
        "pack the merged experts again in the base's format (lossy; the count of values that changed from "
        "the base is reported) instead of writing them dense in the base's dtype (BF16 for the release)",
    )
    p.add_argument(
        "--allow-changed-inputs",
        action="store_true",
        help="export even though the base differs from "
        "what the run recorded in moe_plugin_inputs.json (or resolve a relative base path no record pins "
        "against the current directory)",
    )
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``moe-plugin export`` with ``argv`` (default: the command line); the exit status (2: a bad input, in
    one line on stderr; ``--debug`` shows its traceback)."""
    from ..cli_errors import one_line_errors, run_command

    def export(argv: List[str]) -> int:
        args = one_line_errors(parser()).parse_args(argv)
        from .exporter import export_run

        # the flag lives in parser(); passed only when given, so an exporter without the keyword still runs
        extra = {"allow_changed_inputs": True} if getattr(args, "allow_changed_inputs", False) else {}
        report = export_run(
            args.run,
            args.to,
            args.out,
            step=args.step,
            targets=args.targets.split(",") if args.targets is not None else None,
            max_shard_size=args.max_shard_size,
            requantise=args.requantise,
            **extra,
        )
        print(report.summary(), flush=True)
        return 0

    return run_command("export", export, argv)
