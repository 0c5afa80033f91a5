"""A compiled decoder layer against eager (issue 24): forward+backward of one ``tiny``-preset layer of each kind.

    python -m benchmarks.compile_layer            # T 1024 on the CPU, inductor (a few minutes here)
    python -m benchmarks.compile_layer --T 512 --iters 3

One decoder layer of each kind the preset has (KDA attention + MoE, gated MLA with its DSA indexer + MoE) is
called as ``MoEPluginModel.forward`` calls it: the AttnRes state of that layer's depth (stand-ins derived from
the input ``x [1, T, hidden]``, fp32, requires_grad), no ``cu_seqlens`` (one document), the indexer loss on
(as in training); the loss is the sum of the state after the layer plus the indexer loss. Timed: eager
against ``torch.compile(layer)`` (default inductor backend), forward+backward, after warm-up, interleaved so
that a shared machine's load hits both; the first compiled call (compile of forward and backward) is reported
on its own. Graph breaks come from ``torch._dynamo.explain`` (forward; the first 3 distinct reasons). A compile
failure is printed (its first line) instead of a ratio. ``benchmarks.gpu_check`` runs the same code on CUDA
(``layer_lines("cuda")``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from benchmarks.harness import machine_line


class LayerCall(nn.Module):
    """``layer`` called with ``x`` as the model calls it at its depth: x -> scalar loss."""

    def __init__(self, layer: nn.Module, attn_res: bool, block_size: int):
        super().__init__()
        from moe_plugin.layers.attn_res import has_partial

        self.layer = layer
        i = layer.layer_idx
        # AttnRes: the embedding, every completed block's value, then the partial sum if a block is open
        self.n_state = 1 + i // block_size + int(has_partial(i, block_size)) if attn_res else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = tuple(x * (1.0 + 0.25 * k) for k in range(self.n_state))
        out, _load, index_loss = self.layer(state, return_indexer_loss=True)
        loss = sum(o.float().sum() for o in out)
        return loss if index_loss is None else loss + index_loss


def tiny_layers(device: str = "cpu") -> List[Tuple[str, LayerCall]]:
    """(label, LayerCall) for the first MoE layer of each attention kind in the ``tiny`` preset's model."""
    from moe_plugin import MoEPluginForCausalLM, preset_config

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny"))
    mc = model.model.model_config
    picked: Dict[str, LayerCall] = {}
    for layer in model.model.layers:
        kind = ("kda" if layer.attention_type == "kda" else "mla/dsa") + ("+moe" if layer.is_moe else "+mlp")
        if layer.is_moe and kind not in picked:
            picked[kind] = LayerCall(layer, mc.attn_res, mc.attn_res_block_size).to(device).train()
    return list(picked.items())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(fn: Callable, module: nn.Module, x: torch.Tensor, device: str) -> float:
    """One forward+backward of ``fn(x)`` in seconds (gradients cleared before, outside the time)."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    _sync(device)
    start = time.perf_counter()
    fn(x).backward()
    _sync(device)
    return time.perf_counter() - start


def _short(text: str, n: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def graph_breaks(module: nn.Module, x: torch.Tensor) -> Tuple[int, List[str]]:
    """(break count, the first 3 distinct reasons shortened: ``N x reason @ file:line``, forward only)."""
    torch._dynamo.reset()
    out = torch._dynamo.explain(module)(x)
    seen: Dict[str, int] = {}
    for r in out.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f" @ {frame.filename.split('/moe_plugin/')[-1]}:{frame.lineno}" if frame is not None else ""
        reason = (r.reason or "?").splitlines()[0].replace("Consider annotating your code using torch._check*(). ", "")
        key = _short(reason, 64) + where
        seen[key] = seen.get(key, 0) + 1
    torch._dynamo.reset()
    return out.graph_break_count, [f"{n}x {key}" for key, n in list(seen.items())[:3]]


def measure(module: nn.Module, T: int, iters: int, device: str) -> Dict:
    """Eager and compiled forward+backward medians, compile time and graph breaks (or the compile error)."""
    x = torch.randn(1, T, module.layer.input_layernorm.weight.shape[0], device=device, requires_grad=True)
    result: Dict = {}
    try:
        result["breaks"] = graph_breaks(module, x)
    except Exception as err:  # explain itself failing is a result too
        result["breaks_error"] = f"{type(err).__name__}: {_short(str(err).splitlines()[0] if str(err) else '')}"
    torch._dynamo.reset()
    compiled = torch.compile(module)
    eager_times, compiled_times = [], []
    for _ in range(2):
        _step(module, module, x, device)  # eager warm-up
    try:
        result["compile_s"] = _step(compiled, module, x, device)
        for _ in range(2):  # warm-up: a recompile (automatic dynamic shapes) shows here, not in the timing
            _step(compiled, module, x, device)
    except Exception as err:  # a failed compile is an honest result
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result["error"] = f"{type(err).__name__}: {_short(first, 160)}"
    for _ in range(iters):  # interleaved
        eager_times.append(_step(module, module, x, device))
        if "error" not in result:
            compiled_times.append(_step(compiled, module, x, device))
    result["eager_s"] = statistics.median(eager_times)
    if compiled_times:
        result["compiled_s"] = statistics.median(compiled_times)
    torch._dynamo.reset()
    return result


def format_line(kind: str, T: int, device: str, r: Dict) -> str:
    backend = "CPU inductor" if device == "cpu" else f"{device.upper()} inductor"
    head = f"compiled decoder layer ({kind}), tiny preset, T {T}, {backend}: eager {r['eager_s']:.3f} s, "
    if "error" in r:
        body = f"compile FAILED {r['error']}"
    else:
        ratio = r["eager_s"] / r["compiled_s"]
        body = f"compiled {r['compiled_s']:.3f} s, {ratio:.2f}x; compile {r['compile_s']:.1f} s"
    if "breaks" in r:
        n, reasons = r["breaks"]
        tail = f"; graph breaks {n}" + (f" ({'; '.join(reasons)})" if reasons else "")
    else:
        tail = f"; graph breaks unknown (explain failed: {r.get('breaks_error')})"
    return head + body + tail


def layer_lines(device: str = "cpu", T: int = 1024, iters: int = 5, echo: bool = False) -> List[str]:
    """One line per layer kind (``format_line``)."""
    torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)  # else a warning per graph break
    warnings.filterwarnings("ignore", category=FutureWarning)
    lines = []
    for kind, module in tiny_layers(device):
        lines.append(format_line(kind, T, device, measure(module, T, iters, device)))
        if echo:
            print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=1024, help="tokens (default 1024)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps of each, interleaved (default 5)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads), flush=True)
    layer_lines("cpu", args.T, args.iters, echo=True)


if __name__ == "__main__":
    main()
