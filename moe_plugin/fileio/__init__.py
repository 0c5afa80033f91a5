"""The foundation tier's file I/O: checkpoints written all-or-nothing (``atomic``: ``atomic_directory``,
``write_json_atomic``, ``read_json``) and safetensors checkpoints read safely (``safetensors_files``:
``read_safetensors_header``, ``safetensors_weight_map``); every name is imported from here."""

from .atomic import atomic_directory, fsync_path, read_json, resolve_atomic_directory, write_json_atomic
from .safetensors_files import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    read_safetensors_header,
    safetensors_weight_map,
)

__all__ = [
    "atomic_directory",
    "fsync_path",
    "read_json",
    "resolve_atomic_directory",
    "write_json_atomic",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "read_safetensors_header",
    "safetensors_weight_map",
]
