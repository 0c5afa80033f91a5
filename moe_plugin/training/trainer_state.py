"""The trainer's own state in a checkpoint, without pickle: this rank's step, losses, data position and
python RNG as JSON, its torch RNG as safetensors (the files ``checkpoint.CheckpointManager`` commits)."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch

from ..fileio import read_json

__all__ = ["TRAINER_STATE_FORMAT", "trainer_state_files", "write_trainer_state", "read_trainer_state"]


TRAINER_STATE_FORMAT = 1


def trainer_state_files(directory: str, rank: int) -> Tuple[str, str]:
    """This rank's trainer state in a checkpoint: JSON (step, losses, data position, python RNG) and
    safetensors (the torch RNG)."""
    return (
        os.path.join(directory, f"trainer_state_rank{rank}.json"),
        os.path.join(directory, f"trainer_rng_rank{rank}.safetensors"),
    )


def write_trainer_state(directory: str, rank: int, state: Dict) -> List[str]:
    """Write ``{"step", "losses", "data", "rng": {"torch": uint8 tensor, "python": random.getstate()}}``;
    returns the two paths. JSON keeps every float exactly (Python writes the shortest repr that reads back)."""
    from safetensors.torch import save_file

    state_path, rng_path = trainer_state_files(directory, rank)
    version, internal, gauss = state["rng"]["python"]
    with open(state_path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "format": TRAINER_STATE_FORMAT,
                "step": state["step"],
                "losses": list(state["losses"]),
                "data": state["data"],
                "python_rng": [version, list(internal), gauss],
            },
            f,
        )
    save_file({"torch": state["rng"]["torch"].contiguous()}, rng_path)
    return [state_path, rng_path]


def read_trainer_state(directory: str, rank: int) -> Dict:
    """What ``write_trainer_state`` wrote (a checkpoint of an earlier version, ``trainer_state_rank{r}.pt``, is
    read with ``torch.load(weights_only=True)``); ValueError naming the file when it is damaged."""
    state_path, rng_path = trainer_state_files(directory, rank)
    legacy = os.path.join(directory, f"trainer_state_rank{rank}.pt")
    if not os.path.exists(state_path) and os.path.exists(legacy):
        return _read_legacy_state(legacy)
    fix = f"the checkpoint is damaged: remove {directory} to resume from an earlier one"
    saved = read_json(state_path, fix)
    python = saved.get("python_rng") if isinstance(saved, dict) else None
    if not (
        isinstance(saved, dict)
        and saved.get("format") == TRAINER_STATE_FORMAT
        and isinstance(saved.get("step"), int)
        and isinstance(saved.get("losses"), list)
        and all(isinstance(x, (int, float)) for x in saved["losses"])
        and isinstance(saved.get("data"), dict)
        and isinstance(python, list)
        and len(python) == 3
        and isinstance(python[1], list)
        and all(isinstance(x, int) for x in python[1])
    ):
        raise ValueError(
            f"{state_path}: not a trainer state (format {TRAINER_STATE_FORMAT}: step, losses, data, python_rng); {fix}"
        )
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        tensors = load_file(rng_path)
    except (OSError, SafetensorError, ValueError) as err:
        raise ValueError(f"{rng_path}: not a readable safetensors file ({err}); {fix}") from None
    torch_rng = tensors.get("torch")
    if torch_rng is None or torch_rng.dtype != torch.uint8 or torch_rng.dim() != 1:
        raise ValueError(f"{rng_path}: holds no 1-D uint8 tensor 'torch' (the torch RNG state); {fix}")
    return {
        "step": saved["step"],
        "losses": [float(x) for x in saved["losses"]],
        "data": saved["data"],
        "rng": {"torch": torch_rng, "python": (python[0], tuple(python[1]), python[2])},
    }


def _read_legacy_state(path: str) -> Dict:
    import pickle
    import zipfile

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, ValueError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{path}: not a trainer state that loads without running code ({type(err).__name__}: "
            f"{first}); remove {os.path.dirname(path)} to resume from an earlier checkpoint"
        ) from None
    if not (isinstance(state, dict) and {"step", "losses", "data", "rng"} <= set(state)):
        raise ValueError(
            f"{path}: not a trainer state (step, losses, data, rng); remove {os.path.dirname(path)} "
            "to resume from an earlier checkpoint"
        )
    return state
