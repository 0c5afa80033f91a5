"""What an export wrote, read back for the export tests."""

from __future__ import annotations

import os

from safetensors.torch import load_file


def directory_tensors(directory) -> dict:
    """Every tensor of every ``.safetensors`` file in ``directory`` (shards in name order), by name."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out
