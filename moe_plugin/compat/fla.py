"""flash-linear-attention (``fla``, the ``fla-core`` distribution; tested with 0.6.0, the ``gpu`` extra of
setup.cfg): the Triton kernels the KDA attention uses on CUDA tensors.

``moe_plugin.ops.backend.gpu_kernel`` is the one place that picks them: when CUDA tensors arrive and the
kernel does not import it warns once (``missing_kernel_message``: the torch path runs, 35-90x slower), and
with ``MOE_PLUGIN_REQUIRE_KERNELS=1`` it raises instead. CPU tensors always take the torch path, which is the
intended one there, so nothing is said. fla is optional: ``check()`` verifies the kernel names only where fla
is installed and CUDA is usable (its import looks for a GPU driver).

``chunk_kda_on_meta`` is fla's ``chunk_kda`` as the planner counts it on ``meta`` (a Triton kernel cannot run
there): what 0.6's ``ChunkKDAFunction`` saves and what its forward makes and drops, read off its source.
``ops.backend.gpu_kernel`` picks it for meta tensors inside ``ops.backend.planning_for("cuda")``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._upstream import installed_version, resolve

__all__ = [
    "TESTED_FLA",
    "DISTRIBUTION",
    "KERNELS",
    "REQUIRE_ENV",
    "check",
    "chunk_kda_on_meta",
    "missing_kernel_message",
]

TESTED_FLA = "0.6.0"
DISTRIBUTION = "fla-core"
# (module, function) of every fla kernel moe_plugin calls
KERNELS = (("fla.ops.kda", "chunk_kda"),)
REQUIRE_ENV = "MOE_PLUGIN_REQUIRE_KERNELS"


def missing_kernel_message(module: str, attr: str, reason: str = "") -> str:
    """One line: CUDA tensors reached ``module.attr``, which did not import, so the torch path runs."""
    because = f" ({reason})" if reason else ""
    return (
        f"moe_plugin.compat.fla: CUDA tensors reached {module}.{attr}, which does not import with "
        f"{DISTRIBUTION} {installed_version(DISTRIBUTION)}{because}: the torch path runs instead, 35-90x slower; "
        f"install {DISTRIBUTION}=={TESTED_FLA} (pip install 'moe_plugin[gpu]'), or set {REQUIRE_ENV}=1 to make "
        "this an error"
    )


def check() -> None:
    """Where fla is installed and CUDA is usable, every kernel of ``KERNELS`` exists (RuntimeError naming it, the
    installed version and ``TESTED_FLA``); elsewhere nothing to check (the torch path is used)."""
    import torch

    if installed_version(DISTRIBUTION) == "(not installed)" or not torch.cuda.is_available():
        return
    for module, attr in KERNELS:
        resolve("fla", DISTRIBUTION, TESTED_FLA, module, attr)


FLA_CHUNK = 64  # fla's KDA chunk length: its per-chunk states and intra-chunk matrices are sized by it


class _ChunkKDAMemory(torch.autograd.Function):
    """fla 0.6's ``ChunkKDAFunction`` (default recompute) on meta: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]`` -> o ``[B, T, H, V]``; ``chunks`` is the number of chunks over every sequence. It saves
    its inputs, the chunk-local cumulative gate (fp32) and the two intra-chunk matrices ``Aqk``, ``Akk``
    ``[B, T, H, chunk]``; its forward makes and drops the per-chunk states ``h [B, chunks, H, K, V]``, the WY
    factors, the gated keys, the new values and fp32 diagonal blocks."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunks: int):
        b, t, h, kd = q.shape
        g_cumsum = g.new_empty(b, t, h, kd, dtype=torch.float32)
        a_qk, a_kk = q.new_empty(b, t, h, FLA_CHUNK), q.new_empty(b, t, h, FLA_CHUNK)
        work = [
            q.new_empty(b, chunks, h, kd, v.shape[-1]),
            q.new_empty(b, t, h, kd),
            v.new_empty(v.shape),
            q.new_empty(b, t, h, kd),
            v.new_empty(v.shape),
            g.new_empty(b, t, h, 16, dtype=torch.float32),
        ]
        out = v.new_empty(v.shape)
        del work
        ctx.save_for_backward(q, k, v, g, beta, g_cumsum, a_qk, a_kk)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta = ctx.saved_tensors[:5]
        return tuple(torch.zeros_like(t) for t in (q, k, v, g, beta)) + (None,)


def chunk_kda_on_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fla's ``chunk_kda`` call on meta tensors: o ``[B, T, H, V]`` and the final state ``[N, H, K, V]`` fp32
    (or None), with the kernel's saved set and working tensors (``_ChunkKDAMemory``). cu_seqlens: a CPU tensor
    (the planner's packed offsets), read for the chunk count."""
    if not q.is_meta:
        raise ValueError(f"q: chunk_kda_on_meta counts fla's kernel on meta tensors, got {q.device}")
    if cu_seqlens is None:
        chunks = q.shape[0] * -(-q.shape[1] // FLA_CHUNK)
    else:
        if cu_seqlens.is_meta:
            raise ValueError("cu_seqlens: give the packed offsets as a CPU tensor (a meta tensor has no values)")
        bounds = cu_seqlens.tolist()
        chunks = sum(-(-(b - a) // FLA_CHUNK) for a, b in zip(bounds, bounds[1:]) if b > a)
    o = _ChunkKDAMemory.apply(q, k, v, g, beta, chunks)
    final = None
    if output_final_state:
        sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        final = q.new_empty(sequences, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    return o, final
