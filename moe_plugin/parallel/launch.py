"""Run one function on N local processes joined by torch.distributed, and collect what each returns.

``run_distributed("pkg.module:function", world_size=2, **kwargs)`` starts ``world_size`` Python processes
the way torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free
port, one OpenMP thread each), initialises the default process group in each (gloo without CUDA), calls
``function(**kwargs)`` and returns the per-rank return values, ordered by rank. Values travel through
``torch.save`` files, so tensors, dicts and lists come back as they are. A rank that raises makes
``run_distributed`` raise ``RuntimeError`` with that rank's traceback; the other ranks are stopped rather
than left waiting in a collective. The function may also be given as ``"path/to/file.py:function"``.

Starting processes costs seconds (importing torch and megatron-core), so callers should run several
checks inside one launch and assert on the returned values in the parent.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch

_PACKAGE_ROOT = Path(os.path.abspath(__file__)).parents[2]  # the directory holding moe_plugin/
_ERROR_TAIL = 4000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_function(path: str) -> Callable[..., Any]:
    """``"pkg.module:function"`` or ``"dir/file.py:function"`` -> the function."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"worker_fn_path: expected 'module:function' or 'file.py:function', got {path!r}")
    if module_name.endswith(".py"):
        file = Path(module_name).resolve()
        spec = importlib.util.spec_from_file_location(f"_distributed_worker_{file.stem}", file)
        if spec is None or not file.is_file():
            raise ValueError(f"worker_fn_path: no such file {str(file)!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"worker_fn_path: {module_name!r} has no function {attr!r}")
    return fn


def run_distributed(worker_fn_path: str, world_size: int, timeout_s: float = 300.0,
                    init_process_group: bool = True, **kwargs: Any) -> List[Any]:
    """Run ``worker_fn_path`` on ``world_size`` processes; return the list of per-rank return values.

    ``init_process_group``: initialise the default process group before calling the function (and
    destroy it after); set False for functions that start torch.distributed themselves.
    Raises ``RuntimeError`` (a rank failed, with its traceback) or ``TimeoutError`` (after ``timeout_s``).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
    resolve_function(worker_fn_path)  # fail here, not N times in the children
    with tempfile.TemporaryDirectory(prefix="moe_plugin_dist_") as tmp:
        work = Path(tmp)
        torch.save({"worker": worker_fn_path, "kwargs": kwargs, "init": init_process_group}, work / "call.pt")
        env = _child_env(world_size)
        procs: List[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                with open(work / f"rank{rank}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "moe_plugin.parallel.launch", str(work), str(rank)],
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=os.getcwd(),
                        stdout=log, stderr=subprocess.STDOUT))
            _wait(procs, work, timeout_s)
        finally:
            _stop(procs)  # also when the parent is interrupted: no rank outlives the call
        return [torch.load(work / f"rank{rank}.result.pt", weights_only=False) for rank in range(world_size)]


def _child_env(world_size: int) -> dict:
    env = dict(os.environ)
    paths = [str(_PACKAGE_ROOT), os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    return env


def _wait(procs: List[subprocess.Popen], work: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if any(code not in (None, 0) for code in codes):
            time.sleep(1.0)  # let the other ranks report their own errors before they are stopped
            codes = [p.poll() for p in procs]
            raise RuntimeError(_failure_report(work, codes))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- rank {r} log tail ---\n{_tail(work / f'rank{r}.log')}" for r in range(len(procs)))
            raise TimeoutError(f"distributed run did not finish within {timeout_s:.0f} s\n{logs}")
        time.sleep(0.05)


def _stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _failure_report(work: Path, codes: List[Optional[int]]) -> str:
    """Every failed rank's traceback, the earliest first: a rank that raises makes its peers' collectives
    fail a moment later, and the first error is the cause."""
    failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
    errors = {r: work / f"rank{r}.error" for r in failed}
    failed.sort(key=lambda r: errors[r].stat().st_mtime if errors[r].exists() else float("inf"))
    parts = []
    for r in failed:
        error = errors[r].read_text() if errors[r].exists() else "(no Python traceback; the process died)"
        parts.append(f"rank {r} exited with code {codes[r]}:\n{error}\n--- rank {r} log tail ---\n"
                     f"{_tail(work / f'rank{r}.log')}")
    return "\n".join(parts)


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    return path.read_bytes()[-_ERROR_TAIL:].decode(errors="replace")


def _child_main(work_dir: str, rank: str) -> int:
    """Entry of one rank: run the worker, save its return value or its traceback."""
    torch.set_num_threads(1)
    work = Path(work_dir)
    call = torch.load(work / "call.pt", weights_only=False)
    from .distributed import destroy_distributed, init_distributed

    try:
        if call["init"]:
            init_distributed()
        result = resolve_function(call["worker"])(**call["kwargs"])
        torch.save(result, work / f"rank{rank}.result.pt")
        return 0
    except BaseException:
        (work / f"rank{rank}.error").write_text(traceback.format_exc())
        return 1
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
