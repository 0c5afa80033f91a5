"""A debug mode that counts host reads (device-to-host waits) and reports them per layer kind.

On a GPU every read of a tensor's value on the host stalls the stream until the device catches up, so the
hot path of a training step should do none (issue 24's goal: none in KDA, MLA, DSA, norms, AttnRes; at most
one per MoE layer under expert parallelism). ``count_host_reads(model)`` counts them while it is open::

    with count_host_reads(model) as counts:
        model(input_ids=ids, labels=ids).loss.backward()
    counts.per_kind()  # {"kda": 0, "mla": 0, ..., "trainer": 2}

What counts (one per call), seen through a ``torch.overrides.TorchFunctionMode``:
- value reads: ``Tensor.item``, ``tolist``, ``__bool__`` (``if t:``, ``assert t``), ``__int__``,
  ``__float__``, ``__index__`` (a tensor used as a Python int, e.g. ``range(t)``), ``cpu`` and ``numpy``;
- data-dependent shapes, whose output size the host must learn before it can allocate: ``nonzero``,
  ``argwhere``, ``unique``, ``unique_consecutive``, ``masked_select``, ``bincount`` (it reads the maximum
  even with ``minlength``), ``repeat_interleave`` with a tensor ``repeats`` and no ``output_size``, and
  indexing (``__getitem__``) with a boolean tensor.

Calls are counted on any device (on the CPU they cost nothing, but the same call waits on a GPU), so a CPU run
shows what a GPU run would wait on. Not seen: reads inside C++ kernels and autograd's C++ backward, ``.to``
with a host device (ambiguous from the arguments; the project moves with ``cpu()``), and collectives (they
wait in the process group, not through a tensor read). Seen: the Python kernels of the project's custom ops
(``moe_plugin::*``, e.g. sparse attention's), which the mode re-enters (``compat.torch.call_op_in_mode``).

Each read goes to the innermost enclosing module of a known kind (its forward, entered by forward pre-hooks
and left by forward hooks, so reads in other forward hooks of the layer, such as the MoE metrics, count for
it): ``kda`` (KDAAttention), ``mla`` (GatedMLAAttention), ``dsa`` (its LightningIndexer), ``moe``
(StableLatentMoE and anything with the latent-MoE mixin, e.g. megatron's LatentMoELayer; its router and
experts), ``norm`` (RMSNorm), ``attn_res`` (AttnResProjection and the RMSNorms of the AttnRes mixing points,
named ``*res_norm``), ``mlp`` (a dense GLUMLP outside an MoE), ``other`` (module code outside those kinds:
the decoder layer's own code, embeddings, loss) and ``trainer`` (outside any module's forward: backward,
the optimizer, the loop). The megatron face's layers subclass these classes, so they are counted alike.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_plugin.compat.torch import call_op_in_mode, custom_op_namespace

KINDS: Tuple[str, ...] = ("kda", "mla", "dsa", "moe", "norm", "attn_res", "mlp", "other", "trainer")

_T = torch.Tensor
_VALUE_READS = {
    _T.item: "item",
    _T.tolist: "tolist",
    _T.__bool__: "__bool__",
    _T.__int__: "__int__",
    _T.__float__: "__float__",
    _T.__index__: "__index__",
    _T.cpu: "cpu",
    _T.numpy: "numpy",
}
_SHAPE_READS = {
    torch.nonzero: "nonzero",
    _T.nonzero: "nonzero",
    torch.argwhere: "argwhere",
    _T.argwhere: "argwhere",
    torch.unique: "unique",
    _T.unique: "unique",
    torch.unique_consecutive: "unique_consecutive",
    _T.unique_consecutive: "unique_consecutive",
    torch.masked_select: "masked_select",
    _T.masked_select: "masked_select",
    torch.bincount: "bincount",
    _T.bincount: "bincount",
}
_REPEAT_INTERLEAVE = (torch.repeat_interleave, _T.repeat_interleave)


def _bool_index(index) -> bool:
    """Whether a ``__getitem__`` index holds a boolean tensor (a mask, whose selected count sets the shape)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)


def _read_name(func, args, kwargs):
    """The counted name of a call, or None when it reads nothing on the host."""
    name = _VALUE_READS.get(func) or _SHAPE_READS.get(func)
    if name is not None:
        return name
    if func in _REPEAT_INTERLEAVE:
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        if func is torch.repeat_interleave and len(args) == 1 and "repeats" not in kwargs:
            repeats = args[0]  # torch.repeat_interleave(repeats): the repeats are the input
        if torch.is_tensor(repeats) and kwargs.get("output_size") is None:
            return "repeat_interleave"
        return None
    if func is _T.__getitem__ and len(args) > 1 and _bool_index(args[1]):
        return "bool_index"
    return None


def _site() -> str:
    """``path:line`` of the innermost caller outside torch (moe_plugin's path from the package, another
    package's from its own name, e.g. ``deepspeed/...``), to find a read."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("host_reads.py"):
            for marker in ("/moe_plugin/", "/site-packages/"):
                if marker in path:
                    path = path.split(marker)[-1]
                    break
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def module_kind(name: str, module: nn.Module, inside_moe: bool = False):
    """The kind of one module (see the module docstring), or None for a container that adds no kind of its own
    (its reads go to the enclosing kind, or ``other``)."""
    from moe_plugin.layers.attn_res import AttnResProjection
    from moe_plugin.layers.gated_dsa import GatedMLAAttention, LightningIndexer
    from moe_plugin.layers.kda import KDAAttention
    from moe_plugin.layers.mlp import GLUMLP
    from moe_plugin.layers.moe import LatentMoEMixin
    from moe_plugin.layers.norm import RMSNorm

    if isinstance(module, KDAAttention):
        return "kda"
    if isinstance(module, LightningIndexer):
        return "dsa"
    if isinstance(module, GatedMLAAttention):
        return "mla"
    if isinstance(module, LatentMoEMixin):
        return "moe"
    if isinstance(module, AttnResProjection) or (isinstance(module, RMSNorm) and name.endswith("res_norm")):
        return "attn_res"
    if isinstance(module, RMSNorm):
        return "norm"
    if isinstance(module, GLUMLP) and not inside_moe:
        return "mlp"
    return None


class HostReadCounts:
    """The reads seen: ``per_kind()`` totals per kind, ``detail()`` per ``(kind, call)``."""

    def __init__(self):
        self.by_call: Counter = Counter()
        self.by_site: Counter = Counter()  # (kind, call, "file:line" of the innermost moe_plugin frame)

    def add(self, kind: str, call: str) -> None:
        self.by_call[(kind, call)] += 1
        self.by_site[(kind, call, _site())] += 1

    def per_kind(self) -> Dict[str, int]:
        """Every kind of ``KINDS`` -> its count (0 included, so a report shows the zeros)."""
        out = dict.fromkeys(KINDS, 0)
        for (kind, _), n in self.by_call.items():
            out[kind] += n
        return out

    def detail(self) -> Dict[Tuple[str, str], int]:
        return dict(sorted(self.by_call.items()))

    def total(self) -> int:
        return sum(self.by_call.values())


class _CountingMode(TorchFunctionMode):
    def __init__(self, counts: HostReadCounts, stack: List[str]):
        super().__init__()
        self.counts, self.stack = counts, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _read_name(func, args, kwargs)
        if name is not None:
            self.counts.add(self.stack[-1], name)
        # the Python kernels of the project's ops count too (compat.torch); dynamo, tracing this mode around a
        # compiled function, takes the op as it is
        if custom_op_namespace(func) == "moe_plugin" and not torch.compiler.is_compiling():
            return call_op_in_mode(self, func, args, kwargs)
        return func(*args, **kwargs)


def _kinds_of(model: nn.Module) -> Dict[int, str]:
    """id(module) -> kind for every module of ``model``; modules under an MoE layer count as ``moe``, and the
    rest without a kind as ``other``."""
    kinds: Dict[int, str] = {}
    moe_prefixes: List[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(p + ".") for p in moe_prefixes)
        kind = "moe" if inside else module_kind(name, module)
        if kind == "moe" and not inside:
            moe_prefixes.append(name)
        kinds[id(module)] = kind or "other"
    return kinds


@contextlib.contextmanager
def count_host_reads(model: nn.Module) -> Iterator[HostReadCounts]:
    """Count the host reads made while the block runs, attributed to ``model``'s layer kinds (module
    docstring); the hooks and the mode are removed on exit. Debug only: every torch call pays a Python check."""
    counts, stack = HostReadCounts(), ["trainer"]
    kinds = _kinds_of(model)
    handles = []

    def enter(module, *_):
        kind = kinds[id(module)]
        # a container without a kind of its own ("other") keeps an enclosing known kind
        stack.append(stack[-1] if kind == "other" and stack[-1] != "trainer" else kind)

    def leave(module, *_):
        stack.pop()

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with _CountingMode(counts, stack):
            yield counts
    finally:
        for handle in handles:
            handle.remove()
