"""Training data without downloads: generated arithmetic, plain text or chat (SFT) files, packed into rows.

Every source becomes a list of ``Example`` (token ids plus labels, -100 where no loss is wanted). Labels
follow the Hugging Face convention of ``moe_plugin.ops.losses.causal_lm_loss``: the input's shape, not
shifted (position t is scored against label t + 1). ``pack_examples`` places whole examples into rows of
exactly ``seq_len`` tokens, recording each example's boundaries in ``cu_seqlens`` so that the model resets
its state there and the loss skips predictions across examples. ``StepBatches`` hands every data-parallel
rank its share of each optimizer step, deterministically and resumably.

Files are read by ``records.read_records`` (errors name the file and the line or row); chats by ``chat_data``.
Images (docs/multimodal.md 2): a chat record may hold images (``image_data``); the patches travel with the
example into its row and micro-batch (``pixel_patches``/``grid_hw``, in placeholder order), so every packing
gives the same loss.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...config import require
from .chat import chat_example, has_images, sft_examples
from .images import Images, concat_images

# the sources, re-exported: docs/hf-trainer.md and the Hugging Face trainer import them from here
from .sources import arithmetic_documents, arithmetic_examples, load_examples, split_examples, text_examples
from .records import IGNORE, Example, describe

__all__ = [
    "Example",
    "Row",
    "MicroBatch",
    "IGNORE",
    "arithmetic_documents",
    "arithmetic_examples",
    "text_examples",
    "chat_example",
    "sft_examples",
    "has_images",
    "split_examples",
    "load_examples",
    "label_token_count",
    "pack_examples",
    "StepBatches",
    "eval_batches",
]


@dataclass
class Row:
    """One training row: ``input_ids``/``labels`` ``[seq_len]``; ``cu_seqlens`` ``[n+1]`` from 0 to seq_len,
    the tail padding (if any) its own last segment; the images of its placeholders (``Images``) or None."""

    input_ids: torch.LongTensor
    labels: torch.LongTensor
    cu_seqlens: torch.LongTensor
    images: Optional[Images] = None
    # where each of its examples comes from (file and line), in order: for ``moe-plugin data``'s dump
    sources: Tuple[str, ...] = ()


@dataclass
class MicroBatch:
    """Rows concatenated into one packed row: ``input_ids``/``labels`` ``[1, rows * seq_len]``,
    ``cu_seqlens`` ``[n+1]``; with images, ``pixel_patches`` ``[N, C * P * P]`` and ``grid_hw``
    ``[num_images, 2]`` of the rows' placeholders in order (None without)."""

    input_ids: torch.LongTensor
    labels: torch.LongTensor
    cu_seqlens: torch.LongTensor
    pixel_patches: Optional[torch.Tensor] = None
    grid_hw: Optional[torch.LongTensor] = None

    def image_inputs(self, device) -> dict:
        """The model's image arguments on ``device``: ``{}`` without images."""
        if self.pixel_patches is None:
            return {}
        return {"pixel_patches": self.pixel_patches.to(device), "grid_hw": self.grid_hw.to(device)}


# ------------------------------------------------------------------------------------------------ packing


def label_token_count(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    """The label tokens ``causal_lm_loss`` scores in a packed row: labels ``[T]`` or ``[1, T]`` other than
    -100, excluding each segment's first position (no prediction reaches it)."""
    flat = labels.reshape(-1)
    scored = flat != IGNORE
    scored[cu_seqlens[:-1]] = False
    return int(scored.sum())


def _first_scored(labels: List[int]) -> Optional[int]:
    """The first position whose label ``causal_lm_loss`` scores (position 0 never is: nothing predicts it)."""
    return next((i for i, label in enumerate(labels) if i > 0 and label != IGNORE), None)


class _LabelLosses:
    """The examples whose every scored label lies at or past ``seq_len`` (so truncation leaves them none): one
    warning with their count and the first one's place, and a ValueError when no example keeps any label."""

    def __init__(self, seq_len: int, total: int):
        self.seq_len, self.total = seq_len, total
        self.lost, self.first, self.kept, self.needed = 0, None, 0, None

    def add(self, example: Example, number: int) -> None:
        first = _first_scored(example.labels)
        if first is None:
            return  # nothing to lose (no label at all is not the cut's doing)
        if first < self.seq_len:
            self.kept += 1
            return
        self.lost += 1
        self.first = self.first or example.where or f"example {number}"
        self.needed = first + 1 if self.needed is None else min(self.needed, first + 1)

    def report(self) -> None:
        if not self.lost:
            return
        where = f"data.seq_len={self.seq_len} (first: {self.first})"
        require(
            self.kept > 0,
            "data.seq_len",
            f"no label survives: all {self.lost} of {self.total} records with labels lose every label to "
            f"{where}; raise data.seq_len to at least {self.needed} or shorten them",
        )
        warnings.warn(
            f"data.seq_len: {self.lost} of {self.total} records lose every label to {where}; raise "
            "data.seq_len or shorten them",
            stacklevel=2,
        )


def pack_examples(examples: List[Example], seq_len: int, pack: bool = True, pad_id: int = 256) -> List[Row]:
    """Rows of exactly ``seq_len`` tokens: whole examples placed greedily into the first row with room (in
    order), or one example per row with ``pack=False``; the rest is ``pad_id`` with labels -100 and forms
    the last segment, so no real token attends to it. An example longer than ``seq_len`` is cut to it (one
    warning with the count), unless it holds images (a ValueError: a cut would split an image from its
    tokens). Examples the cut leaves without any scored label get one more warning (their count and the
    first one's place), and a ValueError naming ``data.seq_len`` when no example keeps a label. A row
    carries its examples' images in order. ``pad_id`` defaults to the byte tokenizer's ``<|pad|>``."""
    require(isinstance(seq_len, int) and seq_len > 1, "data.seq_len", f"must be an integer > 1, got {seq_len!r}")
    bins: List[List[Example]] = []
    room: List[int] = []
    truncated = 0
    losses = _LabelLosses(seq_len, len(examples))
    for number, example in enumerate(examples, 1):
        losses.add(example, number)
        if len(example.input_ids) > seq_len:
            require(
                example.images is None,
                "data.seq_len",
                f"{example.where or 'an example'} holds images and is {len(example.input_ids)} tokens long, "
                f"more than data.seq_len ({seq_len}); raise data.seq_len to at least {len(example.input_ids)}",
            )
            truncated += 1
            example = Example(example.input_ids[:seq_len], example.labels[:seq_len], where=example.where)
        size = len(example.input_ids)
        target = next((i for i, free in enumerate(room) if free >= size), None) if pack else None
        if target is None:
            bins.append([])
            room.append(seq_len)
            target = len(bins) - 1
        bins[target].append(example)
        room[target] -= size
    losses.report()
    if truncated:
        warnings.warn(
            f"data.seq_len: {truncated} of {len(examples)} examples are longer than {seq_len} tokens "
            f"and were truncated to it; raise data.seq_len to keep them whole",
            stacklevel=2,
        )
    rows = []
    for members, free in zip(bins, room):
        ids = [t for e in members for t in e.input_ids] + [pad_id] * free
        labels = [t for e in members for t in e.labels] + [IGNORE] * free
        bounds = [0]
        for e in members:
            bounds.append(bounds[-1] + len(e.input_ids))
        if free:
            bounds.append(seq_len)
        rows.append(
            Row(
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor(labels, dtype=torch.int64),
                torch.tensor(bounds, dtype=torch.int64),
                concat_images([e.images for e in members]),
                tuple(e.where for e in members),
            )
        )
    return rows


def _micro_batch(rows: List[Row]) -> MicroBatch:
    """Rows ``[seq_len]`` each -> one packed row ``[1, len(rows) * seq_len]`` with shifted boundaries."""
    cu, offset = [torch.zeros(1, dtype=torch.int64)], 0
    for row in rows:
        cu.append(row.cu_seqlens[1:] + offset)
        offset += row.input_ids.numel()
    images = concat_images([r.images for r in rows])
    return MicroBatch(
        torch.cat([r.input_ids for r in rows]).unsqueeze(0),
        torch.cat([r.labels for r in rows]).unsqueeze(0),
        torch.cat(cu),
        images.pixel_patches if images else None,
        images.grid_hw if images else None,
    )


class StepBatches:
    """Each data-parallel rank's micro-batches of every optimizer step, with no communication.

    A step takes ``dp_size * accumulation * micro_batch_size`` rows from a shuffle of all rows (seeded with
    ``seed + epoch``, a new shuffle each epoch; rows left over at an epoch's end wait for the next shuffle).
    Micro-batch m of rank r holds the step's rows ``[(m * dp_size + r) * mb, +mb)``, so micro-batch m of all
    ranks together is micro-batch m of one process with ``dp_size * mb`` rows: the same rows per step, and
    the loss (a sum over tokens divided by the step's count) does not depend on the layout. Every rank keeps
    its own instance, built with the same arguments, and calls ``next_step`` once per step.
    """

    def __init__(self, rows: List[Row], micro_batch_size: int, accumulation: int, dp_size: int, seed: int):
        for name, value in (
            ("train.micro_batch_size", micro_batch_size),
            ("train.gradient_accumulation", accumulation),
            ("parallel.dp_size", dp_size),
        ):
            require(isinstance(value, int) and value > 0, name, f"must be a positive integer, got {value!r}")
        self.rows, self.seed = rows, seed
        self.micro_batch_size, self.accumulation, self.dp_size = micro_batch_size, accumulation, dp_size
        self.rows_per_step = dp_size * accumulation * micro_batch_size
        require(
            len(rows) >= self.rows_per_step,
            "train.micro_batch_size",
            f"a step takes dp_size * accumulation * micro_batch_size = {self.rows_per_step} rows but the "
            f"data has only {len(rows)}; add examples, shorten data.seq_len or take smaller steps",
        )
        self._row_tokens = [label_token_count(r.labels, r.cu_seqlens) for r in rows]
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> List[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_step(self, dp_rank: int) -> Tuple[List[MicroBatch], int]:
        """This rank's ``accumulation`` micro-batches of the next step, and the label tokens of the whole step
        (all ranks, all micro-batches: what ``causal_lm_loss`` counts), for ``num_items_in_batch``."""
        require(
            isinstance(dp_rank, int) and 0 <= dp_rank < self.dp_size,
            "dp_rank",
            f"must be in [0, {self.dp_size}), got {dp_rank!r}",
        )
        if self.index + self.rows_per_step > len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle(self.epoch)
        step = self._order[self.index : self.index + self.rows_per_step]
        self.index += self.rows_per_step
        mb = self.micro_batch_size
        micro_batches = []
        for m in range(self.accumulation):
            first = (m * self.dp_size + dp_rank) * mb
            micro_batches.append(_micro_batch([self.rows[i] for i in step[first : first + mb]]))
        return micro_batches, sum(self._row_tokens[i] for i in step)

    def state_dict(self) -> dict:
        """Where the next step starts (JSON-serialisable), with what it must be resumed on."""
        return {"epoch": self.epoch, "index": self.index, "num_rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where ``state_dict`` was taken; a state from other data raises a ValueError."""
        require(
            isinstance(state, dict)
            and all(isinstance(state.get(k), int) for k in ("epoch", "index", "num_rows", "seed")),
            "data state",
            f"needs integer 'epoch', 'index', 'num_rows' and 'seed', got {describe(state)}",
        )
        require(
            state["num_rows"] == len(self.rows),
            "data state",
            f"was saved with {state['num_rows']} rows but this run has {len(self.rows)}; resume with the "
            f"same data, data.seq_len and data.pack",
        )
        require(
            state["seed"] == self.seed,
            "data state",
            f"was saved with seed {state['seed']} but this run has {self.seed}; resume with the same seed",
        )
        require(
            state["epoch"] >= 0 and 0 <= state["index"] <= len(self.rows),
            "data state",
            f"epoch {state['epoch']}, index {state['index']} is not a position in {len(self.rows)} rows",
        )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)


def eval_batches(rows: List[Row], micro_batch_size: int, count: Optional[int] = None) -> List[MicroBatch]:
    """The first ``count`` (default: all) micro-batches of ``rows`` in order, the last possibly shorter."""
    require(
        isinstance(micro_batch_size, int) and micro_batch_size > 0,
        "train.micro_batch_size",
        f"must be a positive integer, got {micro_batch_size!r}",
    )
    require(
        count is None or (isinstance(count, int) and count >= 0),
        "eval batch count",
        f"must be a non-negative integer, got {count!r}",
    )
    starts = range(0, len(rows), micro_batch_size)
    if count is not None:
        starts = starts[:count]
    return [_micro_batch(rows[s : s + micro_batch_size]) for s in starts]
