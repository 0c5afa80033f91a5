"""Run one function on N local processes joined by torch.distributed, and collect what each returns.

``run_distributed("pkg.module:function", world_size=2, **kwargs)`` starts ``world_size`` Python processes
with torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` and one OpenMP thread each, prepares each for
its device, initialises the default process group in each, calls ``function(**kwargs)`` and returns the
per-rank return values, ordered by rank. Values travel through ``torch.save`` files, so tensors, dicts and
lists come back as they are. The function may also be given as ``"path/to/file.py:function"``.

The ranks meet through a file in the run's own temporary directory (``file://`` rendezvous, named by the
``MOE_PLUGIN_DIST_INIT_METHOD`` variable that ``init_distributed`` reads), not on a TCP port: a port picked
free by the parent could be taken by a concurrent job before rank 0 binds it.

``backend="gloo"`` (the default) is a CPU run: the children see no GPU (``CUDA_VISIBLE_DEVICES=""``) and
each calls ``prepare_device("cpu")``, which applies the megatron-core and DeepSpeed CPU stand-ins
(``moe_plugin.parallel.cpu_compat``), also on a machine with GPUs. ``backend="nccl"`` leaves the GPUs
visible and calls ``prepare_device("cuda")``.

Two clocks. Start-up (importing torch, preparing the device, importing the worker's module) takes seconds
to minutes depending on how loaded the machine is, so it is bounded separately by ``startup_timeout_s``.
Each rank reports ready when its start-up is done and waits for all the others; ``timeout_s`` is counted from
the moment every rank is ready, so it measures the run itself and a busy machine does not eat into it.

Failures: a rank that raises makes ``run_distributed`` raise ``RuntimeError`` with that rank's traceback and
every rank's output tail; the other ranks are stopped rather than left waiting in a collective. The
children's process-group timeout (``process_group_timeout_s``) is kept below the launcher's ``timeout_s``, so
a rank stuck in a collective fails there with its own traceback before the launcher gives up with
``TimeoutError`` (which also carries every rank's output tail).

Starting processes costs seconds (importing torch and megatron-core), so callers should run several
checks inside one launch and assert on the returned values in the parent. CPU ranks are forked from a process
that has imported those libraries once (``warm_start``; ``MOE_PLUGIN_WARM_START=0`` spawns them from scratch):
each is still a fresh process, with the environment, working directory and output file described above.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch

from . import warm_start
from ..parallel.distributed import INIT_METHOD_ENV, TIMEOUT_ENV, destroy_distributed, init_distributed, prepare_device

_PACKAGE_ROOT = Path(os.path.abspath(__file__)).parents[2]  # the directory holding moe_plugin/
_ERROR_TAIL = 4000
_BACKENDS = ("gloo", "nccl")
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}
DEFAULT_STARTUP_TIMEOUT_S = 600.0


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


def default_process_group_timeout(timeout_s: float) -> float:
    """The children's process-group timeout for a launcher timeout of ``timeout_s``: three quarters of it,
    so that a collective that never completes raises in the ranks (with their tracebacks) well before the
    launcher stops them."""
    return 0.75 * timeout_s


def run_distributed(
    worker_fn_path: str,
    world_size: int,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    backend: str = "gloo",
    process_group_timeout_s: Optional[float] = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    **kwargs: Any,
) -> List[Any]:
    """Run ``worker_fn_path`` on ``world_size`` processes; return the list of per-rank return values.

    ``init_process_group``: initialise the default process group before calling the function (and
    destroy it after); set False for functions that start torch.distributed themselves (``init_distributed``
    and ``initialize_megatron`` find the rendezvous and the timeout in the environment).
    ``backend``: ``"gloo"`` runs on CPU with the GPUs hidden from the children; ``"nccl"`` keeps them.
    ``timeout_s``: the limit of the run, counted from when every rank has started up and is ready.
    ``process_group_timeout_s``: the children's collective timeout; ``None`` is
    ``default_process_group_timeout(timeout_s)``; it must be below ``timeout_s``.
    ``startup_timeout_s``: the limit of the start-up, from launch until every rank is ready.
    Raises ``RuntimeError`` (a rank failed, with its traceback) or ``TimeoutError`` (start-up or run too long).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if not startup_timeout_s > 0:
        raise ValueError(f"startup_timeout_s: must be positive, got {startup_timeout_s!r}")
    if process_group_timeout_s is None:
        process_group_timeout_s = default_process_group_timeout(timeout_s)
    if not 0 < process_group_timeout_s < timeout_s:
        raise ValueError(
            f"process_group_timeout_s: must be positive and below timeout_s={timeout_s}, got "
            f"{process_group_timeout_s!r}"
        )
    resolve_function(worker_fn_path)  # fail here, not N times in the children
    with tempfile.TemporaryDirectory(prefix="moe_plugin_dist_") as tmp:
        work = Path(tmp)
        torch.save(
            {"worker": worker_fn_path, "kwargs": kwargs, "init": init_process_group, "backend": backend},
            work / "call.pt",
        )
        env = _child_env(world_size, work, backend, process_group_timeout_s)
        procs: list = []  # subprocess.Popen, or warm_start.ForkedRank (the same poll/kill/wait)
        # CPU ranks fork from a process that has the libraries imported already (testing/warm_start.py)
        starter = warm_start.WarmStarter.for_env(env) if backend == "gloo" and warm_start.enabled() else None
        try:
            for rank in range(world_size):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                if starter is not None:
                    procs.append(starter.start_rank(work, rank, rank_env, os.getcwd()))
                    continue
                with open(work / f"rank{rank}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "moe_plugin.testing.launch", str(work), str(rank)],
                            env=rank_env,
                            cwd=os.getcwd(),
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            _wait(procs, work, timeout_s, startup_timeout_s)
        finally:
            _stop(procs)  # also when the parent is interrupted: no rank outlives the call
        return [torch.load(work / f"rank{rank}.result.pt", weights_only=False) for rank in range(world_size)]


def _child_env(world_size: int, work: Path, backend: str, process_group_timeout_s: float) -> dict:
    env = dict(os.environ)
    # a rendezvous inherited from a parent started by torchrun belongs to the parent's job, not this one
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    paths = [str(_PACKAGE_ROOT), os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        {
            "WORLD_SIZE": str(world_size),
            INIT_METHOD_ENV: f"file://{work / 'rendezvous'}",
            TIMEOUT_ENV: repr(float(process_group_timeout_s)),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(paths),
        }
    )
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _ready_file(work: Path, rank: int) -> Path:
    return work / f"rank{rank}.ready"


def _wait(procs: list, work: Path, timeout_s: float, startup_timeout_s: float) -> None:
    started = time.monotonic()
    deadline = None  # set once every rank is ready
    while True:
        codes = [p.poll() for p in procs]
        if any(code not in (None, 0) for code in codes):
            time.sleep(1.0)  # let the other ranks report their own errors before they are stopped
            raise RuntimeError(_report(work, [p.poll() for p in procs]))
        if all(code == 0 for code in codes):
            return
        now = time.monotonic()
        if deadline is None:
            waiting = [r for r in range(len(procs)) if not _ready_file(work, r).exists()]
            if not waiting:
                deadline = now + timeout_s
            elif now - started > startup_timeout_s:
                raise TimeoutError(
                    f"distributed run: rank(s) {waiting} did not start up within "
                    f"{startup_timeout_s:.0f} s (imports, device preparation)\n{_report(work, codes)}"
                )
        elif now > deadline:
            raise TimeoutError(
                f"distributed run did not finish within {timeout_s:.0f} s after every rank was "
                f"ready\n{_report(work, codes)}"
            )
        time.sleep(0.05)


def _stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _report(work: Path, codes: List[Optional[int]]) -> str:
    """Every rank's state, traceback (if it raised) and output tail. Ranks that raised come first, the
    earliest first: a rank that raises makes its peers' collectives fail a moment later, and the first
    error is the cause."""
    errors = [work / f"rank{r}.error" for r in range(len(codes))]
    raised_at = [e.stat().st_mtime if e.exists() else float("inf") for e in errors]
    parts = []
    for r in sorted(range(len(codes)), key=lambda r: (raised_at[r], codes[r] in (None, 0), r)):
        code = codes[r]
        if code is None:
            part = f"rank {r} " + ("was still running" if _ready_file(work, r).exists() else "was still starting up")
        else:
            part = f"rank {r} exited with code {code}"
        if errors[r].exists():
            part += f":\n{errors[r].read_text()}"
        elif code not in (None, 0):
            part += ":\n(no Python traceback; the process died)"
        parts.append(f"{part}\n--- rank {r} output tail ---\n{_tail(work / f'rank{r}.log')}")
    return "\n".join(parts)


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    return path.read_bytes()[-_ERROR_TAIL:].decode(errors="replace")


def _child_main(work_dir: str, rank: str) -> int:
    """Entry of one rank: start up, report ready, wait for every rank, run the worker, save its return value
    or its traceback."""
    torch.set_num_threads(1)
    work = Path(work_dir)
    call = torch.load(work / "call.pt", weights_only=False)
    device = _DEVICE_OF_BACKEND[call["backend"]]
    try:
        prepare_device(device)
        worker = resolve_function(call["worker"])
        _report_ready(work, int(rank))
        if call["init"]:
            init_distributed(device, call["backend"])
        result = worker(**call["kwargs"])
        torch.save(result, work / f"rank{rank}.result.pt")
        return 0
    except BaseException:
        (work / f"rank{rank}.error").write_text(traceback.format_exc())
        return 1
    finally:
        destroy_distributed()


def _report_ready(work: Path, rank: int) -> None:
    """Mark this rank ready, then wait until every rank is: the run (and its clock) starts together."""
    partial = work / f"rank{rank}.ready.partial"
    partial.write_text(str(time.time()))
    os.replace(partial, _ready_file(work, rank))  # appears complete or not at all
    world = int(os.environ["WORLD_SIZE"])
    while not all(_ready_file(work, r).exists() for r in range(world)):
        time.sleep(0.05)  # a peer that dies during start-up makes the launcher stop this rank


if __name__ == "__main__":
    if sys.argv[1:] == ["--warm-start"]:
        warm_start.serve(_child_main)
    else:
        sys.exit(_child_main(sys.argv[1], sys.argv[2]))
