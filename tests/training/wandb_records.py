"""Reads the history of an offline W&B run from its ``run-<id>.wandb`` file, independently of the writer.

The file is W&B's record log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's
tail shorter than a header is zero padding. A record is one ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Dict, List

_BLOCK = 32768
_HEADER = 7


def _records(data: bytes) -> List[bytes]:
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"not a W&B run file (header {ident!r} {magic:#x} {version})")
    records, parts, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records


def offline_history(run_dir: str) -> List[Dict[str, object]]:
    """One ``{key: value}`` per ``run.log`` row of the run in ``run_dir`` (a histogram or an image is a dict of
    its parts, e.g. ``{"_type": "histogram", "values": [...], "bins": [...]}``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    rows = []
    for raw in _records(data):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row: Dict[str, object] = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            if len(keys) == 1:
                row[keys[0]] = value
            else:
                row.setdefault(keys[0], {})["/".join(keys[1:])] = value
        rows.append(row)
    return rows
