"""Reading safetensors checkpoints safely: a shard's header checked against its file before anything reads
it (``read_safetensors_header``), and a checkpoint directory's weight map, sharded or single
(``safetensors_weight_map``); errors name the file and say to re-download or re-save it."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = [
    "SAFETENSORS_SINGLE",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_DTYPES",
    "read_safetensors_header",
    "safetensors_weight_map",
]


SAFETENSORS_SINGLE = "model.safetensors"


SAFETENSORS_INDEX = "model.safetensors.index.json"


# safetensors header dtype -> (torch dtype name, bits per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U64": ("uint64", 64),
    "U32": ("uint32", 32),
    "U16": ("uint16", 16),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F4": ("float4_e2m1fn_x2", 4),
    "C64": ("complex64", 64),
}


_METADATA = "__metadata__"


def _first_line(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _damaged(path: str, what: str) -> ValueError:
    return ValueError(f"path: {path}: damaged safetensors file: {what}; re-download or re-save it")


def _entry_problem(name: str, entry: Any, data_size: int) -> Optional[str]:
    """What is wrong with one header entry (None: nothing), its data checked against the data section's size."""
    if not isinstance(entry, dict):
        return f"the header entry of tensor {name!r} is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        return f"tensor {name!r} has the unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"tensor {name!r} has the shape {shape!r}, not a list of non-negative integers"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        return f"tensor {name!r} has the data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
    if offsets[1] > data_size:
        return (
            f"tensor {name!r} ends at data byte {offsets[1]} but the file holds only {data_size} data bytes "
            "(cut short, or a header that does not describe this file)"
        )
    numel = 1
    for d in shape:
        numel *= d
    if (offsets[1] - offsets[0]) * 8 != numel * SAFETENSORS_DTYPES[dtype][1]:
        return (
            f"tensor {name!r} ({dtype} {shape}) needs {numel * SAFETENSORS_DTYPES[dtype][1] / 8:g} bytes but "
            f"its data_offsets {offsets} span {offsets[1] - offsets[0]}"
        )
    return None


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file, checked against the file: the
    8-byte length, JSON, known dtypes, shapes, and data ranges that fit the file, match their dtype and shape
    and cover the data section exactly without overlap (what safetensors itself requires before it reads).
    A damaged file raises ONE ValueError ``"path: <file>: damaged safetensors file: ...; re-download or
    re-save it"``; ``__metadata__`` is left out."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _damaged(
                path,
                f"{os.path.basename(path)} holds {size} bytes, fewer than the 8-byte header "
                "length a safetensors file starts with",
            )
        length = int.from_bytes(head, "little")
        if not 0 < length <= size - 8:
            raise _damaged(
                path,
                f"{os.path.basename(path)} is not a safetensors file or is cut short (its header "
                f"length field says {length} bytes, but {size - 8} follow)",
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _damaged(path, f"its {length}-byte header is not JSON ({_first_line(err)})") from None
    if not isinstance(header, dict):
        raise _damaged(path, f"its header is JSON but not an object (a {type(header).__name__})")
    header.pop(_METADATA, None)
    data_size = size - 8 - length
    for name, entry in header.items():
        problem = _entry_problem(name, entry, data_size)
        if problem:
            raise _damaged(path, problem)
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items())
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise _damaged(
                path,
                f"tensor {name!r}'s data starts at byte {begin} where {end} was expected (the "
                "header's data ranges overlap or leave a gap)",
            )
        end = stop
    if end != data_size:
        raise _damaged(path, f"the header describes {end} data bytes but the file holds {data_size}")
    return header


def safetensors_weight_map(path: str | os.PathLike) -> dict:
    """``{tensor name: shard file path}`` of a checkpoint directory: ``model.safetensors.index.json`` with its
    shards, or a single ``model.safetensors`` (its header checked, ``read_safetensors_header``). ValueError
    (naming ``path``) if neither is there, the index is not a JSON object with a ``weight_map`` of file names,
    or it lists shard files that are missing."""
    path = os.fspath(path)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                listed = json.load(f)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ValueError(
                f"path: {index} is not valid JSON ({_first_line(err)}); re-download it or re-save the checkpoint"
            ) from None
        listed = listed.get("weight_map") if isinstance(listed, dict) else None
        if not (isinstance(listed, dict) and all(isinstance(v, str) and v for v in listed.values())):
            raise ValueError(
                f"path: {index} has no 'weight_map' object of tensor name -> shard file name; "
                "re-download it or re-save the checkpoint"
            )
        weight_map = {name: os.path.join(path, file) for name, file in listed.items()}
        absent = sorted({file for file in weight_map.values() if not os.path.isfile(file)})
        if absent:
            raise ValueError(
                f"path: {SAFETENSORS_INDEX} lists shard files that are not in {path}: "
                f"{[os.path.basename(f) for f in absent][:10]}"
            )
        return weight_map
    single = os.path.join(path, SAFETENSORS_SINGLE)
    if not os.path.isfile(single):
        raise ValueError(f"path: {path} holds neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}")
    return {name: single for name in read_safetensors_header(single)}
