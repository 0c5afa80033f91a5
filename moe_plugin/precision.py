"""The precision policy: which tensors stay fp32 in a bf16/fp16 model, and how every path keeps them there.

K3 keeps the router (``gate.weight``), its selection bias (``gate.e_score_correction_bias``) and KDA's decay
parameters (``A_log``, ``dt_bias``) in fp32 while the rest of the model runs in bf16: bf16 flips near-tied
expert choices, and small errors in the decay compound over the sequence (docs/architecture.md sections 2.1
and 3). ``FP32_OWNERS`` names them by the layer that owns them, so the rule holds on both faces (Hugging Face
and megatron) and under peft's wrappers; ``FP32_TENSORS`` are the same tensors as name patterns for the
Hugging Face model (transformers' ``_keep_in_fp32_modules_strict``, which DeepSpeed's ``keep_in_fp32_modules``
also reads).

``apply_precision(model, dtype)`` is the one way to set a model's dtype (docs/precision.md):

* every other floating tensor becomes ``dtype``;
* the listed tensors are fp32 with their exact values. One that arrives in a lower precision is upcast; one
  that ``deepspeed.zero.Init`` partitioned in bf16 becomes a whole fp32 buffer. A checkpoint loaded
  afterwards writes exact values into either;
* a listed parameter that does not train becomes a persistent fp32 buffer of the same name. DeepSpeed's
  bf16 engine casts every parameter to bf16 and ZeRO-3 holds a module's trainable partitions in one dtype,
  but both leave buffers as they are, so a frozen fp32 tensor survives ``deepspeed.initialize`` exactly.
  A listed parameter that trains stays a parameter: under a bf16 engine it is stored in bf16 (fp32 master
  weights in the optimizer) and the layers compute with it in fp32.

``model.to(dtype)`` on the Hugging Face model keeps the listed tensors through ``keep_fp32_through``.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .compat import deepspeed as zero3
from .layers.kda import KDAAttention
from .layers.moe import MoERouter

__all__ = [
    "FP32_TENSORS",
    "FP32_OWNERS",
    "LOW_PRECISION",
    "STORED_FP32",
    "stored_fp32_family",
    "stored_fp32_note",
    "fp32_tensors",
    "apply_precision",
    "keep_fp32_through",
]

# (owning layer, its tensors that stay fp32); subclasses (megatron's KDASelfAttention) are included
FP32_OWNERS: Tuple[Tuple[type, Tuple[str, ...]], ...] = (
    (KDAAttention, ("A_log", "dt_bias")),
    (MoERouter, ("weight", "e_score_correction_bias")),
)
# The same tensors by Hugging Face name. transformers 5.24 matches these with re.search on the full tensor
# name, so they are anchored on the module path: a bare "gate" would also catch gate_proj. "base_layer." is
# where the router weight sits once peft wraps "gate".
FP32_TENSORS = (
    r"self_attn\.A_log$",
    r"self_attn\.dt_bias$",
    r"block_sparse_moe\.gate\.(base_layer\.)?weight$",
    r"block_sparse_moe\.gate\.(base_layer\.)?e_score_correction_bias$",
)
LOW_PRECISION = (torch.float16, torch.bfloat16)

# The families K3 stores in fp32 under its bf16 ``dtype`` (docs/k3-formats.md, "Tensors"), by Hugging Face
# name, with the rule the model applies to each on load (docs/precision.md section 1, the table). "keep": the
# model holds the tensor in fp32 (it is in FP32_TENSORS), so the stored values are used exactly. "cast": the
# model holds it in its own dtype, so a bf16 model rounds it once on the copy (the short convolutions and the
# output norm run in the activations' dtype; an fp32 model keeps them exact). The router weight is stored in
# bf16 by the release but kept fp32 by the model, so fp32 is a legal stored dtype for it too. Any other tensor
# stored in a dtype other than the config's is refused by the loader (weights/checks.py).
STORED_FP32: Tuple[Tuple[str, str, str], ...] = (
    (r"self_attn\.A_log$", "A_log", "keep"),
    (r"self_attn\.dt_bias$", "dt_bias", "keep"),
    (r"block_sparse_moe\.gate\.(base_layer\.)?e_score_correction_bias$", "e_score_correction_bias", "keep"),
    (r"block_sparse_moe\.gate\.(base_layer\.)?weight$", "gate.weight", "keep"),
    (r"self_attn\.[qkv]_conv1d\.weight$", "q/k/v_conv1d.weight", "cast"),
    (r"self_attn\.o_norm\.weight$", "o_norm.weight", "cast"),
)


def stored_fp32_family(name: str) -> Optional[Tuple[str, str]]:
    """(family, rule) of a Hugging Face tensor name K3 may store in fp32 under a lower ``dtype`` (``STORED_FP32``:
    rule "keep" or "cast"), or None for a tensor that must be stored in the config's dtype."""
    for pattern, family, rule in STORED_FP32:
        if re.search(pattern, name):
            return family, rule
    return None


def stored_fp32_note(accepted: List[Tuple[str, torch.dtype]], declared: str) -> Optional[str]:
    """The one line saying what became of the tensors stored in fp32 under ``declared`` (the config's dtype):
    ``accepted`` are (Hugging Face name, the model tensor's dtype). Families the model holds in fp32 are
    "kept in float32"; those it holds lower are "cast to" that dtype. None when there are none."""
    if not accepted:
        return None
    kept: Dict[str, int] = {}
    cast: Dict[Tuple[str, str], int] = {}
    for name, model_dtype in accepted:
        family = (stored_fp32_family(name) or (name.rsplit(".", 1)[-1], "keep"))[0]
        if model_dtype == torch.float32:
            kept[family] = kept.get(family, 0) + 1
        else:
            key = (family, str(model_dtype).removeprefix("torch."))
            cast[key] = cast.get(key, 0) + 1
    parts = []
    if kept:
        parts.append("kept in float32: " + ", ".join(f"{f} x{n}" for f, n in kept.items()))
    if cast:
        parts.append("cast to the model's dtype: " + ", ".join(f"{f} x{n} -> {d}" for (f, d), n in cast.items()))
    return (
        f"precision: {len(accepted)} tensor(s) stored in float32 under the checkpoint's dtype {declared}, "
        f"accepted by rule (docs/precision.md): " + "; ".join(parts)
    )


Listed = Tuple[str, nn.Module, str]  # (full name, owning module, attribute name)


def _own_names(module: nn.Module) -> Tuple[str, ...]:
    for owner, names in FP32_OWNERS:
        if isinstance(module, owner):
            return names
    return ()


def fp32_tensors(model: nn.Module) -> List[Listed]:
    """The tensors of ``model`` (parameters or buffers) that the policy keeps fp32, in module order."""
    found = []
    for module_name, module in model.named_modules():
        for name in _own_names(module):
            if module._parameters.get(name) is not None or module._buffers.get(name) is not None:
                found.append((f"{module_name}.{name}" if module_name else name, module, name))
    return found


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]


def _gathered_fp32(param: nn.Parameter) -> torch.Tensor:
    """The whole value of a ZeRO-3 partitioned parameter in fp32 (collective over its partition group; every
    rank applies the policy in the same module order)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.data.detach().float().clone()


def _partition_dtype(model: nn.Module) -> Optional[torch.dtype]:
    for p in model.parameters():
        part = zero3.local_partition(p)
        if part is not None:
            return part.dtype
    return None


def _as_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    del module._parameters[name]
    module.register_buffer(name, value, persistent=True)


@torch.no_grad()
def apply_precision(model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Set ``model``'s precision by the policy (module docstring); returns ``model``.

    dtype: the dtype of every floating parameter and buffer that is not listed (``torch.float32``,
    ``torch.bfloat16`` or ``torch.float16``). None: the dtype the model was built in under
    ``deepspeed.zero.Init`` (its partitions'), for its parameters only (DeepSpeed's engine does not cast a
    model built that way, so adapters added afterwards are brought to it here); a model without partitions
    keeps every dtype and gets only the fp32 rule. ZeRO-3 partitioned tensors that are not listed are left to
    DeepSpeed. A listed tensor partitioned in a lower precision becomes a whole fp32 buffer: ZeRO-3 can neither
    hold an fp32 partition next to bf16 ones nor train it, and the checkpoint loaded afterwards writes its
    exact values there.
    """
    if dtype is not None and dtype not in (torch.float32,) + LOW_PRECISION:
        raise ValueError(f"dtype: must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    listed = fp32_tensors(model)
    ids = {id(_tensor(m, n)) for _, m, n in listed}
    target = dtype if dtype is not None else _partition_dtype(model)
    if target is not None:
        tensors = list(model.parameters()) + (list(model.buffers()) if dtype is not None else [])
        for tensor in tensors:
            if (
                id(tensor) not in ids
                and tensor.is_floating_point()
                and tensor.dtype != target
                and not zero3.is_zero3_param(tensor)
            ):
                tensor.data = tensor.data.to(target)
    for _, module, name in listed:
        tensor = _tensor(module, name)
        if name not in module._parameters:
            if tensor.dtype != torch.float32:
                module._buffers[name] = tensor.float()
        elif zero3.is_zero3_param(tensor):
            if zero3.local_partition(tensor).dtype != torch.float32:
                _as_buffer(module, name, _gathered_fp32(tensor))
        else:
            if tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()
            if not tensor.requires_grad:
                _as_buffer(module, name, tensor.data)
    return model


def keep_fp32_through(model: nn.Module, convert: Callable[[], nn.Module]) -> nn.Module:
    """Run ``convert`` (``nn.Module._apply`` of ``model``: ``.to(dtype)``, ``.half()``, ``to_empty``) and put
    the listed tensors back in fp32 with their exact values, on the device the conversion chose.

    Only conversions that lowered a tensor below fp32 are undone for them (one that kept it fp32 already moved
    it exactly, and copying it again would be a second transfer at every nesting level); a model materialised
    from ``meta`` (``to_empty``) has no values to keep, only the fp32 dtype.
    """
    kept = [
        (module, name, _tensor(module, name).data)
        for _, module, name in fp32_tensors(model)
        if _tensor(module, name).dtype == torch.float32
    ]
    result = convert()
    for module, name, original in kept:
        now = _tensor(module, name)
        if now.dtype not in LOW_PRECISION:
            continue
        restored = now.float() if original.is_meta and not now.is_meta else original.to(now.device)
        if name in module._parameters:
            now.data = restored
        else:
            module._buffers[name] = restored
    return result
