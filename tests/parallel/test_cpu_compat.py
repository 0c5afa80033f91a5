"""moe_plugin.parallel.cpu_compat: applied only without CUDA, idempotent, every patch listed and undoable.

The in-process tests decide "CUDA or not" by mocking ``torch.cuda.is_available``, and the ranks of the launch
run with their GPUs hidden, so the suite means the same on a machine with GPUs."""

import importlib
from unittest import mock

import pytest
import torch

from moe_plugin.parallel import cpu_compat

MODULES = list(cpu_compat.CPU_DEVICE_MODULES)


@pytest.fixture
def clean():
    cpu_compat.remove_cpu_patches()
    yield
    cpu_compat.remove_cpu_patches()


def _upstream_state():
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    return ({name: importlib.import_module(name).torch for name in MODULES}, dispatcher.maybe_move_tensor_to_cpu)


def test_no_patch_with_cuda(clean):
    before = _upstream_state()
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert cpu_compat.apply_cpu_patches() == []
    assert cpu_compat.cpu_patches_applied() == []
    assert _upstream_state() == before
    assert all(t is torch for t in before[0].values()), "megatron modules must see the real torch with CUDA"


def test_every_patch_applied_and_listed_without_cuda(clean):
    with mock.patch("torch.cuda.is_available", return_value=False):
        applied = cpu_compat.apply_cpu_patches()
    assert applied == list(cpu_compat.CPU_PATCH_NAMES), f"missing: {set(cpu_compat.CPU_PATCH_NAMES) - set(applied)}"
    assert cpu_compat.cpu_patches_applied() == applied
    for name in MODULES:
        seen = importlib.import_module(name).torch
        assert seen is not torch and seen.cuda.current_device() == torch.device("cpu"), name
        assert seen.Tensor is torch.Tensor and seen.cuda.is_available is torch.cuda.is_available
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert moe_utils.te_general_gemm is None


def test_apply_is_idempotent_and_removable(clean):
    with mock.patch("torch.cuda.is_available", return_value=False):
        first = cpu_compat.apply_cpu_patches()
        state = _upstream_state()
        assert cpu_compat.apply_cpu_patches() == first
    assert _upstream_state() == state, "a second apply must not wrap the patches again"
    cpu_compat.remove_cpu_patches()
    assert cpu_compat.cpu_patches_applied() == []
    assert all(t is torch for t in _upstream_state()[0].values())
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert not hasattr(moe_utils, "te_general_gemm"), "removal must restore 0.16.1's missing name"


def test_removal_restores_the_dispatcher_stream_cache(clean):
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    cls = dispatcher.MoEAlltoAllTokenDispatcher
    before = cls.cuda_dtoh_stream
    with mock.patch("torch.cuda.is_available", return_value=False):
        cpu_compat.apply_cpu_patches()
    cls.cuda_dtoh_stream = dispatcher.torch.cuda.Stream()  # what the first dispatcher's __init__ does
    cpu_compat.remove_cpu_patches()
    assert cls.cuda_dtoh_stream is before, "a null stream must not outlive the patches"


def test_current_device_serves_as_an_allocation_device(clean):
    with mock.patch("torch.cuda.is_available", return_value=False):
        cpu_compat.apply_cpu_patches()
    for name in MODULES:  # upstream callers pass it on as ``device=``
        seen = importlib.import_module(name).torch
        assert torch.empty(2, device=seen.cuda.current_device()).device.type == "cpu", name


def test_split_sizes_reach_gloo_as_host_arrays(clean):
    with mock.patch("torch.cuda.is_available", return_value=False):
        cpu_compat.apply_cpu_patches()
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    moved = dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 0, 2]), as_numpy=True)
    assert moved.tolist() == [3, 0, 2] and not torch.is_tensor(moved)
    counts = torch.tensor([1, 2])
    assert dispatcher.maybe_move_tensor_to_cpu(counts) is counts


def test_ranks_run_with_every_patch(ep_results, ep_check):
    for rank, result in enumerate(ep_results):
        assert result["patches"]["cuda"] is False
        assert result["patches"]["applied"] == list(cpu_compat.CPU_PATCH_NAMES), f"rank {rank}"
    ep_check("moe/mixed")
