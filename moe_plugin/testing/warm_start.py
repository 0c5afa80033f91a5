"""Ranks forked from a warm process: ``run_distributed``'s CPU ranks start in milliseconds instead of seconds.

Every rank of a launch imports torch, DeepSpeed, megatron-core, transformers and peft before it does anything:
about 6 CPU-seconds a rank, so a 4-rank launch spends some 12 s of a 2-core machine's wall clock on imports
alone, and the suite makes dozens of launches. A ``WarmStarter`` is one long-lived child of the parent (one a
parent process and environment) that imports those libraries once and then forks a fresh process for each rank
it is asked for. Each rank is still a new process of its own: nothing of an earlier run is in it, only the
imported modules (the starter never runs a torch op, so it holds one thread and no OpenMP pool, and a fork of
it is safe).

What a forked rank gets is what a spawned one got: the environment the launcher built for it (set before any
code of the run reads it), the working directory, ``sys.path`` as ``PYTHONPATH`` would have made it, stdin from
``/dev/null`` and stdout/stderr in its log file. The modules imported in the starter read the environment at
import time only where that environment is the launch's fixed one (``OMP_NUM_THREADS=1``, no GPU), which is why
only CPU (gloo) launches fork and nothing of ``moe_plugin`` is imported there beyond the launcher itself.

Protocol: the parent writes one JSON line per rank to the starter's stdin (``work``, ``rank``, ``env``,
``cwd``, ``paths``); the starter answers with one line holding the rank's pid, and when the rank ends it writes
the exit code (``os.waitstatus_to_exitcode``: negative for a signal) to ``<work>/rank<r>.exit``. The starter
exits when its stdin closes (the parent ended) and kills the ranks it still has.

Set ``MOE_PLUGIN_WARM_START=0`` to spawn every rank from scratch as before.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Dict, Optional

ENV = "MOE_PLUGIN_WARM_START"
# the libraries every rank imports; imported once in the starter
_PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core", "transformers", "peft")
_MAX_STARTERS = 2  # environments a parent keeps warm at once (tests that change the environment start another)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def exit_file(work: Path, rank: int) -> Path:
    return work / f"rank{rank}.exit"


class ForkedRank:
    """A rank the starter forked, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, work: Path, rank: int):
        self.pid, self._exit, self.returncode = pid, exit_file(work, rank), None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._exit.exists():
            self.returncode = int(self._exit.read_text())
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended between the poll and the kill
                pass

    def wait(self, timeout_s: float = 60.0) -> int:
        import time

        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank pid {self.pid}: the starter never reported its exit")
            time.sleep(0.02)
        return self.returncode


class WarmStarter:
    """The parent's handle on its starter process (``start_rank`` forks one rank)."""

    _instances: Dict[tuple, "WarmStarter"] = {}
    _lock = threading.Lock()

    def __init__(self, env: dict):
        # the libraries' import-time warnings go to a log of the starter's own, not into the caller's output
        self._log = tempfile.NamedTemporaryFile(prefix="moe_plugin_warm_start_", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moe_plugin.testing.launch", "--warm-start"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
        )
        atexit.register(self.close)

    @classmethod
    def for_env(cls, env: dict) -> "WarmStarter":
        """The starter for a launch environment: one per set of values the imports could read (everything but
        the per-launch rendezvous, rank and timeout), started on first use."""
        per_launch = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MOE_PLUGIN_DIST_INIT_METHOD", "MOE_PLUGIN_DIST_TIMEOUT_S")
        key = tuple(sorted((k, v) for k, v in env.items() if k not in per_launch))
        with cls._lock:
            starter = cls._instances.pop(key, None)
            if starter is None or starter._proc.poll() is not None:
                while len(cls._instances) >= _MAX_STARTERS:  # each holds the imported libraries (~0.5 GB)
                    cls._instances.pop(next(iter(cls._instances))).close()
                starter = cls({k: v for k, v in env.items() if k not in per_launch})
            cls._instances[key] = starter  # the most recently used last
            return starter

    def start_rank(self, work: Path, rank: int, env: dict, cwd: str) -> ForkedRank:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        request = {"work": str(work), "rank": rank, "env": env, "cwd": cwd, "paths": paths}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            tail = Path(self._log.name).read_bytes()[-4000:].decode(errors="replace")
            raise RuntimeError(
                f"the warm starter ended (exit code {self._proc.poll()}; set {ENV}=0 to spawn every rank from "
                f"scratch); its output ({self._log.name}) ends:\n{tail}"
            )
        return ForkedRank(int(json.loads(answer)["pid"]), work, rank)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)


def _run_rank(request: dict, child_main: Callable[[str, str], int]) -> int:
    """In the forked child: become the rank the launcher asked for, run it (``child_main(work, rank)``, the
    launcher's rank entry), return its exit code."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in request["paths"] if p not in sys.path]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(os.path.join(request["work"], f"rank{request['rank']}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    return child_main(request["work"], str(request["rank"]))


def serve(child_main: Callable[[str, str], int]) -> None:
    """The starter's loop (``python -m moe_plugin.testing.launch --warm-start``): import, then fork a rank
    running ``child_main`` per request."""
    # the answers go out on the original stdout, which nothing else may write to: libraries print on import
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for name in _PRELOAD:
        __import__(name)
    ranks: Dict[int, tuple] = {}  # pid -> (work, rank)
    requests = sys.stdin
    try:
        while True:
            for pid in list(ranks):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    work, rank = ranks.pop(pid)
                    partial = exit_file(Path(work), rank).with_suffix(".partial")
                    partial.write_text(str(os.waitstatus_to_exitcode(status)))
                    os.replace(partial, exit_file(Path(work), rank))  # appears complete or not at all
            if not select.select([requests], [], [], 0.02)[0]:
                continue
            line = requests.readline()
            if not line:
                return  # the parent ended
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _run_rank(request, child_main)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)  # no atexit handlers or buffers of the starter run in the rank
            ranks[pid] = (request["work"], request["rank"])
            answers.write(json.dumps({"pid": pid}) + "\n")
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
