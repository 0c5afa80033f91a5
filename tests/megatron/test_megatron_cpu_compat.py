"""moe_plugin.megatron.cpu_compat: applied only without CUDA, idempotent, every patch listed and undoable."""

import importlib
from unittest import mock

import pytest
import torch

from moe_plugin.megatron import cpu_compat

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
