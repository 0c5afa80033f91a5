"""What a run read: the base checkpoint and the data files, fingerprinted so that a resume or an export can
tell whether they changed since (``output_dir/moe_plugin_inputs.json``, docs/training.md "Recorded inputs").

The base is recorded by its absolute, resolved path, the sha256 of every JSON file at its top level
(``config.json``, the safetensors index) and, for every ``*.safetensors`` shard, its size, the sha256 of its
header (the first 8 + N bytes) and of ``SAMPLES`` blocks of ``SAMPLE_BYTES`` spread evenly over its tensor
data. That never reads the weights whole (a few KiB a shard, cheap at K3 size) and still sees a base replaced
by another training of the same architecture, whose headers are byte-identical but whose every block
differs; a change to a handful of values can go unseen. A preset base is its name and overrides. Data files
(``data.path``, ``eval.answers.path``) are recorded with their size and the sha256 of their whole content.
No torch here: export and the trainer both import it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional

from ..fileio import read_json

__all__ = ["RECORD", "fingerprint_inputs", "write_recorded_inputs", "read_recorded_inputs", "check_inputs"]

RECORD = "moe_plugin_inputs.json"
FORMAT = 1
SAMPLES, SAMPLE_BYTES = 8, 4096
# the recipe fields that name a file the run reads as data
DATA_FIELDS = (("data", "path"), ("eval", "answers", "path"))


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _shard(path: str) -> Dict[str, Any]:
    """Size, header hash and sampled-data hash of one safetensors file (damaged headers hash as they are:
    the loader names the damage, this only has to see a change)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        header_end = min(size, 8 + length)
        header = head + f.read(max(0, header_end - 8))
        data = hashlib.sha256()
        span = size - header_end
        for i in range(SAMPLES if span > 0 else 0):
            f.seek(header_end + (span - min(SAMPLE_BYTES, span)) * i // max(SAMPLES - 1, 1))
            data.update(f.read(SAMPLE_BYTES))
    return {"size": size, "header_sha256": hashlib.sha256(header).hexdigest(), "data_sample_sha256": data.hexdigest()}


def _base(model: Dict[str, Any], base_path: Optional[str]) -> Dict[str, Any]:
    if base_path is None:
        return {"preset": model.get("preset"), "overrides": model.get("overrides") or {}}
    real = os.path.realpath(os.path.abspath(base_path))
    files: Dict[str, Any] = {}
    for name in sorted(os.listdir(real)):
        path = os.path.join(real, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".json"):
            files[name] = {"size": os.path.getsize(path), "sha256": _sha256_file(path)}
        elif name.endswith(".safetensors"):
            files[name] = _shard(path)
    return {"path": real, "files": files}


def _get(values: Dict[str, Any], keys) -> Any:
    for key in keys:
        if not isinstance(values, dict):
            return None
        values = values.get(key)
    return values


def fingerprint_inputs(recipe_dict: Dict[str, Any], base_path: Optional[str]) -> Dict[str, Any]:
    """The record of what the run of ``recipe_dict`` reads: the base at ``base_path`` (None: the recipe's
    preset) and every data file the recipe names (relative paths against the current directory)."""
    data: Dict[str, Any] = {}
    for keys in DATA_FIELDS:
        given = _get(recipe_dict, keys)
        if isinstance(given, str) and given:
            path = os.path.realpath(os.path.abspath(given))
            data[".".join(keys)] = {"path": path, "size": os.path.getsize(path), "sha256": _sha256_file(path)}
    return {"format": FORMAT, "base": _base(recipe_dict.get("model") or {}, base_path), "data": data}


def write_recorded_inputs(output_dir: str, record: Dict[str, Any]) -> str:
    """Write ``record`` to ``output_dir/moe_plugin_inputs.json`` atomically; returns the path."""
    path = os.path.join(output_dir, RECORD)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_recorded_inputs(run_dir: str) -> Optional[Dict[str, Any]]:
    """The record of ``run_dir``, or None when it has none (a run from before records existed); ValueError
    naming the file when it is not a record."""
    path = os.path.join(run_dir, RECORD)
    if not os.path.exists(path):
        return None
    fix = "restore it, or delete it to resume without comparing the inputs (the run records them again)"
    record = read_json(path, fix)
    if not (
        isinstance(record, dict)
        and record.get("format") == FORMAT
        and isinstance(record.get("base"), dict)
        and isinstance(record.get("data"), dict)
    ):
        raise ValueError(f"{path}: not a record of inputs (format {FORMAT} with 'base' and 'data'); {fix}")
    return record


def _base_changes(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    if "path" not in old or "path" not in new:
        return [] if old == new else [f"the base: was {_describe(old)}, now {_describe(new)}"]
    if old["path"] != new["path"]:
        return [f"the base: was read at {old['path']}, now at {new['path']}"]
    changes = []
    old_files, new_files = old.get("files") or {}, new.get("files") or {}
    for name in sorted(set(old_files) | set(new_files)):
        before, after = old_files.get(name), new_files.get(name)
        if before == after:
            continue
        where = f"the base at {new['path']}"
        if after is None:
            changes.append(f"{where}: {name} is gone")
        elif before is None:
            changes.append(f"{where}: {name} is new")
        elif "header_sha256" in after:
            what = (
                "size"
                if before.get("size") != after.get("size")
                else "header"
                if before.get("header_sha256") != after.get("header_sha256")
                else "tensor data"
            )
            changes.append(f"{where}: the {what} of shard {name} changed")
        else:
            changes.append(f"{where}: its {name} changed")
    return changes


def _describe(base: Dict[str, Any]) -> str:
    if "path" in base:
        return base["path"]
    return f"preset {base.get('preset')!r} with overrides {json.dumps(base.get('overrides') or {}, sort_keys=True)}"


def check_inputs(recorded: Dict[str, Any], current: Dict[str, Any], *, override_flag: str) -> None:
    """ValueError (one line) naming every input of ``current`` that differs from ``recorded`` and how to
    accept it (``override_flag``); nothing when they agree."""
    changes = _base_changes(recorded.get("base") or {}, current.get("base") or {})
    old_data, new_data = recorded.get("data") or {}, current.get("data") or {}
    for field in sorted(set(old_data) | set(new_data)):
        before, after = old_data.get(field), new_data.get(field)
        if before == after:
            continue
        if before is None:
            changes.append(f"{field}: {after.get('path')} is read now, the run recorded no such file")
        elif after is None:
            changes.append(f"{field}: the run read {before.get('path')}, now no file")
        elif before.get("path") != after.get("path"):
            changes.append(f"data file {field}: was {before.get('path')}, now {after.get('path')}")
        elif before.get("size") != after.get("size"):
            changes.append(
                f"data file {after['path']} ({field}): size changed ({before.get('size')} -> {after.get('size')} bytes)"
            )
        else:
            changes.append(f"data file {after['path']} ({field}): content changed (sha256 differs)")
    if changes:
        raise ValueError(
            f"{'; '.join(changes)} since the run recorded its inputs ({RECORD}); restore "
            f"{'it' if len(changes) == 1 else 'them'}, use a new output_dir, or pass {override_flag} "
            "to go on with the inputs as they are now"
        )
