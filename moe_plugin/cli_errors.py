"""How the commands (``train``, ``export``, ``plan``) report a bad input: one line on stderr,
``moe-plugin <command>: error: <message>``, and exit status 2, with no traceback on any rank.

An input error is a ``ValueError`` (pydantic's and the recipe's ``RecipeError`` included; argparse's own errors
are turned into one by ``ArgumentParser``), or a ``FileNotFoundError``/``PermissionError``/``IsADirectoryError``
(named by its file). Anything else is a bug and keeps its traceback. ``--debug`` on the command line or
``MOE_PLUGIN_DEBUG=1`` prints the traceback of an input error too, above its line. Under a launcher
(``WORLD_SIZE`` > 1) a rank other than 0 adds `` (rank N)``, so an error only that rank met reaches the user.

This module imports neither torch nor the models: a bad recipe is refused before they load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
from typing import Callable, List, Optional

__all__ = [
    "ArgumentParser",
    "CommandLineError",
    "DEBUG_ENV",
    "EXIT_INPUT_ERROR",
    "describe",
    "one_line_errors",
    "run_command",
]

DEBUG_ENV = "MOE_PLUGIN_DEBUG"
EXIT_INPUT_ERROR = 2  # what argparse exits with for a bad command line, so every input error reads the same


class CommandLineError(ValueError):
    """A command line argparse refused (an unknown flag, a missing or malformed value)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a bad command line raises ``CommandLineError`` (reported in one line
    by ``run_command``) instead of printing the usage and exiting."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", action="store_true", help=f"show the traceback of an input error (or set {DEBUG_ENV}=1)"
        )

    def error(self, message: str):
        raise CommandLineError(f"{message}; see '{self.prog} --help'")


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (built elsewhere as a plain argparse parser) made to behave as ``ArgumentParser``."""
    parser.error = functools.partial(ArgumentParser.error, parser)
    try:
        parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    except argparse.ArgumentError:  # the parser has its own --debug already
        pass
    return parser


def _debugging(argv: List[str]) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def _rank_suffix() -> str:
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(world) > 1 and int(rank) != 0:
        return f" (rank {int(rank)})"
    return ""


def _json_file(err: json.JSONDecodeError) -> Optional[str]:
    """The file ``json.load`` was reading when it failed: its frame holds the open file (``fp``)."""
    tb = err.__traceback__
    while tb is not None:
        fp = tb.tb_frame.f_locals.get("fp")
        if isinstance(getattr(fp, "name", None), str) and hasattr(fp, "read"):
            return fp.name
        tb = tb.tb_next
    return None


_OS_FIXES = {
    FileNotFoundError: "check the path (relative paths resolve against {cwd})",
    PermissionError: "make it readable (or writable) by this user, or give another path",
    IsADirectoryError: "give a file, not a directory",
}


def describe(err: BaseException) -> Optional[str]:
    """The user's message for an input error (one line, or a ``RecipeError``'s per-problem lines); None for
    anything else (a bug, which keeps its traceback)."""
    for kind, fix in _OS_FIXES.items():
        if isinstance(err, kind):
            where = err.filename if err.filename is not None else "a file"
            return f"{where}: {err.strerror or type(err).__name__}; {fix.format(cwd=os.getcwd())}"
    if isinstance(err, json.JSONDecodeError):
        where = _json_file(err) or "a JSON input"
        return (
            f"{where}, line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); fix the syntax (JSON "
            "allows no comments and no trailing commas)"
        )
    if not isinstance(err, ValueError):
        return None
    if type(err).__name__ == "RecipeError":  # its lines are one problem each, each named by its field
        return str(err)
    errors = getattr(err, "errors", None)
    if type(err).__module__.startswith("pydantic") and callable(errors):
        # pydantic's own text spends three lines on each problem; the location and the message are what counts
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in errors())
    text = str(err).strip() or f"{type(err).__name__} without a message"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def run_command(command: str, body: Callable[[List[str]], Optional[int]], argv: Optional[List[str]] = None) -> int:
    """Run ``body(argv)`` (default argv: the command line) as ``moe-plugin <command>``; its status (None: 0),
    or ``EXIT_INPUT_ERROR`` after printing an input error's line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = body(argv)
    except Exception as err:  # noqa: BLE001 - sorted right below; a bug is raised again untouched
        message = describe(err)
        if message is None:
            raise
        if _debugging(argv):
            traceback.print_exc()
        first, _, rest = message.partition("\n")
        line = f"moe-plugin {command}: error: {first}{_rank_suffix()}" + (f"\n{rest}" if rest else "")
        sys.stdout.flush()  # the line comes after whatever the command had printed
        print(line, file=sys.stderr, flush=True)
        return EXIT_INPUT_ERROR
    return 0 if status is None else int(status)
