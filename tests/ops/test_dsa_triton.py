"""DSA's sparse attention as one Triton launch per pass (moe_plugin/ops/dsa/sparse_triton.py, issue 24), checked
without a GPU: Triton's interpreter runs the kernels on CPU tensors in one subprocess (dsa_triton_worker.py,
``TRITON_INTERPRET=1``), against the dense reference (fp64 autograd) and the blocked CPU pair. Which path runs
is ops.backend's choice: CPU tensors get the blocked loop, CUDA tensors the Triton pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_plugin.ops.backend as backend
from moe_plugin.ops.dsa import sparse_op

WORKER = Path(__file__).with_name("dsa_triton_worker.py")
ROOT = Path(__file__).resolve().parents[2]
FP32_TOL = 2e-6  # max error / max(1, max |ref|): about 16 fp32 ulps; measured 1e-7..7e-7
FP16_TOL = 2e-3  # fp16 inputs and outputs (fp32 inside) against the fp64 reference; measured 3e-4
QUANTITIES = ("out", "dq", "dk", "dv")
BLOCKED = ("out_blocked", "lse_blocked", "dq_blocked", "dk_blocked", "dv_blocked")


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("MOE_PLUGIN_DISABLE_KERNELS", None)
    done = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["random_int64", "topk24_tiles16", "causal_int32", "noncontiguous_int32"])
def test_fp32_kernels_equal_reference_and_blocked_pair(report, case):
    """out, lse, dq, dk, dv of the kernels against the reference and the blocked pair to fp32 rounding; dtypes
    as the blocked pair's, ``-inf`` log-sum-exp and zero output and dq exactly where a query has no key."""
    res = report["cases"][case]
    errors = {name: res[name] for name in QUANTITIES + BLOCKED}
    assert max(errors.values()) < FP32_TOL, errors
    assert res["exact"]


@pytest.mark.distributed
def test_cases_cover_empty_queries_and_causal_rows(report):
    assert report["cases"]["random_int64"]["empty_queries"] == 1  # a query whose slots are all -1
    assert report["cases"]["causal_int32"]["empty_queries"] == 0


@pytest.mark.distributed
def test_fp16_kernels_recompute_the_fp32_log_sum_exp(report):
    """fp16 inputs: the saved lse is fp16, the backward recomputes it in fp32 (RECOMPUTE_LSE)."""
    res = report["cases"]["fp16"]
    errors = {name: res[name] for name in QUANTITIES}
    assert max(errors.values()) < FP16_TOL, errors
    assert res["exact"]


@pytest.mark.distributed
def test_the_custom_op_runs_the_pair_where_gpu_kernel_gives_it(report):
    """``sparse_attention`` with ``gpu_kernel`` answering as for CUDA: one call of each kernel, and output and
    gradients (through the op's autograd) equal the reference's."""
    res = report["op"]
    assert res["calls"] == ["sparse_attention_triton", "sparse_attention_triton_backward"]
    errors = {name: res[name] for name in QUANTITIES}
    assert max(errors.values()) < FP32_TOL, errors


def _tensors():
    q, k, v = torch.zeros(1, 4, 1, 3), torch.zeros(1, 5, 1, 3), torch.zeros(1, 5, 1, 2)
    return q, k, v, (torch.arange(4)[:, None] + torch.arange(2))[None]  # [1, 4, 2]: keys t and t + 1


def test_cpu_tensors_take_the_blocked_path(monkeypatch):
    """On the CPU ``gpu_kernel`` answers None for both kernels and nothing is imported: the blocked loop runs."""
    imported = []
    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: imported.append(module))
    q, k, v, idx = _tensors()
    assert backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton", q, k, v, idx) is None
    assert backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton_backward", q, q, k, v, idx) is None
    assert imported == []


def test_cuda_tensors_get_the_triton_pair(monkeypatch):
    """As if the tensors lived on a GPU: ``gpu_kernel`` imports and returns the two entries of sparse_triton."""
    from moe_plugin.ops.dsa import sparse_triton

    monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)
    monkeypatch.delenv("MOE_PLUGIN_DISABLE_KERNELS", raising=False)
    q, k, v, idx = _tensors()
    fwd = backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton", q, k, v, idx)
    bwd = backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton_backward", q, q, k, v, idx)
    assert fwd is sparse_triton.sparse_attention_triton
    assert bwd is sparse_triton.sparse_attention_triton_backward


def test_kernel_path_refuses_repeated_keys_in_debug_mode(monkeypatch):
    """The kernel path skips the blocked plan, so its repeat check is its own: with MOE_PLUGIN_DEBUG_CHECKS=1 a
    key twice in a row is refused before any launch; without it the kernel is called (no read)."""
    calls = []

    def kernel(q, k, v, indices, scale):
        calls.append(indices)
        return q.new_zeros(*q.shape[:3], v.shape[-1]), q.new_zeros(q.shape[:3])

    monkeypatch.setattr(sparse_op, "gpu_kernel", lambda module, attr, *tensors: kernel)
    q, k, v, idx = _tensors()
    idx[0, 2] = torch.tensor([3, 3])
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"^indices: a query of row 2 \(batch 0\) selects a key twice"):
        sparse_op.sparse_attention(q, k, v, idx, 0.5)
    assert calls == []
    idx[0, 2] = torch.tensor([3, -1])
    idx[0, 1] = torch.tensor([-1, -1])  # empty slots repeat freely
    sparse_op.sparse_attention(q, k, v, idx, 0.5)
    monkeypatch.delenv("MOE_PLUGIN_DEBUG_CHECKS")
    idx[0, 2] = torch.tensor([3, 3])
    sparse_op.sparse_attention(q, k, v, idx, 0.5)
    assert len(calls) == 2
