"""Generated image+text SFT data, no downloads (docs/multimodal.md 4): pictures of one coloured shape with a
question whose answer can only be read from the picture (its colour or its shape).

``write_shapes_dataset(directory, count)`` writes ``images/NNNNN.png`` and ``train.jsonl`` (chat records in the
format ``moe_plugin.training.data.pipeline.sft_examples`` reads) and returns the JSONL's path. Everything is drawn from
``seed``: the same arguments write the same bytes.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
from typing import List, Optional, Tuple

from moe_plugin.config import require

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"color": "What color is the shape?", "shape": "Which shape is this?"}
EMBEDS = ("path", "base64")
LAYOUTS = ("inline", "list")


def shape_image(shape: str, color: str, size: int = 56, rng: random.Random = None, background: Optional[str] = None):
    """A ``size x size`` RGB PIL image: one ``shape`` in ``color`` at a random place and scale on a light
    background with a little noise in its shade, or, with ``background`` (one of ``COLORS``, not ``color``), a
    smaller shape (its box at most half the side, so the background is always the larger area) on that
    colour, its shade jittered a little per picture."""
    from PIL import Image, ImageDraw

    require(shape in SHAPES, "shape", f"must be one of {list(SHAPES)}, got {shape!r}")
    require(color in COLORS, "color", f"must be one of {sorted(COLORS)}, got {color!r}")
    require(
        background is None or (background in COLORS and background != color),
        "background",
        f"must be None or one of {sorted(COLORS)} other than the shape's {color!r}, got {background!r}",
    )
    require(isinstance(size, int) and size >= 28, "size", f"must be an integer >= 28 pixels, got {size!r}")
    rng = rng or random.Random(0)
    if background is None:
        shade = rng.randint(225, 250)
        fill_background, side = (shade, shade, shade), rng.randint(size // 2, size - 8)
    else:
        fill_background = tuple(min(255, max(0, c + rng.randint(-12, 12))) for c in COLORS[background])
        side = rng.randint(size * 3 // 10, size // 2)
    image = Image.new("RGB", (size, size), fill_background)
    draw = ImageDraw.Draw(image)
    x0, y0 = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
    box = (x0, y0, x0 + side, y0 + side)
    fill = COLORS[color]
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([(x0 + side // 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    return image


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def shapes_records(
    directory: str, count: int, seed: int = 0, size: int = 56, embed: str = "path", layout: str = "inline"
) -> List[Tuple[dict, str, str]]:
    """``count`` (record, shape, color) triples; with ``embed="path"`` the images are written under
    ``directory/images`` and named relative to ``directory``, with ``"base64"`` they are data URLs. ``layout``:
    ``"inline"`` image items, or a top-level ``"images"`` list with a bare ``{"type": "image"}`` item."""
    require(isinstance(count, int) and count > 0, "count", f"must be a positive integer, got {count!r}")
    require(embed in EMBEDS, "embed", f"must be one of {list(EMBEDS)}, got {embed!r}")
    require(layout in LAYOUTS, "layout", f"must be one of {list(LAYOUTS)}, got {layout!r}")
    rng = random.Random(seed)
    if embed == "path":
        os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    out = []
    for i in range(count):
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        asked = rng.choice(sorted(QUESTIONS))
        data = _png_bytes(shape_image(shape, color, size, rng))
        if embed == "path":
            source = f"images/{i:05d}.png"
            with open(os.path.join(directory, source), "wb") as f:
                f.write(data)
        else:
            source = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        item = {"type": "image", "image": source} if layout == "inline" else {"type": "image"}
        record = {
            "messages": [
                {"role": "user", "content": [item, {"type": "text", "text": QUESTIONS[asked]}]},
                {"role": "assistant", "content": color if asked == "color" else shape},
            ]
        }
        if layout == "list":
            record["images"] = [source]
        out.append((record, shape, color))
    return out


def write_shapes_dataset(
    directory: str,
    count: int,
    seed: int = 0,
    size: int = 56,
    embed: str = "path",
    layout: str = "inline",
    name: str = "train.jsonl",
) -> str:
    """Write ``count`` shape questions (``shapes_records``) to ``directory/name``; returns that path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        for record, _, _ in shapes_records(directory, count, seed, size, embed, layout):
            f.write(json.dumps(record) + "\n")
    return path
