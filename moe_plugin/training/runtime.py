"""Where the trainer runs: the process group and agreeing across ranks on success (the device:
``parallel.distributed.choose_device``, the one device policy).

Launchers: the ``deepspeed`` launcher (``--num_accelerators N`` on CPU, ``--num_gpus N`` or a hostfile on GPUs),
``torchrun``, or none at all. Each of the first two sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a TCP
rendezvous; without a launcher the trainer is one process and meets itself through a file in a temporary
directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

__all__ = ["start_processes", "stop_processes", "forget_processes", "all_ok"]

# the environment a one-process run set for itself; removed again by forget_processes, so that nothing started
# later from this process (a launcher, a subprocess) inherits a rendezvous that is gone
_SET_HERE: dict = {}
# the temporary folder of a one-process rendezvous, removed by forget_processes (a run leaves nothing behind
# outside its output_dir)
_RENDEZVOUS_DIRS: list = []


def start_processes(device: torch.device) -> bool:
    """Start torch.distributed for this process (and the CPU stand-ins on CPU); True if this call started it
    (the caller then destroys it). Sets the CPU threads to the cores per local process."""
    from ..parallel.distributed import INIT_METHOD_ENV, init_distributed, prepare_device

    prepare_device(device.type)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    started = not dist.is_initialized()
    if started:
        if "RANK" not in os.environ:  # one process without a launcher
            _RENDEZVOUS_DIRS.append(tempfile.mkdtemp(prefix="moe_plugin_"))
            single = {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                INIT_METHOD_ENV: "file://" + os.path.join(_RENDEZVOUS_DIRS[-1], "rendezvous"),
            }
            _SET_HERE.update({k: v for k, v in single.items() if k not in os.environ})
            os.environ.update(_SET_HERE)
    try:
        if started:
            init_distributed(device=device.type)
        import deepspeed

        from ..compat.deepspeed import restore_torch_linear, use_current_collectives

        # DeepSpeed's communication layer wraps the process group that is already up
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        use_current_collectives()  # ZeRO-3's collectives without torch's deprecation warnings in the progress bar
        restore_torch_linear()  # the run's own build decides which linear it trains with
    except BaseException:
        if started and dist.is_initialized():
            dist.destroy_process_group()
        if started:
            forget_processes()
        raise
    return started


def stop_processes() -> None:
    """Destroy the process group ``start_processes`` started, through DeepSpeed's communication layer (which it
    wrapped): DeepSpeed's teardown also drops the groups it cached, so that a later run in this process (a
    notebook, a test) starts clean."""
    import deepspeed.comm

    deepspeed.comm.destroy_process_group()


def forget_processes() -> None:
    """Undo what ``start_processes`` did for a one-process run: its environment and its rendezvous folder."""
    for name, value in list(_SET_HERE.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
    _SET_HERE.clear()
    while _RENDEZVOUS_DIRS:
        shutil.rmtree(_RENDEZVOUS_DIRS.pop(), ignore_errors=True)


def all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` is True on every rank (a collective)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag)
    return int(flag.item()) == 0
