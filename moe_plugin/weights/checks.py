"""What a base checkpoint must satisfy beyond its shapes before a model trains on it: stored dtypes that agree
with its own config, and finite values.

A floating weight stored as integers (or in another float type than the config's ``dtype``/``torch_dtype``)
would be converted on the copy into the model without a word, and one NaN or inf in a base trains to a NaN
loss. Both are refused with the tensor and its file named. The dtypes are checked from the headers before
anything is read; the values per tensor as it is read (one ``isfinite().all()`` over what this rank reads).
Packed experts (docs/packed-experts.md) take their stored bits unconverted (``weights.plan`` checks their
dtypes); of their values only the scales mean numbers: an MXFP4 scale byte 0xFF is NaN in the MX
specification, an INT4 scale is a bf16 (held as its two bytes by the layer).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..compat.deepspeed import local_partition

__all__ = [
    "config_dtype",
    "keeps_fp32",
    "stored_fp32_accepted",
    "dtype_problems",
    "check_dtypes",
    "check_finite",
    "check_packed_scale",
    "check_module_finite",
]

LISTED = 20
LOG = logging.getLogger("moe_plugin.precision")
_CONFIG = "config.json"
_FLOATS = ("float64", "float32", "float16", "bfloat16")


def read_config_file(file: str):
    """A checkpoint's ``config.json`` as read (ValueError naming the file when it is not JSON)."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"path: {file} is not valid JSON ({err}); re-download or re-save the checkpoint") from None


def config_dtype(path: Optional[str]) -> Optional[str]:
    """The floating dtype name a checkpoint directory's ``config.json`` declares for its weights (``dtype`` or
    ``torch_dtype``, at the top or in ``text_config``), or None where it declares none."""
    file = os.path.join(path, _CONFIG) if path else None
    if file is None or not os.path.isfile(file):
        return None
    config = read_config_file(file)
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if not isinstance(section, dict):
            continue
        for key in ("dtype", "torch_dtype"):
            value = str(section.get(key) or "").removeprefix("torch.")
            if value in _FLOATS:
                return value
    return None


def keeps_fp32(stored_name: str) -> bool:
    """Whether fp32 is a legal stored dtype for this tensor whatever the config's ``dtype`` says: the families
    K3 stores in fp32 under its bf16 ``dtype`` and those the model keeps in fp32 (``precision.STORED_FP32``; the
    K2 family's ``mlp.`` MoE blocks seen as K3's ``block_sparse_moe.``)."""
    from ..precision import stored_fp32_family  # imported late: precision imports the layers
    from .packed import k3_block_name

    return stored_fp32_family(k3_block_name(stored_name)) is not None


Reads = Iterable[Tuple[str, str, str, torch.dtype]]


def _distinct(reads: Reads):
    seen = set()
    for read in reads:
        if read[0] not in seen:
            seen.add(read[0])
            yield read


def stored_fp32_accepted(reads: Reads, declared: Optional[str]) -> List[Tuple[str, torch.dtype]]:
    """(stored name, the model tensor's dtype) of the floating tensors stored in fp32 under a lower
    ``declared`` dtype that ``keeps_fp32`` accepts (the release's fp32 families)."""
    if declared is None or declared == "float32":
        return []
    from .packed import k3_block_name

    return [
        (k3_block_name(name), model_dtype)
        for name, _file, stored, model_dtype in _distinct(reads)
        if model_dtype.is_floating_point and stored == "float32" and keeps_fp32(name)
    ]


def dtype_problems(reads: Reads, declared: Optional[str]) -> Dict[str, List[str]]:
    """``{what is wrong: [stored tensor names]}`` for the stored tensors whose dtype the model must not take:
    ``reads`` are (stored name, file, stored dtype name, the model tensor's dtype) of the unpacked targets;
    ``declared``: ``config_dtype``. fp32 under a lower ``declared`` is wrong except for ``keeps_fp32``'s
    families; any other dtype than ``declared`` (fp16 under bf16, say) always is."""
    problems: Dict[str, List[str]] = defaultdict(list)
    for name, _file, stored, model_dtype in _distinct(reads):
        model_float = model_dtype.is_floating_point
        if model_float != (stored in _FLOATS):
            kind = "floating" if model_float else "integer"
            problems[
                f"stored as {stored} but the model's tensor is {kind} ({str(model_dtype).removeprefix('torch.')})"
            ].append(name)
        elif model_float and declared and stored != declared and not (stored == "float32" and keeps_fp32(name)):
            problems[f"stored as {stored} but the checkpoint's config.json says {declared}"].append(name)
    return dict(problems)


def check_dtypes(reads: Reads, declared: Optional[str], source: str) -> Optional[str]:
    """ONE ValueError naming the tensors of ``dtype_problems`` (by what is wrong), or nothing. The release's
    fp32 families stored under a lower ``declared`` are accepted; what the model does with them (kept in fp32
    or cast to its dtype) is logged on ``moe_plugin.precision`` at INFO and returned as one line (None when
    there are none)."""
    from ..precision import stored_fp32_note  # imported late: precision imports the layers

    reads = list(reads)
    problems = dtype_problems(reads, declared)
    if not problems:
        note = stored_fp32_note(stored_fp32_accepted(reads, declared), declared or "")
        if note:
            LOG.info("%s: %s", source, note)
        return note
    parts = []
    for what, names in problems.items():
        more = f" ... ({len(names) - LISTED} more)" if len(names) > LISTED else ""
        parts.append(f"{len(names)} tensor(s) {what}: {names[:LISTED]}{more}")
    fix = (
        f"re-save the checkpoint with its floating weights in {declared} (or correct config.json's dtype)"
        if declared
        else "re-save the checkpoint with its weights in their floating dtype"
    )
    raise ValueError(f"path: {source}: {'; '.join(parts)}; {fix}")


def _first_index(bad: torch.Tensor) -> list:
    return bad.nonzero()[0].tolist()


def check_finite(name: str, file: str, value: torch.Tensor) -> None:
    """ValueError naming ``name`` and ``file`` when the floating tensor ``value`` holds a NaN or an inf."""
    if not value.is_floating_point() or value.numel() == 0:
        return
    finite = torch.isfinite(value)
    if bool(finite.all()):
        return
    bad = ~finite
    raise ValueError(
        f"path: {file or 'memory'}: tensor {name} holds {int(bad.sum())} non-finite value(s) (NaN or "
        f"inf, the first at index {_first_index(bad)}), which would train to a NaN loss; the "
        "checkpoint is damaged: re-download it or re-save it from a good copy"
    )


def check_packed_scale(name: str, file: str, value: torch.Tensor, expert_format: Optional[str]) -> None:
    """ValueError naming ``name`` and ``file`` for a packed expert scale that does not decode to a finite
    number: INT4 scales as bf16 (stored so, or as the layer's bytes), MXFP4 (or an unknown format) uint8
    exponents by their NaN byte 0xFF."""
    if expert_format == "int4":
        scale = value if value.is_floating_point() else value.contiguous().view(torch.bfloat16)
        check_finite(name, file, scale)
        return
    if value.dtype == torch.uint8 and bool((value == 0xFF).any()):
        raise ValueError(
            f"path: {file or 'memory'}: tensor {name}: scale byte 0xFF (NaN in the MX specification) "
            f"at index {_first_index(value == 0xFF)}: the checkpoint is damaged or its experts are not "
            "MXFP4; re-download it"
        )


@torch.no_grad()
def check_module_finite(module: torch.nn.Module, source: str) -> None:
    """``check_finite`` over a loaded module's parameters and buffers (a ZeRO-3 parameter: this rank's
    partition, ``ds_tensor``), for loads that do not go through ``weights.loader`` (transformers'
    ``from_pretrained``); ``source`` names the checkpoint in the message."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        part = local_partition(tensor)
        check_finite(name, source, tensor if part is None else part)
