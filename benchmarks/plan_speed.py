"""How long ``moe-plugin plan`` takes to answer: the seed layout's context-parallel search (``--context-parallel
auto``) at several row lengths, each in a fresh process, its CPU seconds (the machine is shared: wall time is
printed beside them, CPU time is what the goal reads). Goal (issue 37): under a minute for any row length.
``python -m benchmarks.plan_speed [T ...]``.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from typing import List, Sequence

from .harness import ROOT, machine_line

PLAN = [
    "--recipe",
    "recipes/k3_seed_layout.json",
    "--device-memory",
    "141GB",
    "--checkpointing",
    "full",
    "--from-checkpoint",
    "--expert-format",
    "mxfp4",
    "--context-parallel",
    "auto",
]


def _timed_plan(seq_len: int) -> str:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "moe_plugin.cli", "plan", *PLAN, "--seq-len", str(seq_len)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.splitlines()
    answer = next((lines[i + 1].strip() for i, line in enumerate(lines) if line.startswith("context parallelism")), "")
    return f"plan --context-parallel auto, T {seq_len:,}: {cpu:.1f} s CPU ({wall:.1f} s wall; goal < 60 s): {answer}"


def main(seq_lens: Sequence[int] = (131072, 1048576)) -> List[str]:
    lines = [machine_line(1)] + [_timed_plan(t) for t in seq_lens]
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or (131072, 1048576))
