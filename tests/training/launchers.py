"""Running ``moe_plugin.train`` under the real launchers from a test, as a user types it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)  # the venv's deepspeed and torchrun


def free_port() -> int:
    with socket.socket() as s:  # the launchers' default port may be in use by a concurrent job
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command, env_extra=None, timeout=900) -> str:
    """Run ``command`` in the repository root on the CPU; assert it succeeds; its stdout + stderr."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    assert "MOE_PLUGIN_DIST_INIT_METHOD" not in env and "RANK" not in env  # no run in this process leaks its own
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def torchrun(processes: int, *args: str) -> list:
    """The command ``torchrun --nproc_per_node processes`` on a free port, then ``args``."""
    return [os.path.join(BIN, "torchrun"), "--nproc_per_node", str(processes), "--master_port", str(free_port()), *args]
