"""The main job's data (docs/main-job.md): one question per dataset about generated pictures of a coloured shape
on a background of another colour, written as chat JSONL with the images inline as base64 PNGs (one
self-contained file, no downloads). The question is the same for every picture, so only the image answers it.

- ``color`` ("What color is the shape?" -> red, green, blue or yellow): the task the shipped base learns;
- ``background`` ("What color is the background?" -> the same four words): the LoRA task. The base has never
  been asked it, and its answer to a picture (the shape's colour) is never the background's;
- ``shape`` ("Which shape is this?" -> square, circle or triangle).

``write_task(path, task, count, seed, exclude)`` writes ``count`` records drawn from ``seed``, none of whose
images is in ``exclude`` (the PNG bytes of another file's images), so a held-out file holds only pictures the
training file never shows. ``python -m examples.shape_tasks OUT_DIR`` writes the four files the
recipes read (``colors_train.jsonl``, ``backgrounds_train.jsonl`` and the held-out ``backgrounds_heldout.jsonl``,
``colors_heldout.jsonl``); the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
from typing import Dict, List, Optional, Set, Tuple

from moe_plugin.config import require
from examples.shapes import COLORS, QUESTIONS, SHAPES, _png_bytes, shape_image

TASKS = ("color", "background", "shape")
QUESTION_OF = dict(QUESTIONS, background="What color is the background?")
_DATA_URL = "data:image/png;base64,"
# (file name, task, count, seed): what the recipes read; the held-out seed differs from the training seeds
MAIN_JOB_FILES = (
    ("colors_train.jsonl", "color", 1200, 11),
    ("backgrounds_train.jsonl", "background", 600, 12),
    ("backgrounds_heldout.jsonl", "background", 60, 13),
    ("colors_heldout.jsonl", "color", 40, 14),
)


def answer_of(task: str, shape: str, color: str, background: str) -> str:
    """The exact expected answer: the shape's colour, the background's colour or the shape's name."""
    require(task in TASKS, "task", f"must be one of {list(TASKS)}, got {task!r}")
    return {"color": color, "background": background, "shape": shape}[task]


def task_records(
    task: str, count: int, seed: int, size: int = 56, exclude: Optional[Set[bytes]] = None
) -> List[Tuple[dict, bytes]]:
    """``count`` (chat record, PNG bytes) pairs asking ``task``'s question; a picture whose bytes are in
    ``exclude`` (or already drawn) is drawn again, so every image is new."""
    require(task in TASKS, "task", f"must be one of {list(TASKS)}, got {task!r}")
    require(isinstance(count, int) and count > 0, "count", f"must be a positive integer, got {count!r}")
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    while len(out) < count:
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        background = rng.choice(sorted(set(COLORS) - {color}))
        data = _png_bytes(shape_image(shape, color, size, rng, background=background))
        if data in seen:
            continue
        seen.add(data)
        source = _DATA_URL + base64.b64encode(data).decode("ascii")
        out.append(
            (
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image", "image": source},
                                {"type": "text", "text": QUESTION_OF[task]},
                            ],
                        },
                        {"role": "assistant", "content": answer_of(task, shape, color, background)},
                    ]
                },
                data,
            )
        )
    return out


def image_bytes(path: str) -> Set[bytes]:
    """The PNG bytes of every inline base64 image of a JSONL file ``write_task`` wrote."""
    found = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for message in json.loads(line)["messages"]:
                for item in message["content"] if isinstance(message["content"], list) else ():
                    if item.get("type") == "image" and str(item.get("image", "")).startswith(_DATA_URL):
                        found.add(base64.b64decode(item["image"][len(_DATA_URL) :]))
    return found


def write_task(
    path: str, task: str, count: int, seed: int, size: int = 56, exclude: Optional[Set[bytes]] = None
) -> str:
    """Write ``task_records`` as JSONL to ``path`` (folders made); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record, _ in task_records(task, count, seed, size, exclude):
            f.write(json.dumps(record) + "\n")
    return path


def write_main_job_data(directory: str, scale: float = 1.0) -> Dict[str, str]:
    """The main job's four files in ``directory`` (``scale`` shrinks the counts, for tests); the held-out
    shapes exclude every image of both training files. Returns {file name: path}."""
    paths: Dict[str, str] = {}
    seen: Set[bytes] = set()
    for name, task, count, seed in MAIN_JOB_FILES:
        held_out = "heldout" in name
        path = write_task(
            os.path.join(directory, name), task, max(1, int(count * scale)), seed, exclude=seen if held_out else None
        )
        if not held_out:
            seen |= image_bytes(path)
        paths[name] = path
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="write the main job's generated image+text data")
    parser.add_argument("directory", nargs="?", default="recipes/data")
    args = parser.parse_args(argv)
    for path in write_main_job_data(args.directory).values():
        print(f"{path}: {sum(1 for _ in open(path))} records, {os.path.getsize(path) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
