"""Every reach into DeepSpeed's internals (tested with DeepSpeed 0.19.8, the pin of setup.cfg).

* ZeRO-3's per-parameter attributes (set by ``partition_parameters.Init._convert_to_deepspeed_param``): ``ds_id``
  marks a parameter ZeRO-3 converted, ``ds_shape``/``ds_numel`` its full size, ``ds_tensor`` this rank's flat
  partition, ``ds_process_group`` the group it is partitioned over. ``is_zero3_param``, ``is_zero3_partitioned``,
  ``full_shape``, ``full_numel``, ``local_partition``, ``partition_group`` read them; ``tag_partition`` sets the
  ``ds_zero_partition_*``/``ds_zero_placement_family`` attributes ZeRO-3 reads to partition an expert
  parameter within its own group (moe_plugin.parallel.layout says why); ``partition_like`` calls the
  ``convert_to_zero_parameters`` method ``Init`` attaches to a converted parameter. ``tiled_gradients`` sets
  ``ds_grad_is_ready``, which ZeRO-3's optimizer reads before it reduces a gradient (a tiled loop's last one).
* The private expert-group functions of ``deepspeed.utils.groups`` (``expert_groups``).
* ``TorchCheckpointEngine.load``, replaced while an engine checkpoint loads (``safe_checkpoint_loading``).
* The communication backend's collective attributes (``use_current_collectives``).

``check()`` verifies each of those names once at start-up (``moe_plugin.compat.check_all``).

Loading DeepSpeed's engine checkpoint files without running code from them: DeepSpeed 0.19.8 reads every
engine file of ``engine.load_checkpoint`` (``mp_rank_*_model_states.pt``,
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
import sys
import zipfile
from typing import Any, Iterator, List, Tuple

import torch

from ._upstream import missing, require_in_source, resolve

__all__ = [
    "deepspeed_safe_globals",
    "load_engine_file",
    "check_engine_files",
    "safe_checkpoint_loading",
    "use_current_collectives",
    "TESTED_DEEPSPEED",
    "check",
    "is_zero3_param",
    "is_zero3_partitioned",
    "full_shape",
    "full_numel",
    "local_partition",
    "partition_group",
    "partition_like",
    "tag_partition",
    "expert_groups",
    "inner_optimizer",
    "tiled_gradients",
    "adam_states",
    "stepped_tensors",
]

TESTED_DEEPSPEED = "0.19.8"
_DIST = "deepspeed"
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
            return line[line.index("Unsupported") :].split(" was not an allowed")[0].rstrip(".")
    return f"{type(err).__name__}: {lines[0] if lines else 'no detail'}"[:300]


def load_engine_file(path, map_location=None):
    """``torch.load(path, weights_only=True)`` allowing ``deepspeed_safe_globals()`` only; a file that cannot
    load so is a one-line ValueError naming it (nothing in it has run)."""
    path = os.fspath(path)
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (
        pickle.UnpicklingError,
        EOFError,
        RuntimeError,
        zipfile.BadZipFile,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
    ) as err:
        checkpoint = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        raise ValueError(
            f"{path}: not a DeepSpeed checkpoint file that loads without running code "
            f"({_reason(err)}): it is damaged or was not written by this run; remove "
            f"{checkpoint} to resume from an earlier checkpoint"
        ) from None


def check_engine_files(directory, rank: int = 0, world_size: int = 1) -> None:
    """Load this rank's share (every ``world_size``-th, sorted) of the engine files under ``directory`` with
    ``load_engine_file`` and drop them: a damaged file is found before ``engine.load_checkpoint``, whose
    collectives would leave the other ranks waiting on one that failed."""
    found = sorted(
        os.path.join(parent, name)
        for parent, _, names in os.walk(os.fspath(directory))
        for name in names
        if name.endswith(".pt")
    )
    for path in found[rank::world_size]:
        load_engine_file(path, map_location="cpu")


def _target():
    module_name, class_name, method = _TARGET
    owner = resolve("deepspeed", _DIST, TESTED_DEEPSPEED, module_name, class_name)
    if not callable(vars(owner).get(method)):  # inherited or gone: patching would miss DeepSpeed's own
        raise missing(
            "deepspeed",
            _DIST,
            TESTED_DEEPSPEED,
            f"{module_name}.{class_name}.{method}",
            "is missing (so engine checkpoints cannot load with weights_only=True)",
        )
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
_DEPRECATED_COLLECTIVES = {
    "reduce_scatter_function": ("reduce_scatter_tensor", "reduce_scatter_single"),
    "all_gather_function": ("all_gather_into_tensor", "all_gather_single"),
}


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


# --------------------------------------------------------------------------------------------------
# ZeRO-3's per-parameter attributes (DeepSpeed sets them in Init._convert_to_deepspeed_param and _partition_param)


def is_zero3_param(p: torch.Tensor) -> bool:
    """Whether ZeRO-3 converted ``p`` (``deepspeed.zero.Init`` or the engine): it has a ``ds_id``."""
    return hasattr(p, "ds_id")


def is_zero3_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p``'s values live in this rank's partition ``ds_tensor`` (``p.data`` is then a placeholder)."""
    return getattr(p, "ds_tensor", None) is not None and hasattr(p, "ds_shape")


def full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The full shape of ``p``: ZeRO-3's ``ds_shape`` for a converted parameter, else its own shape."""
    return tuple(getattr(p, "ds_shape", p.shape))


def full_numel(p: torch.Tensor) -> int:
    """The full element count of ``p``: ZeRO-3's ``ds_numel`` for a converted parameter, else ``numel()``."""
    return int(getattr(p, "ds_numel", p.numel()))


def local_partition(p: torch.Tensor):
    """This rank's flat ZeRO-3 partition of ``p`` (``ds_tensor``), or None for a parameter ZeRO-3 left whole."""
    return getattr(p, "ds_tensor", None)


def partition_group(p: torch.Tensor):
    """The process group ZeRO-3 partitions ``p`` over (``ds_process_group``)."""
    return p.ds_process_group


def inner_optimizer(optimizer):
    """The torch optimizer inside the engine's ``optimizer``: DeepSpeed's ZeRO and bf16 optimizers hold it as
    ``.optimizer`` (stepping their flat fp32 partitions); a plain torch optimizer (one process, fp32, no ZeRO) is
    its own."""
    return getattr(optimizer, "optimizer", optimizer)


def adam_states(optimizer) -> dict:
    """The per-tensor state dict of ``inner_optimizer(optimizer)``."""
    return inner_optimizer(optimizer).state


def stepped_tensors(optimizer) -> list:
    """The tensors ``inner_optimizer(optimizer)`` steps: its parameter groups' (a plain or DeepSpeed's bf16
    optimizer), and ZeRO-3's flat fp32 partitions (``fp32_partitioned_groups_flat``, which ZeRO-3 swaps into the
    groups one sub-group at a time while it steps)."""
    inner = inner_optimizer(optimizer)
    tensors = [t for group in inner.param_groups for t in group["params"]]
    known = {id(t) for t in tensors}
    return tensors + [t for t in getattr(optimizer, "fp32_partitioned_groups_flat", []) if id(t) not in known]


def tiled_gradients(params, ready: bool) -> None:
    """Tell ZeRO-3 whether the gradient now accumulating into each of ``params`` is its last of this backward
    (``ds_grad_is_ready``, read by ``DeepSpeedZeroOptimizer_Stage3``): a computation tiled into a loop of module
    calls, each with its own ``torch.autograd.backward`` (``ops.dsa.latent_attention``), sets False before all
    but the last, so ZeRO-3 reduces the sum once, as DeepSpeed's own tiled MLP does. Harmless without ZeRO-3."""
    for p in params:
        p.ds_grad_is_ready = ready


def partition_like(p: torch.Tensor, params) -> None:
    """Partition ``params`` as ZeRO-3 partitioned ``p`` was (its ``Init``'s config, within the groups their own
    tags name): ``p.convert_to_zero_parameters``, which ``Init`` attaches to every parameter it converts."""
    p.convert_to_zero_parameters(param_list=list(params))


def tag_partition(p: torch.Tensor, group, group_name: str, placement_family: str) -> None:
    """Make ZeRO-3 partition ``p`` within ``group`` (``ds_zero_partition_process_group``, read by
    ``Init._convert_to_deepspeed_param``), under the group name and placement family its stage-3 optimizer
    reads (``ds_zero_partition_group_name``, ``ds_zero_placement_family``)."""
    p.ds_zero_partition_group_name = group_name
    p.ds_zero_partition_process_group = group
    p.ds_zero_placement_family = placement_family


# --------------------------------------------------------------------------------------------------
# deepspeed.utils.groups: private in 0.19.8; what DeepSpeed's own MoE layers call to create "ep_size_{EP}"

_GROUPS = "deepspeed.utils.groups"
_GROUP_FUNCTIONS = ("_create_expert_and_data_parallel", "_get_expert_parallel_group", "_get_expert_data_parallel_group")


# DeepSpeed's registry of the groups it created (module-level dicts of deepspeed.utils.groups), each emptied by
# forget_groups when the process group they were made from is destroyed
_GROUP_REGISTRIES = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
)


# and the groups it keeps one of (None until made)
_GROUP_SINGLES = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP")


def forget_groups() -> None:
    """Empty DeepSpeed's registry of the groups it made: they were made from the default process group, so once
    that is destroyed they are dead, and DeepSpeed would hand them out again (the expert groups by name,
    ``ep_size_{EP}``) to a process group started later in the same process, at another world size too."""
    groups = resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _GROUPS)
    for name in _GROUP_REGISTRIES:
        resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _GROUPS, name).clear()
    for name in _GROUP_SINGLES:
        resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _GROUPS, name)
        setattr(groups, name, None)


def expert_groups(ep_size: int, name: str) -> Tuple[Any, Any]:
    """Create DeepSpeed's expert and expert-data-parallel groups for ``ep_size`` and return them, as
    ``(expert_parallel, expert_data_parallel)``, from DeepSpeed's registry under ``name``."""
    create, get_ep, get_edp = (resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _GROUPS, f) for f in _GROUP_FUNCTIONS)
    create(ep_size)
    return get_ep(name), get_edp(name)


# --------------------------------------------------------------------------------------------------

_ZERO3_INIT = ("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param")
_ZERO3_SET = ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_process_group", "ds_zero_partition_process_group")
_ZERO3_OPTIMIZER = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
_ZERO3_OPTIMIZER_READS = ("ds_zero_placement_family", "ds_zero_partition_group_name", "ds_grad_is_ready")
_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def check() -> None:
    """Every DeepSpeed name this module uses exists in the installed DeepSpeed (RuntimeError naming the first
    that does not, the installed version and ``TESTED_DEEPSPEED``)."""
    for function in _GROUP_FUNCTIONS + _GROUP_REGISTRIES + _GROUP_SINGLES:
        resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _GROUPS, function)
    _target()
    for module, name in _SAFE_GLOBALS:
        resolve("deepspeed", _DIST, TESTED_DEEPSPEED, module, name)
    convert = resolve("deepspeed", _DIST, TESTED_DEEPSPEED, *_ZERO3_INIT)
    require_in_source(
        "deepspeed",
        _DIST,
        TESTED_DEEPSPEED,
        convert,
        ".".join(_ZERO3_INIT),
        _ZERO3_SET,
        "the ZeRO-3 parameter attribute",
    )
    init = resolve("deepspeed", _DIST, TESTED_DEEPSPEED, _ZERO3_INIT[0], "Init")
    require_in_source(
        "deepspeed",
        _DIST,
        TESTED_DEEPSPEED,
        init,
        f"{_ZERO3_INIT[0]}.Init",
        ("convert_to_zero_parameters",),
        "the ZeRO-3 parameter method",
    )
    optimizer = resolve("deepspeed", _DIST, TESTED_DEEPSPEED, *_ZERO3_OPTIMIZER)
    require_in_source(
        "deepspeed",
        _DIST,
        TESTED_DEEPSPEED,
        optimizer,
        ".".join(_ZERO3_OPTIMIZER),
        _ZERO3_OPTIMIZER_READS,
        "the ZeRO-3 parameter attribute",
    )
    require_in_source(
        "deepspeed",
        _DIST,
        TESTED_DEEPSPEED,
        optimizer,
        ".".join(_ZERO3_OPTIMIZER),
        ("self.optimizer = ", "fp32_partitioned_groups_flat"),
        "the wrapped torch optimizer and its flat partitions (adam_states, stepped_tensors)",
    )
    resolve("deepspeed", _DIST, TESTED_DEEPSPEED, "deepspeed.comm.comm")
    resolve("deepspeed", _DIST, TESTED_DEEPSPEED, "deepspeed.runtime.zero.linear", "zero3_linear_wrap")
    require_in_source(
        "deepspeed",
        _DIST,
        TESTED_DEEPSPEED,
        resolve("deepspeed", _DIST, TESTED_DEEPSPEED, *_LINEAR_PATCHER),
        ".".join(_LINEAR_PATCHER),
        ("linear_bk",),
        "where zero.Init keeps torch's linear while its own replaces it",
    )


# zero.Init's patcher: it keeps torch's F.linear as ``linear_bk`` the first time it puts zero3_linear_wrap in place
_LINEAR_PATCHER = ("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses")


def restore_torch_linear() -> None:
    """``torch.nn.functional.linear`` back to torch's own, as a fresh process has it. A base built under
    ``deepspeed.zero.Init`` with ``memory_efficient_linear`` (on by default) leaves DeepSpeed's linear in place for
    the rest of the process, by design (as does the engine's conversion of a model built whole); a later run in the
    same process (a notebook, a test worker) whose config turns it off, or one under FSDP2, would train with it all
    the same. Each run calls this first: the run's own engine and config decide."""
    import torch.nn.functional as F

    torch_linear = getattr(resolve("deepspeed", _DIST, TESTED_DEEPSPEED, *_LINEAR_PATCHER), "linear_bk", None)
    if torch_linear is not None:
        F.linear = torch_linear


@contextlib.contextmanager
def linear_as_trained(zero3_linear: bool) -> Iterator[None]:
    """``torch.nn.functional.linear`` as a ZeRO-3 run trains with it, within the block: a model built under
    ``deepspeed.zero.Init`` with ``zero_optimization.memory_efficient_linear`` (on by default) leaves DeepSpeed's
    ``zero3_linear_wrap`` in its place for the rest of the process, whose autograd function saves its input also
    for a frozen weight (torch's linear saves only the weight then). The planner's meta runs take it so
    (``plan.layout_activations``)."""
    if not zero3_linear:
        yield
        return
    import torch.nn.functional as F

    if "deepspeed" not in sys.modules:
        # the planner's first import of DeepSpeed: its logger, made now, writes to stderr (the plan's --json owns
        # stdout; DeepSpeed announces the accelerator it picked when imported)
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    before, F.linear = F.linear, zero3_linear_wrap
    try:
        yield
    finally:
        F.linear = before
