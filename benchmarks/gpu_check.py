"""One call that checks and times the GPU paths (run on a lent H200 through the device tool).

    pip install --no-deps benchmarks/wheels/*.whl   # fla-core (and transformers 5.24 if the image is older)
    python3 -m benchmarks.gpu_check

Checks, each printed as one line and written to benchmarks/RESULTS.md:
0. The suite's ``gpu`` tests (``pytest -m gpu tests``: the GPU kernels against their references), which CI and
   the CPU tiers skip (docs/testing.md).
1. KDA: ``chunk_kda`` on CUDA dispatches to flash-linear-attention's Triton kernel and agrees with the
   project's torch path (MOE_PLUGIN_DISABLE_KERNELS=1) in fp32; forward+backward time of both at T=8192.
2. Sparse attention (DSA) at T=8192, top-k 2048, forward+backward: the op on CUDA (its Triton kernels,
   ``ops/dsa/sparse_triton.py``) against its blocked loop (MOE_PLUGIN_DISABLE_KERNELS=1: time, peak memory,
   rel diff of the output) and against dense causal SDPA.
3. MoE experts: grouped GLU in bf16 against the per-expert reference; achieved TFLOP/s.
4. A training step of a mid-size model built from the ``tiny`` preset, tokens/s.
5. Packed MXFP4 experts (docs/packed-experts.md): the grouped packed product in bf16 against the dense bf16
   experts it dequantises to, forward+backward time of both and the expert memory ratio.
6. Host reads per training step per layer kind on CUDA (issue 24): the ``tiny`` preset through the product's
   ``Trainer`` in this process, counted by ``count_host_reads`` (the code of ``benchmarks/host_reads.py``).
7. A compiled decoder layer on CUDA (issue 24): ``torch.compile`` (inductor) against eager, forward+backward,
   one line per layer kind (the code of ``benchmarks/compile_layer.py``).
Nothing here runs in CI: CI has no GPU.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List

import torch


def _time(fn: Callable[[], object], iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_gpu_tests(lines: List[str]) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
    )
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        print(done.stdout[-6000:], flush=True)
    lines.append(f"gpu tests (pytest -m gpu): {summary}")


def check_kda(lines: List[str]) -> None:
    from moe_plugin.ops import backend
    from moe_plugin.ops.kda import chunk_kda, kda_gate_k3, l2norm

    B, T, H, K = 1, 8192, 16, 128
    dev = "cuda"
    q, k = (l2norm(torch.randn(B, T, H, K, device=dev)) for _ in range(2))
    v = torch.randn(B, T, H, K, device=dev)
    g = kda_gate_k3(torch.randn(B, T, H, K, device=dev), torch.zeros(H, device=dev), torch.zeros(H * K, device=dev))
    beta = torch.rand(B, T, H, device=dev)
    fla = backend.gpu_kernel("fla.ops.kda", "chunk_kda", q)
    if fla is None:
        lines.append("kda: flash-linear-attention is not importable here; torch path only")
    short = [x[:, :2048].contiguous() for x in (q, k, v, g, beta)]
    o_kernel, _ = chunk_kda(*short)
    os.environ["MOE_PLUGIN_DISABLE_KERNELS"] = "1"
    o_torch, _ = chunk_kda(*short)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]

    def step():
        o, _ = chunk_kda(*inputs)
        o.sum().backward()

    t_torch = _time(step, 3)
    os.environ.pop("MOE_PLUGIN_DISABLE_KERNELS")
    t_kernel = _time(step, 3)
    lines.append(
        f"kda fp32 B={B} T={T} H={H} K=V={K}: kernel {'fla' if fla else 'none'} vs torch path "
        f"rel diff {_rel(o_kernel, o_torch):.2e}; fwd+bwd {t_kernel * 1e3:.1f} ms vs "
        f"{t_torch * 1e3:.1f} ms ({t_torch / t_kernel:.1f}x)"
    )


def check_sparse_attention(lines: List[str]) -> None:
    import torch.nn.functional as F

    from moe_plugin.ops import backend
    from moe_plugin.ops.dsa import indexer_topk, sparse_attention, sparse_op

    B, T, H, D, Hi, Di, topk = 1, 8192, 16, 128, 8, 64, 2048
    q, k, v = (torch.randn(B, T, H, D, device="cuda", requires_grad=True) for _ in range(3))
    qi, ki, w = (
        torch.randn(B, T, Hi, Di, device="cuda"),
        torch.randn(B, T, Di, device="cuda"),
        torch.rand(B, T, Hi, device="cuda"),
    )
    idx = indexer_topk(qi, ki, w, topk)

    def sparse():
        sparse_attention(q, k, v, idx, D**-0.5).sum().backward()

    def dense():
        F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).sum().backward()

    def peak_gib(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    kernel = backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton", q)
    with torch.no_grad():
        out_kernel = sparse_attention(q, k, v, idx, D**-0.5)
    t_sparse, m_sparse, t_dense = _time(sparse, 3), peak_gib(sparse), _time(dense, 3)
    os.environ["MOE_PLUGIN_DISABLE_KERNELS"] = "1"  # the blocked loop (the CPU path) on the same tensors
    try:
        with torch.no_grad():
            out_blocked = sparse_attention(q, k, v, idx, D**-0.5)
        t_blocked, m_blocked = _time(sparse, 3), peak_gib(sparse)
    finally:
        os.environ.pop("MOE_PLUGIN_DISABLE_KERNELS")
    lines.append(
        f"dsa sparse attention fp32 T={T} H={H} D={D} top-k {topk}: fwd+bwd {'triton' if kernel else 'no kernel'} "
        f"{t_sparse * 1e3:.1f} ms, peak +{m_sparse:.2f} GiB vs blocked loop {t_blocked * 1e3:.1f} ms, peak "
        f"+{m_blocked:.2f} GiB ({t_blocked / t_sparse:.2f}x; out rel diff {_rel(out_kernel, out_blocked):.2e}); "
        f"dense causal SDPA {t_dense * 1e3:.1f} ms ({t_dense / t_sparse:.2f}x)"
    )


def check_moe(lines: List[str]) -> None:
    from moe_plugin.ops.moe import grouped_glu, grouped_glu_reference

    E, N, Din, F_ = 64, 16384, 1024, 512
    counts = torch.distributions.Multinomial(N, torch.ones(E)).sample().long().cuda()
    x = torch.randn(N, Din, device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(E, F_, Din, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w2 = torch.randn(E, Din, F_, device="cuda", dtype=torch.bfloat16) * 0.02
    ours = grouped_glu(x, counts, w1, w3, w2, "swiglu")
    ref = grouped_glu_reference(x.float(), counts, w1.float(), w3.float(), w2.float(), "swiglu")
    seconds = _time(lambda: grouped_glu(x, counts, w1, w3, w2, "swiglu"), 10)
    tflops = 2 * N * 3 * Din * F_ / seconds / 1e12
    lines.append(
        f"moe grouped GLU bf16 E={E} tokens={N} {Din}->{F_}: rel diff vs fp32 reference "
        f"{_rel(ours, ref):.2e}; forward {seconds * 1e3:.2f} ms, {tflops:.0f} TFLOP/s"
    )


def check_moe_overlap(lines: List[str]) -> None:
    """The expert-parallel dispatch in 1, 2, 4 chunks over NCCL (its all-to-alls run on NCCL's own stream, beside
    the compute stream). With one GPU the group is that one rank (NCCL takes no two ranks on a device): the
    exchange is a device copy, and a handle's wait is a stream wait, so the host-blocked time is ~0 and the step
    times are what to compare."""
    from benchmarks.moe_overlap import SHAPE, run

    world = min(torch.cuda.device_count(), 2)
    shape = dict(SHAPE, tokens=16384, hidden=2048, latent=1024, width=1024, shared_width=2048)
    got = run(shape, iters=5, device="cuda", world=world)
    lines.append(f"moe overlap, NCCL, EP {world}: " + "; ".join(got[2:]))


def check_training_step(lines: List[str]) -> None:
    from moe_plugin import MoEPluginForCausalLM, preset_config
    from moe_plugin.lora import add_lora, lora_config

    cfg = preset_config(
        "tiny",
        hidden_size=1024,
        linear_attn_config=dict(num_heads=8, head_dim=128),
        num_attention_heads=8,
        num_experts=64,
        num_experts_per_token=8,
        moe_intermediate_size=512,
        routed_expert_hidden_size=512,
        intermediate_size=4096,
        vocab_size=32768,
        index_topk=1024,
        vision_config=None,
        image_token_id=None,
    )
    model = add_lora(MoEPluginForCausalLM(cfg), lora_config(), wrap=True).cuda()
    ids = torch.randint(0, 32768, (1, 8192), device="cuda")
    cu = torch.tensor([0, 2048, 4096, 8192], device="cuda")

    def step():
        model(input_ids=ids, labels=ids, cu_seqlens=cu).loss.backward()

    seconds = _time(step, 3)
    lines.append(
        f"training step (LoRA, fp32, hidden 1024, 64 experts top-8, 8192 tokens): {seconds * 1e3:.0f} ms, "
        f"{8192 / seconds:,.0f} tokens/s"
    )


def check_packed_experts(lines: List[str]) -> None:
    from moe_plugin.ops.quant import decode, encode, packed_grouped_linear

    E, N, Din, F_ = 64, 16384, 1024, 512
    counts = torch.distributions.Multinomial(N, torch.ones(E)).sample().long()
    packed, scale = (t.cuda() for t in encode("mxfp4", torch.randn(E, F_, Din) * 0.02))
    dense = decode("mxfp4", packed, scale, Din, torch.bfloat16)
    x = torch.randn(N, Din, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    ours = packed_grouped_linear(x, counts, packed, scale, "mxfp4", Din)
    ref = torch._grouped_mm(x, dense.transpose(1, 2), offs=offs)
    t_packed = _time(lambda: packed_grouped_linear(x, counts, packed, scale, "mxfp4", Din).sum().backward(), 10)
    t_dense = _time(lambda: torch._grouped_mm(x, dense.transpose(1, 2), offs=offs).sum().backward(), 10)
    ratio = (packed.numel() + scale.numel()) / (dense.numel() * 2)
    lines.append(
        f"packed MXFP4 experts E={E} tokens={N} {Din}->{F_}: rel diff vs dense bf16 {_rel(ours, ref):.2e}; "
        f"fwd+bwd {t_packed * 1e3:.2f} ms vs {t_dense * 1e3:.2f} ms ({t_packed / t_dense:.2f}x), "
        f"expert memory {ratio:.3f} of bf16"
    )


def check_host_reads(lines: List[str]) -> None:
    import tempfile

    from benchmarks.host_reads import SEQ, _line, recipe, worker

    steps = 2
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        result = worker(recipe(tmp, 1, 1, steps + 1), steps)  # one warm-up step, then `steps` counted
    torch.set_num_threads(threads)  # the worker pins one CPU thread
    sites = sorted(result["sites"].items(), key=lambda kv: -kv[1])[:3]
    top = "; ".join(f"{n:g} {site}" for site, n in sites)
    lines.append(
        _line(f"host reads on CUDA, tiny preset, Trainer 1 process, LoRA r=8, 2 x {SEQ} tokens", result["per_kind"])
        + (f"; top sites: {top}" if top else "")
    )


def check_compiled_layer(lines: List[str]) -> None:
    from benchmarks.compile_layer import layer_lines

    found = layer_lines("cuda", T=1024, iters=10)
    for line in found[:-1]:  # main prints the last line of each check
        print(line, flush=True)
    lines.extend(found)


def main() -> List[str]:
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; run it on the lent GPU machine")
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    checks = (
        check_gpu_tests,
        check_kda,
        check_sparse_attention,
        check_moe,
        check_moe_overlap,
        check_training_step,
        check_packed_experts,
        check_host_reads,
        check_compiled_layer,
    )
    for check in checks:
        try:
            check(lines)
        except Exception as err:  # one failed check must not hide the others' numbers
            lines.append(f"{check.__name__}: FAILED {type(err).__name__}: {err}")
        print(lines[-1], flush=True)
    from benchmarks.harness import write_results

    write_results("GPU (benchmarks/gpu_check.py)", lines)
    return lines


if __name__ == "__main__":
    main()
