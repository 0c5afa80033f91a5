"""Loading DeepSpeed's engine checkpoint files without running code from them.

DeepSpeed 0.19.8 reads every engine file of ``engine.load_checkpoint`` (``mp_rank_*_model_states.pt``,
``zero_pp_rank_*_model_states.pt``, ``zero_pp_rank_*_optim_states.pt``, the MoE expert files) through
``TorchCheckpointEngine.load``, which calls ``torch.load(weights_only=False)``: a crafted file in a checkpoint
directory would run its payload on resume. ``safe_checkpoint_loading()`` replaces that one method, for the
duration of a ``with`` block, by ``load_engine_file``: ``torch.load(weights_only=True)`` with the few
DeepSpeed classes those files hold allowed (``deepspeed_safe_globals()``, the project's single allow-list,
also used by ``moe-plugin export --step``). A file that is damaged, not a torch file, or holds any other
global is a one-line ValueError naming it. See docs/training.md ("Checkpoints").

``use_current_collectives()`` makes DeepSpeed's ZeRO-3 call torch's ``reduce_scatter_single`` (and
``all_gather_single``) instead of their deprecated aliases ``reduce_scatter_tensor``/``all_gather_into_tensor``,
whose FutureWarning every rank printed into the progress bar. No warning is filtered.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from typing import Iterator, List

import torch

__all__ = ["deepspeed_safe_globals", "load_engine_file", "check_engine_files", "safe_checkpoint_loading",
           "use_current_collectives", "TESTED_DEEPSPEED"]

TESTED_DEEPSPEED = "0.19.8"
# the one upstream internal patched here: (module, class, method)
_TARGET = ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine", "load")


def deepspeed_safe_globals() -> List[type]:
    """The classes DeepSpeed's engine files pickle besides tensors and containers (read off real ZeRO-0/3
    checkpoints, and ZeRO-1/2's ``state_dict``): the loss scaler (static in bf16/fp32, dynamic in fp16), the
    ZeRO stage enum and the ZeRO-1/2 parameter slice mappings."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _reason(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:  # torch's weights-only refusal is a paragraph; this line names what was refused
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line[line.index("Unsupported"):].split(" was not an allowed")[0].rstrip(".")
    return f"{type(err).__name__}: {lines[0] if lines else 'no detail'}"[:300]


def load_engine_file(path, map_location=None):
    """``torch.load(path, weights_only=True)`` allowing ``deepspeed_safe_globals()`` only; a file that cannot
    load so is a one-line ValueError naming it (nothing in it has run)."""
    path = os.fspath(path)
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, ValueError, TypeError,
            AttributeError, KeyError) as err:
        checkpoint = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        raise ValueError(f"{path}: not a DeepSpeed checkpoint file that loads without running code "
                         f"({_reason(err)}): it is damaged or was not written by this run; remove "
                         f"{checkpoint} to resume from an earlier checkpoint") from None


def check_engine_files(directory, rank: int = 0, world_size: int = 1) -> None:
    """Load this rank's share (every ``world_size``-th, sorted) of the engine files under ``directory`` with
    ``load_engine_file`` and drop them: a damaged file is found before ``engine.load_checkpoint``, whose
    collectives would leave the other ranks waiting on one that failed."""
    found = sorted(os.path.join(parent, name) for parent, _, names in os.walk(os.fspath(directory))
                   for name in names if name.endswith(".pt"))
    for path in found[rank::world_size]:
        load_engine_file(path, map_location="cpu")


def _target():
    import importlib

    import deepspeed

    module_name, class_name, method = _TARGET
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
        if not callable(vars(owner).get(method)):  # inherited or gone: patching would miss DeepSpeed's own
            raise AttributeError(method)
    except (ImportError, AttributeError):
        raise RuntimeError(f"DeepSpeed {deepspeed.__version__}: {module_name}.{class_name}.{method} does not exist, "
                           "so its engine checkpoints cannot be loaded with weights_only=True; install the tested "
                           f"DeepSpeed {TESTED_DEEPSPEED} (setup.cfg pins it)") from None
    return owner, method


@contextlib.contextmanager
def safe_checkpoint_loading() -> Iterator[None]:
    """Inside the block, DeepSpeed loads engine files with ``load_engine_file`` (wrap ``engine.load_checkpoint``
    in it). RuntimeError naming the DeepSpeed version when the patched internal is missing."""
    owner, method = _target()
    original = owner.__dict__[method]

    def load(self, path, map_location=None):
        return load_engine_file(path, map_location=map_location)

    setattr(owner, method, load)
    try:
        yield
    finally:
        setattr(owner, method, original)


# DeepSpeed's communication backend attribute -> (torch's deprecated function it holds, torch's replacement)
_DEPRECATED_COLLECTIVES = {"reduce_scatter_function": ("reduce_scatter_tensor", "reduce_scatter_single"),
                           "all_gather_function": ("all_gather_into_tensor", "all_gather_single")}


def use_current_collectives() -> None:
    """Point DeepSpeed's communication backend (started by ``deepspeed.init_distributed``) at torch's
    current ``reduce_scatter_single``/``all_gather_single`` where it holds their deprecated aliases, which
    only forward to them. Call after ``deepspeed.init_distributed``; a backend or torch without those names
    is left as it is (the calls work either way: this only stops the FutureWarnings)."""
    import deepspeed.comm.comm as ds_comm

    backend = getattr(ds_comm, "cdb", None)
    for attribute, (old, new) in _DEPRECATED_COLLECTIVES.items():
        current = getattr(torch.distributed, new, None)
        if current is not None and getattr(backend, attribute, None) is getattr(torch.distributed, old, None):
            setattr(backend, attribute, current)
