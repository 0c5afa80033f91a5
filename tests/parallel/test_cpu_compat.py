"""moe_plugin.parallel.cpu_compat: applied explicitly and in full, refused where CUDA is usable, a missing
upstream target named, idempotent, every patch undoable; DeepSpeed starts on gloo without building its
shared-memory op.

The in-process tests fix "CUDA or not" by mocking ``torch.cuda.is_available``, and the launched ranks run
with their GPUs hidden, so the suite means the same on a machine with GPUs."""

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest
import torch

from moe_plugin.parallel import cpu_compat
from moe_plugin.testing.launch import run_distributed

MODULES = list(cpu_compat.CPU_DEVICE_MODULES)
WORKERS = Path(__file__).with_name("cpu_compat_workers.py")
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


@pytest.fixture
def clean(monkeypatch):
    """No patch before or after the test; CUDA reported absent inside it."""
    cpu_compat.remove_cpu_patches()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    cpu_compat.remove_cpu_patches()


def _upstream_state():
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch as an attribute is torch itself

    dispatcher = importlib.import_module(DISPATCHER)
    return (
        {name: importlib.import_module(name).torch for name in MODULES},
        dispatcher.maybe_move_tensor_to_cpu,
        ds_torch.build_shm_op,
    )


def test_refused_where_cuda_is_usable(clean, monkeypatch):
    before = _upstream_state()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match='CUDA is available.*CUDA_VISIBLE_DEVICES=""'):
        cpu_compat.apply_cpu_patches()
    assert cpu_compat.cpu_patches_applied() == []
    assert _upstream_state() == before
    assert all(t is torch for t in before[0].values()), "megatron modules must keep the real torch"


def test_every_patch_applied_and_listed(clean):
    applied = cpu_compat.apply_cpu_patches()
    assert applied == list(cpu_compat.CPU_PATCH_NAMES)
    assert "deepspeed.comm.torch.build_shm_op" in applied and len(applied) == len(MODULES) + 7
    assert cpu_compat.cpu_patches_applied() == applied
    for name in MODULES:
        seen = importlib.import_module(name).torch
        assert seen is not torch and seen.cuda.current_device() == torch.device("cpu"), name
        assert seen.Tensor is torch.Tensor and seen.cuda.is_available is torch.cuda.is_available
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert moe_utils.te_general_gemm is None
    router = importlib.import_module("megatron.core.transformer.moe.router").TopKRouter
    assert not hasattr(router._apply_expert_bias, "_torchdynamo_orig_callable"), "must be the eager body"


def test_apply_is_idempotent_and_removable(clean):
    before = _upstream_state()
    first = cpu_compat.apply_cpu_patches()
    state = _upstream_state()
    assert cpu_compat.apply_cpu_patches() == first
    assert _upstream_state() == state, "a second apply must not wrap the patches again"
    cpu_compat.remove_cpu_patches()
    assert cpu_compat.cpu_patches_applied() == []
    assert _upstream_state() == before
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert not hasattr(moe_utils, "te_general_gemm"), "removal must restore 0.16.1's missing name"


def _compiled_wrapper_dropped(monkeypatch):
    router = importlib.import_module("megatron.core.transformer.moe.router").TopKRouter
    monkeypatch.setattr(router, "_apply_expert_bias", lambda self, routing_map: None)


@pytest.mark.parametrize(
    "patch, module, attr",
    [
        ("token_dispatcher.maybe_move_tensor_to_cpu", DISPATCHER, "maybe_move_tensor_to_cpu"),
        ("torch.cuda@megatron.core.tensor_parallel.utils", "megatron.core.tensor_parallel.utils", "torch"),
        ("random.cuda_rng_state", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
        ("transformer.utils.get_default_causal_mask", "megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
        ("deepspeed.comm.torch.build_shm_op", "deepspeed.comm.torch", "build_shm_op"),
    ],
)
def test_a_missing_target_is_named_and_nothing_stays_patched(clean, monkeypatch, patch, module, attr):
    monkeypatch.delattr(importlib.import_module(module), attr)
    with pytest.raises(RuntimeError) as info:
        cpu_compat.apply_cpu_patches()
    message = str(info.value)
    distribution = "deepspeed" if module.startswith("deepspeed") else "megatron-core"
    assert f"CPU patch {patch!r}" in message and f"{module}.{attr} does not exist" in message, message
    assert f"{distribution} {importlib.metadata.version(distribution)}" in message, message
    assert cpu_compat.cpu_patches_applied() == []
    assert all(importlib.import_module(name).torch is torch for name in MODULES if name != module), (
        "the patches applied before the failure must be undone"
    )


def test_an_uncompiled_router_is_a_missing_target(clean, monkeypatch):
    _compiled_wrapper_dropped(monkeypatch)
    with pytest.raises(
        RuntimeError,
        match=r"'router.TopKRouter._apply_expert_bias'.*"
        r"router\.TopKRouter\._apply_expert_bias\._torchdynamo_orig_callable",
    ):
        cpu_compat.apply_cpu_patches()


def test_a_module_that_does_not_import_is_named(clean, monkeypatch):
    name = "megatron.core.transformer.moe.shared_experts"
    monkeypatch.setitem(sys.modules, name, None)  # makes the import raise ImportError
    with pytest.raises(RuntimeError, match=f"'torch.cuda@{name}': cannot import {name}"):
        cpu_compat.apply_cpu_patches()
    assert cpu_compat.cpu_patches_applied() == []


def test_removal_restores_the_dispatcher_stream_cache(clean):
    dispatcher = importlib.import_module(DISPATCHER)
    cls = dispatcher.MoEAlltoAllTokenDispatcher
    before = cls.cuda_dtoh_stream
    cpu_compat.apply_cpu_patches()
    cls.cuda_dtoh_stream = dispatcher.torch.cuda.Stream()  # what the first dispatcher's __init__ does
    cpu_compat.remove_cpu_patches()
    assert cls.cuda_dtoh_stream is before, "a null stream must not outlive the patches"


def test_current_device_serves_as_an_allocation_device(clean):
    cpu_compat.apply_cpu_patches()
    for name in MODULES:  # upstream callers pass it on as ``device=``
        seen = importlib.import_module(name).torch
        assert torch.empty(2, device=seen.cuda.current_device()).device.type == "cpu", name


def test_split_sizes_reach_gloo_as_host_arrays(clean):
    cpu_compat.apply_cpu_patches()
    dispatcher = importlib.import_module(DISPATCHER)
    moved = dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 0, 2]), as_numpy=True)
    assert moved.tolist() == [3, 0, 2] and not torch.is_tensor(moved)
    counts = torch.tensor([1, 2])
    assert dispatcher.maybe_move_tensor_to_cpu(counts) is counts


def test_deepspeed_gets_no_shared_memory_op(clean):
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch as an attribute is torch itself

    upstream = ds_torch.build_shm_op
    cpu_compat.apply_cpu_patches()
    assert ds_torch.build_shm_op is not upstream and ds_torch.build_shm_op() is None
    cpu_compat.remove_cpu_patches()
    assert ds_torch.build_shm_op is upstream


@pytest.mark.distributed
def test_deepspeed_starts_on_gloo_without_building_an_op(monkeypatch, tmp_path):
    extensions = tmp_path / "torch_extensions"  # where a JIT build of the shm op would land
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a GPU runner: a gloo run hides it
    results = run_distributed(f"{WORKERS}:deepspeed_all_reduce", world_size=2, timeout_s=200, init_process_group=False)
    for rank, r in enumerate(results):
        assert r["applied"] == list(cpu_compat.CPU_PATCH_NAMES), f"rank {rank}: the launcher must prepare the CPU"
        assert r["device"] == "cpu" and r["cuda"] is False
        assert torch.equal(r["sum"], torch.tensor([1.0 + 2.0, 10.0 + 20.0])), f"rank {rank}"
        assert r["shm_op"] is None and r["builder"] == "_no_shm_op" and r["backend"] == "gloo"
    assert not extensions.exists() or not any(extensions.iterdir()), "nothing may be JIT-built"
