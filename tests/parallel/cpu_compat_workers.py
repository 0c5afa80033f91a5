"""Rank-side code of test_cpu_compat.py (run by run_distributed without a process group; nothing asserts here)."""

import importlib
import os

import torch


def deepspeed_all_reduce() -> dict:
    """Start torch.distributed through DeepSpeed on the launcher's file rendezvous, all-reduce once through
    deepspeed.comm, and report what the patched DeepSpeed backend holds."""
    import deepspeed
    import deepspeed.comm as ds_comm

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch as an attribute is torch itself

    from moe_plugin.parallel.cpu_compat import cpu_patches_applied
    from moe_plugin.parallel.distributed import INIT_METHOD_ENV, prepared_device

    applied = cpu_patches_applied()  # before DeepSpeed starts: the launcher's prepare_device("cpu") did it
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(
        "gloo", auto_mpi_discovery=False, init_method=os.environ[INIT_METHOD_ENV], rank=rank, world_size=world
    )
    total = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    ds_comm.all_reduce(total)
    return {
        "applied": applied,
        "device": prepared_device(),
        "cuda": torch.cuda.is_available(),
        "sum": total,
        "backend": ds_comm.comm.cdb.get_backend(),
        "shm_op": ds_comm.comm.cdb.shm_comm_op,
        "builder": ds_torch.build_shm_op.__qualname__,
    }
