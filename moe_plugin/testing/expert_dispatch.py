"""Test support for the expert-parallel dispatcher (``megatron.expert_dispatch``): what crosses its all-to-alls."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

__all__ = ["dispatched_shapes"]


@contextlib.contextmanager
def dispatched_shapes() -> Iterator[List[Tuple[int, ...]]]:
    """The shapes of what each forward dispatch all-to-all sends (the tokens' trip to the experts: not the
    combine, not a gradient), in order, while the block is open."""
    from ..megatron import expert_dispatch

    shapes, original = [], expert_dispatch._all_to_all

    def spy(x, out_splits, in_splits, group, owner, what):
        if what.endswith(" dispatch"):
            shapes.append(tuple(x.shape))
        return original(x, out_splits, in_splits, group, owner, what)

    expert_dispatch._all_to_all = spy
    try:
        yield shapes
    finally:
        expert_dispatch._all_to_all = original


# ---- the overlap's parity check, run by the ranks of an existing multi-process launch ----

PARITY_MOE = dict(
    hidden_size=32,
    num_experts=16,
    top_k=4,
    expert_intermediate_size=16,
    latent_size=16,
    num_shared_experts=1,
    shared_intermediate_size=24,
)


def _expert_parallel_copy(layer, group, chunks: int, dispatch_class=None):
    """A copy of the single-device ``layer`` holding this rank's experts of ``group`` (``ParallelLayout``'s rule)
    and dispatching over it in ``chunks`` chunks."""
    import copy

    import torch
    import torch.distributed as dist

    from ..layers.stacked_experts import StackedExperts
    from ..megatron.expert_dispatch import ExpertParallelDispatch
    from ..parallel.layout import experts_held

    c = layer.moe_config
    first, last = experts_held(c.num_experts, dist.get_world_size(group), dist.get_rank(group))
    ep_layer = copy.deepcopy(layer)
    experts = StackedExperts(
        last - first,
        c.expert_dim,
        c.expert_intermediate_size,
        c.activation,
        c.situ_beta,
        c.situ_linear_beta,
        first_expert=first,
    )
    with torch.no_grad():
        for w in ("w1", "w2", "w3"):
            getattr(experts, w).copy_(getattr(layer.experts, w)[first:last])
    ep_layer.experts = experts
    ep_layer.dispatch = (dispatch_class or ExpertParallelDispatch)(group, chunks)
    return ep_layer


def _step(layer, x, grad, padding_mask, mode: str):
    """Forward and backward of ``layer`` under recompute ``mode``: y, x's gradient, every parameter's gradient."""
    import torch

    layer.recompute_mode = mode
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y, _ = layer(x, padding_mask)
    (y * grad).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in layer.named_parameters()}
    return {"y": y.detach(), "x_grad": x.grad, **{f"grad:{n}": g for n, g in grads.items()}}


MODES = ("off", "full", "full_routing")  # the recompute modes the parity check runs


def _host_reads_of(layer, x, grad, padding_mask, mode: str) -> dict:
    from ..training.metrics.host_reads import count_host_reads

    with count_host_reads(layer) as reads:
        _step(layer, x, grad, padding_mask, mode)
    return {f"{kind}/{what}": n for (kind, what), n in reads.detail().items()}


def _bitwise(a: dict, b: dict) -> list:
    """The keys whose tensors differ in any bit (shape, dtype or value)."""
    import torch

    return [k for k in a if not (a[k].shape == b[k].shape and torch.equal(a[k], b[k]))]


def overlap_parity(seed: int = 0, chunk_counts=(1, 2, 4), group=None) -> dict:
    """On every rank of ``group`` (default: the whole world, so EP = world size): one ``StableLatentMoE`` whose
    experts are spread over the group, forward and backward at each of ``chunk_counts`` under recompute "off"
    "full" and "full_routing" (``MODES``), compared bit for bit with ``chunks`` 1 and with "off"; and the planted
    bugs. Returns (all plain data):

    ``differs``: ``{"<mode>/<N>": [keys that differ from N = 1 of that mode]}`` and ``"<mode>_vs_off"``;
    ``full_routing_host_reads``: the host reads of one "full_routing" forward and backward (``{"moe/tolist": 1}``);
    ``one_device_err``: the largest relative error of N = max against the single-device layer on this rank's
    tokens (the experts' gradients summed over ranks are not compared: they see every rank's tokens);
    ``wrong_order``: keys that differ when the chunks are combined in reverse order (must be non-empty);
    ``reused_buffer``: the error raised when a receive buffer is reused while in flight (must say so);
    ``waited``: seconds this rank was blocked on the all-to-alls at N = 1 and at N = max."""
    import torch
    import torch.distributed as dist

    from ..config import MoEConfig
    from ..layers.moe import StableLatentMoE
    from ..megatron import expert_dispatch

    group = group or dist.group.WORLD
    torch.manual_seed(seed)
    layer = StableLatentMoE(MoEConfig(**PARITY_MOE))  # the same global weights on every rank
    g = torch.Generator().manual_seed(1000 * (seed + 1) + dist.get_rank(group))
    x = torch.randn(2, 12, PARITY_MOE["hidden_size"], generator=g)
    grad = torch.randn(x.shape, generator=g)
    padding_mask = torch.zeros(2, 12, dtype=torch.bool)
    padding_mask[1, -3:] = True  # routed and sent like any token, not counted in the load
    out, differs, waited = {}, {}, {}
    for mode in MODES:
        for n in chunk_counts:
            ep_layer = _expert_parallel_copy(layer, group, n)
            out[(mode, n)] = _step(ep_layer, x, grad, padding_mask, mode)
            waited[f"{mode}/{n}"] = ep_layer.dispatch.pop_waited()
            differs[f"{mode}/{n}"] = _bitwise(out[(mode, n)], out[(mode, chunk_counts[0])])
    for mode in MODES[1:]:
        differs[f"{mode}_vs_off"] = _bitwise(out[(mode, chunk_counts[0])], out[("off", chunk_counts[0])])
    # "full_routing" reruns the dispatch in the backward with the forward's exchange plan: no count is exchanged
    # and nothing is read from the host again (one tolist in the forward)
    top = max(chunk_counts)
    reads = _host_reads_of(_expert_parallel_copy(layer, group, top), x, grad, padding_mask, "full_routing")
    ref = _step(layer, x, grad, padding_mask, "off")
    err = 0.0
    for key in ("y", "x_grad"):
        a, b = out[("off", top)][key].double(), ref[key].double()
        err = max(err, float((a - b).norm() / b.norm()))

    class ReversedChunks(expert_dispatch.ExpertParallelDispatch):
        def concat(self, returned):  # planted bug: the chunks combined in the wrong order
            return super().concat(returned[::-1])

    wrong = _step(_expert_parallel_copy(layer, group, top, ReversedChunks), x, grad, padding_mask, "off")
    original = expert_dispatch._all_to_all

    def reuse_too_early(x, out_splits, in_splits, group, owner, what):
        pending = original(x, out_splits, in_splits, group, owner, what)
        if what == "chunk 0 dispatch":
            with torch.no_grad():
                pending.buffer.zero_()  # planted bug: the receive buffer reused while its all-to-all is in flight
        return pending

    expert_dispatch._all_to_all = reuse_too_early
    try:
        _step(_expert_parallel_copy(layer, group, top), x, grad, padding_mask, "off")
        reused = ""
    except RuntimeError as err_reused:
        reused = str(err_reused)
    finally:
        expert_dispatch._all_to_all = original
    dist.barrier(group)  # the planted failure left the other ranks' all-to-alls finished or abandoned alike
    return {
        "ep": dist.get_world_size(group),
        "differs": differs,
        "one_device_err": err,
        "wrong_order": _bitwise(wrong, out[("off", top)]),
        "reused_buffer": reused,
        "waited": waited,
        "full_routing_host_reads": reads,
    }


def overlap_failures(ranks: list, chunk_counts=(1, 2, 4)) -> list:
    """What is wrong in every rank's ``overlap_parity`` result (empty: the overlap is bitwise the sequential
    schedule, equals one device, and both planted bugs are caught)."""
    failures = []
    for rank, got in enumerate(ranks):
        for case, keys in got["differs"].items():
            if keys:
                failures.append(f"rank {rank} {case}: differs from chunks {chunk_counts[0]} in {keys}")
        missing = {f"{m}/{n}" for m in MODES for n in chunk_counts} - set(got["differs"])
        if missing:
            failures.append(f"rank {rank}: cases not run: {sorted(missing)}")
        if not got["one_device_err"] < 1e-5:
            failures.append(f"rank {rank}: rel err {got['one_device_err']:.2e} against the single-device layer")
        if "y" not in got["wrong_order"]:
            failures.append(f"rank {rank}: chunks combined in reverse order went unnoticed")
        if got["full_routing_host_reads"] != {"moe/tolist": 1}:
            failures.append(f"rank {rank}: full_routing read the host {got['full_routing_host_reads']}, not once")
        if "in flight" not in got["reused_buffer"]:
            failures.append(f"rank {rank}: a receive buffer reused in flight was not refused: {got['reused_buffer']!r}")
    return failures
