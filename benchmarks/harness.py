"""Side-by-side timing and memory of benchmark variants, each in a fresh process.

A variant is a function ``setup(**kwargs) -> step`` importable as ``"module:function"``; ``step()`` runs one
forward+backward. The child process builds the inputs, records its resident set size, runs one warm-up
step and ``iters`` timed steps, and reports the median seconds per step and the peak-RSS increase over that baseline
(VmHWM - VmRSS before the first step), so every variant's memory is measured from the same clean start.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def machine_line(threads: int) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads, "
        f"python {platform.python_version()}"
    )


def run_variant(target: str, threads: int = 2, iters: int = 3, timeout: float = 1800, **kwargs: Any) -> Dict:
    """Run ``target`` (``"module:function"``) in a fresh process; return {"seconds", "peak_mib"} or {"error"}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    payload = json.dumps({"target": target, "threads": threads, "iters": iters, "kwargs": kwargs})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", payload],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]}


def _child(payload: str) -> None:
    import importlib

    import torch

    spec = json.loads(payload)
    torch.set_num_threads(spec["threads"])
    module, func = spec["target"].split(":")
    step = getattr(importlib.import_module(module), func)(**spec["kwargs"])
    try:  # reset the high-water mark so that transient peaks of setup do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _status_kib("VmRSS")
    step()  # warm-up (also counted in the peak: it allocates what every step does)
    times = []
    for _ in range(spec["iters"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]  # the median: robust to a stray busy moment of the machine
    peak_mib = (_status_kib("VmHWM") - base) / 1024
    print("RESULT " + json.dumps({"seconds": seconds, "peak_mib": peak_mib}))


if __name__ == "__main__":
    _child(sys.argv[1])


def write_results(section: str, lines, path: str = os.path.join(ROOT, "benchmarks", "RESULTS.md")) -> None:
    """Replace (or add) ``## section`` in RESULTS.md with the given lines, dated."""
    import datetime
    import re

    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    body = f"## {section}\n\nMeasured {datetime.date.today().isoformat()}:\n\n```\n" + "\n".join(lines) + "\n```\n"
    pattern = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: body + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + body
    with open(path, "w") as f:
        f.write(text)
