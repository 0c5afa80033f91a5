"""DSA's sparse attention on CUDA: one Triton kernel launch for the forward, one for the backward (issue 24).

``sparse_op.py``'s custom-op kernels run these when ``ops.backend.gpu_kernel`` finds every tensor on CUDA;
elsewhere they run the blocked loop of ``attention.py`` (the fastest measured on the CPU). Same inputs and
results as ``blocked_forward`` / ``blocked_backward`` over a selection plan, without the Python loop over
query blocks and without host reads: the index slots are read by the kernel itself.

One program per (query, batch row x head): it walks the query's ``topk`` selected keys in blocks of
``BLOCK_N``, gathers their K (and V) rows through the indices and keeps an online softmax in fp32. Nothing of
size ``T x S`` exists; beyond the inputs and results the forward holds nothing and the backward two fp32
buffers of k's and v's shapes (the atomics' targets, when k/v are not fp32 already).

Determinism: dq and the forward are bit-reproducible (each program sums its own keys in a fixed order).
dk and dv are not: several queries select the same key row, and their contributions meet in ``tl.atomic_add``
in whatever order the programs run, so fp32 rounding differs from run to run.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

__all__ = ["sparse_attention_triton", "sparse_attention_triton_backward"]

_MAX_BLOCK_N = 64  # index slots per tile at most (tests lower it to run several tiles on small top-k)


@triton.jit
def _gather(base, idx, valid, stride_s, offs_d, d_mask, stride_d):
    """Rows ``idx`` ``[BLOCK_N]`` of one (batch, head) slice at ``base``: ``[BLOCK_N, D_P]`` in fp32, zeros in
    empty slots and padded columns."""
    ptrs = base + idx[:, None] * stride_s + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _slots(idx_row, n0, offs_n, topk, stride_ik):
    """Block ``n0`` of a query's index slots: the key positions (int64, 0 for an empty slot: a safe address)
    and which slots hold a key (``-1`` and the slots past ``topk`` do not)."""
    in_range = (n0 + offs_n) < topk
    idx = tl.load(idx_row + (n0 + offs_n) * stride_ik, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (idx >= 0)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _softmax_stats(q, k_base, idx_row, topk, scale, stride_ks, stride_kd, stride_ik, offs_n, offs_dqk, dqk_mask,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Max score and sum of exp(score - max) over the query's selected keys, online, in fp32 (the backward's
    fp32 log-sum-exp when the forward's was saved in a narrower dtype)."""
    m = tl.full([], float("-inf"), tl.float32)
    l_sum = tl.full([], 0.0, tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        idx, valid = _slots(idx_row, n0, offs_n, topk, stride_ik)
        kt = _gather(k_base, idx, valid, stride_ks, offs_dqk, dqk_mask, stride_kd)
        s = tl.where(valid, tl.sum(kt * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
        l_sum = l_sum * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe), 0)
        m = m_new
    return m, l_sum


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    H, topk, scale, DQK, DV,
    BLOCK_N: tl.constexpr, DQK_P: tl.constexpr, DV_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk, offs_dv = tl.arange(0, DQK_P), tl.arange(0, DV_P)
    dqk_mask, dv_mask = offs_dqk < DQK, offs_dv < DV
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + h * stride_qh + offs_dqk * stride_qd, mask=dqk_mask)
    q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    idx_row = idx_ptr + b * stride_ib + t * stride_it
    m = tl.full([], float("-inf"), tl.float32)  # running max score
    l_sum = tl.full([], 0.0, tl.float32)  # running sum of exp(s - m)
    acc = tl.zeros([DV_P], tl.float32)  # running sum of exp(s - m) * v
    for n0 in range(0, topk, BLOCK_N):
        idx, valid = _slots(idx_row, n0, offs_n, topk, stride_ik)
        kt = _gather(k_base, idx, valid, stride_ks, offs_dqk, dqk_mask, stride_kd)
        s = tl.where(valid, tl.sum(kt * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - 0) = 0, never NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe)  # 0 in empty slots
        vt = _gather(v_base, idx, valid, stride_vs, offs_dv, dv_mask, stride_vd)
        l_sum = l_sum * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        m = m_new
    has_key = l_sum > 0
    out = tl.where(has_key, acc / tl.where(has_key, l_sum, 1.0), 0.0)  # zeros for a query without keys
    lse = tl.where(has_key, m + tl.log(tl.where(has_key, l_sum, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b * stride_ob + t * stride_ot + h * stride_oh + offs_dv * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_mask)
    tl.store(lse_ptr + b * stride_lb + t * stride_lt + h * stride_lh, lse.to(lse_ptr.dtype.element_ty))


@triton.jit
def _backward_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    H, topk, scale, DQK, DV,
    RECOMPUTE_LSE: tl.constexpr, BLOCK_N: tl.constexpr, DQK_P: tl.constexpr, DV_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk, offs_dv = tl.arange(0, DQK_P), tl.arange(0, DV_P)
    dqk_mask, dv_mask = offs_dqk < DQK, offs_dv < DV
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + h * stride_qh + offs_dqk * stride_qd, mask=dqk_mask)
    q = q.to(tl.float32)
    do = tl.load(do_ptr + b * stride_dob + t * stride_dot + h * stride_doh + offs_dv * stride_dod, mask=dv_mask)
    do = do.to(tl.float32)
    o = tl.load(o_ptr + b * stride_ob + t * stride_ot + h * stride_oh + offs_dv * stride_od, mask=dv_mask)
    delta = tl.sum(do * o.to(tl.float32), 0)  # sum_s p_s dp_s = dO . O: the softmax Jacobian's shift
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    dk_base = dk_ptr + b * stride_dkb + h * stride_dkh
    dv_base = dv_ptr + b * stride_dvb + h * stride_dvh
    idx_row = idx_ptr + b * stride_ib + t * stride_it
    if RECOMPUTE_LSE:  # the saved lse is bf16/fp16: exp(s - lse) would be off by |lse| * 2^-8 relative
        m, l_sum = _softmax_stats(q, k_base, idx_row, topk, scale, stride_ks, stride_kd, stride_ik, offs_n,
                                  offs_dqk, dqk_mask, BLOCK_N)  # fmt: skip
        lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
    else:
        lse = tl.load(lse_ptr + b * stride_lb + t * stride_lt + h * stride_lh).to(tl.float32)
    shift = tl.where(lse == float("-inf"), float("inf"), lse)  # a query without keys: every p is 0
    dq = tl.zeros([DQK_P], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        idx, valid = _slots(idx_row, n0, offs_n, topk, stride_ik)
        kt = _gather(k_base, idx, valid, stride_ks, offs_dqk, dqk_mask, stride_kd)
        vt = _gather(v_base, idx, valid, stride_vs, offs_dv, dv_mask, stride_vd)
        s = tl.sum(kt * q[None, :], 1) * scale
        p = tl.where(valid, tl.exp(s - shift), 0.0)  # [BLOCK_N]
        dp = tl.sum(vt * do[None, :], 1)
        ds = p * (dp - delta)  # d(loss)/d(score), before the scale
        dq += tl.sum(ds[:, None] * kt, 0)
        # key rows are shared between queries: accumulate with atomics (order-dependent rounding, see docstring)
        tl.atomic_add(
            dk_base + idx[:, None] * stride_dks + offs_dqk[None, :] * stride_dkd,
            ds[:, None] * (q * scale)[None, :],
            mask=valid[:, None] & dqk_mask[None, :],
        )
        tl.atomic_add(
            dv_base + idx[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd,
            p[:, None] * do[None, :],
            mask=valid[:, None] & dv_mask[None, :],
        )
    dq_ptrs = dq_ptr + b * stride_dqb + t * stride_dqt + h * stride_dqh + offs_dqk * stride_dqd
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=dqk_mask)


def _tiles(q: torch.Tensor, v: torch.Tensor, topk: int) -> Tuple[int, int, int]:
    """(BLOCK_N, DQK_P, DV_P): head dims padded to powers of two (masked), and about 8K fp32 gathered values
    per tile so that a K tile stays in registers (64 keys at D=128, 32 at D=192/256)."""
    dqk_p = max(1, triton.next_power_of_2(q.shape[-1]))
    dv_p = max(1, triton.next_power_of_2(v.shape[-1]))
    block_n = max(16, min(_MAX_BLOCK_N, 8192 // max(dqk_p, dv_p), triton.next_power_of_2(max(topk, 1))))
    return block_n, dqk_p, dv_p


def sparse_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward of sparse attention in one launch, as ``blocked_forward`` over a selection plan.

    q: ``[B, T, H, Dqk]``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]`` (one floating dtype, any strides);
    indices: ``[B, T, topk]`` int32/int64 key positions in ``[0, S)`` shared by all heads, ``-1`` = empty slot.
    Not checked here (``sparse_attention`` checks with ``MOE_PLUGIN_DEBUG_CHECKS=1``): a repeat counts twice, a
    position out of range reads (and in backward writes) out of bounds. scale: multiplies ``q . k``.
    Returns out ``[B, T, H, Dv]`` and the log-sum-exp ``[B, T, H]``, both q's dtype (as ``blocked_forward``);
    a query without keys gets zeros and ``-inf``. Scores and sums are fp32 whatever the inputs' dtype.
    """
    B, T, H, dqk = q.shape
    topk = indices.shape[-1]
    out = q.new_empty(B, T, H, v.shape[-1])
    lse = q.new_empty(B, T, H)
    if lse.numel() == 0:
        return out, lse
    block_n, dqk_p, dv_p = _tiles(q, v, topk)
    _forward_kernel[(T, B * H)](
        q, k, v, indices, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *out.stride(), *lse.stride(),
        H, topk, float(scale), dqk, v.shape[-1],
        BLOCK_N=block_n, DQK_P=dqk_p, DV_P=dv_p, num_warps=4,
    )  # fmt: skip
    return out, lse


def sparse_attention_triton_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``sparse_attention_triton`` in one launch, as ``blocked_backward``: dq ``[B, T, H, Dqk]``,
    dk ``[B, S, H, Dqk]``, dv ``[B, S, H, Dv]`` (q's, k's, v's dtypes) from grad_out ``[B, T, H, Dv]`` and the
    forward's out ``[B, T, H, Dv]`` and lse ``[B, T, H]``. Probabilities are recomputed (as flash attention
    does); with an fp32 lse from it, else with the fp32 log-sum-exp recomputed in the kernel (one more pass
    over the selected K rows). dk, dv are summed with atomics in fp32: not bit-deterministic (module
    docstring); dq is.
    """
    B, T, H, dqk = q.shape
    topk = indices.shape[-1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    # the atomics' targets: fp32, in k's and v's shapes (never T x S)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if dq.numel():
        block_n, dqk_p, dv_p = _tiles(q, v, topk)
        _backward_kernel[(T, B * H)](
            grad_out, q, k, v, indices, out, lse, dq, dk, dv,
            *grad_out.stride(), *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *out.stride(),
            *lse.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            H, topk, float(scale), dqk, v.shape[-1],
            RECOMPUTE_LSE=lse.dtype != torch.float32, BLOCK_N=block_n, DQK_P=dqk_p, DV_P=dv_p, num_warps=4,
        )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)
