"""The meters the activation plan reads its layers with on ``meta``: the storages autograd saves, per tagged
module (``_SavedBytes``), and the storages the ops make that are still alive, and their peak (``_LiveBytes``,
a dispatch mode); ``_run`` runs a function under both (docs/planner.md, "Activations")."""

from __future__ import annotations

import collections
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..compat.torch import makes_fresh_tensors


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages the ops make that are still alive, and their peak. A storage is alive while a
    tensor on it is (each output's weakref finalizer drops one reference); parameters and inputs made before
    are not counted."""

    def __init__(self):
        super().__init__()
        self.refs: Dict[int, int] = collections.Counter()
        self.size: Dict[int, int] = {}
        self.made: set = set()  # every storage made during the run (a saved one is counted by _SavedBytes)
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _meta_results(func, args, kwargs or {})
        # a view of a storage made before the run (a parameter's slice, an input's reshape) allocates nothing:
        # on meta a layer holds all E experts, and a rank's E / EP slice would count the whole stack
        before = {_key(a) for a in _tensors((args, kwargs)) if not self.refs[_key(a)]}
        for t in _tensors(out):
            key = _key(t)
            if key in before:
                continue
            if not self.refs[key]:
                self.size[key] = t.untyped_storage().nbytes()
                self.live += self.size[key]
                self.peak = max(self.peak, self.live)
                self.made.add(key)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)
            del self.refs[key]


class _SavedBytes:
    """Counts the storages autograd saves, attributed to the innermost tagged module running."""

    def __init__(self, modules: Dict[nn.Module, str], default: str):
        self.stack: List[str] = [default]
        self.out: Dict[str, int] = collections.Counter()
        self.seen, self.own = set(), set()
        self.keep: List[torch.Tensor] = []  # a freed storage's key could be reused by a later one: hold them
        self.handles = []
        for module, segment in modules.items():
            self.own.update(_key(t) for t in list(module.parameters()) + list(module.buffers()))
            self.handles.append(module.register_forward_pre_hook(lambda *_, s=segment: self.stack.append(s)))
            self.handles.append(module.register_forward_hook(lambda *_: (self.stack.pop(), None)[1]))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self.own and key not in self.seen:
            self.seen.add(key)
            self.keep.append(t)
            self.out[self.stack[-1]] += t.untyped_storage().nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# (op, its arguments' shapes) -> its results' (shape, stride, dtype): an attention's or a scan's blocks repeat the
# same few ops on the same shapes thousands of times, and a meta kernel written in Python costs far more than the
# empty tensors it returns (it set the seed plan's CPU time)
_META_RESULTS: Dict[tuple, Optional[Tuple[bool, Tuple[Tuple[tuple, tuple, torch.dtype], ...]]]] = {}
_META_RESULTS_MOST = 1 << 16


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Uncacheable(Exception):
    pass


def _shapes_key(obj):
    if isinstance(obj, torch.Tensor):
        if not obj.is_meta:
            raise _Uncacheable
        return (obj.shape, obj.stride(), obj.dtype)
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_shapes_key(o) for o in obj))
    if isinstance(obj, dict):
        return tuple((k, _shapes_key(v)) for k, v in obj.items())
    if obj is None or isinstance(obj, _PLAIN):
        return (type(obj), obj)
    raise _Uncacheable


def _meta_results(func, args, kwargs):
    """``func(*args, **kwargs)``; on meta, for an op whose results are new tensors of their own
    (``compat.torch.makes_fresh_tensors``), fresh empty tensors of the shapes the op gave the last time it met
    the same arguments' shapes (the same storages' bytes: nothing the meters count changes)."""
    if not makes_fresh_tensors(func):
        return func(*args, **kwargs)
    try:
        key = (func, _shapes_key(args), _shapes_key(kwargs))
    except _Uncacheable:
        return func(*args, **kwargs)
    known = _META_RESULTS.get(key)
    if known is not None:
        several, shapes = known
        made = tuple(torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in shapes)
        return made if several else made[0]
    out = func(*args, **kwargs)
    if key not in _META_RESULTS:
        if len(_META_RESULTS) >= _META_RESULTS_MOST:
            _META_RESULTS.clear()
        _META_RESULTS[key] = _result_shapes(out, args, kwargs)
    return out


def _result_shapes(out, args, kwargs):
    """Whether the op returned a tuple, and its results' (shape, stride, dtype); None where empty tensors of those
    would not stand for them: a result not on meta, on an argument's storage, or on a storage larger than its
    shape and stride need."""
    outs = out if isinstance(out, tuple) else (out,)
    inputs = {_key(a) for a in _tensors((args, kwargs))}
    shapes, storages = [], set()
    for t in outs:
        if not isinstance(t, torch.Tensor) or not t.is_meta or _key(t) in inputs or _key(t) in storages:
            return None
        storages.add(_key(t))
        like = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if like.untyped_storage().nbytes() != t.untyped_storage().nbytes() or t.storage_offset():
            return None
        shapes.append((tuple(t.shape), t.stride(), t.dtype))
    return isinstance(out, tuple), tuple(shapes)


def _tensors(obj):
    """The tensors in an op's arguments or results (nested lists, tuples and dicts: all an op's schema has)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _key(t: torch.Tensor) -> int:
    # a meta storage has no address (data_ptr 0): its StorageImpl tells storages apart, views share it
    return t.untyped_storage()._cdata


def _inputs(shape, count: int, dtype, device: str = "meta") -> Tuple[torch.Tensor, ...]:
    return tuple(torch.randn(shape, dtype=dtype, device=device).requires_grad_() for _ in range(count))


def _run(
    fn,
    modules: Dict[nn.Module, str],
    default: str,
    working: Optional[list] = None,
    exclude: Sequence[torch.Tensor] = (),
) -> Dict[str, int]:
    """Saved bytes of ``fn()`` per segment; ``working`` (a list) gets the most ``fn`` held at once beyond what
    it leaves: the peak of the storages its ops made, less those still alive with its result. Tensors in
    ``exclude`` (the inputs, when the caller counts them itself) are not counted."""
    counter, live = _SavedBytes(modules, default), _LiveBytes()
    counter.own.update(_key(t) for t in exclude)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), live:
            result = fn()
        held = live.live  # with the result and its graph alive: what the run leaves for backward
        del result
    finally:
        counter.close()
    if working is not None:
        working.append(max(0, live.peak - held))
    return dict(counter.out)
