"""Training data without downloads: generated arithmetic, or a local JSONL file, packed into rows.

Documents are tokenized (``<|bos|> text <|eos|>``), concatenated and cut into windows of ``seq_len``
tokens; each window remembers where its documents start, so the model resets its state there
(``cu_seqlens``) and the loss skips predictions across documents.
"""

from __future__ import annotations

import json
import random
from typing import Iterator, List, Tuple

import torch


_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_documents(count: int, seed: int = 0, operation: str = "+") -> List[str]:
    """Short questions on two-digit numbers: learnable by a tiny model, so a falling loss means something."""
    if operation not in _OPERATIONS:
        raise ValueError(f"operation: expected one of {sorted(_OPERATIONS)}, got {operation!r}")
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        docs.append(f"Q: {a} {operation} {b} = ? A: {_OPERATIONS[operation](a, b)}.")
    return docs


def jsonl_documents(path: str) -> List[str]:
    docs = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"data.path: line {line_no} of {path} needs a string field 'text'")
            docs.append(record["text"])
    return docs


def pack_documents(token_docs: List[List[int]], seq_len: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate documents and cut windows: a list of (ids ``[seq_len]``, cu_seqlens ``[n+1]``)."""
    stream: List[int] = []
    starts: List[int] = []
    for doc in token_docs:
        starts.append(len(stream))
        stream.extend(doc)
    windows = []
    start_set = sorted(starts)
    for begin in range(0, len(stream) - seq_len + 1, seq_len):
        inside = [s - begin for s in start_set if begin < s < begin + seq_len]
        cu = torch.tensor([0] + inside + [seq_len], dtype=torch.int64)
        windows.append((torch.tensor(stream[begin:begin + seq_len], dtype=torch.int64), cu))
    return windows


def batches(windows: List[Tuple[torch.Tensor, torch.Tensor]], micro_batch_size: int, seed: int
            ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled micro-batches, each packed into one row: (ids ``[1, B*seq_len]``, cu_seqlens)."""
    if len(windows) < micro_batch_size:
        raise ValueError(f"data: {len(windows)} windows are fewer than train.micro_batch_size "
                         f"({micro_batch_size}); add documents or shorten data.seq_len")
    rng = random.Random(seed)
    order = list(range(len(windows)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - micro_batch_size + 1, micro_batch_size):
            chosen = [windows[j] for j in order[i:i + micro_batch_size]]
            ids = torch.cat([w[0] for w in chosen]).unsqueeze(0)
            offsets, cu = 0, [torch.zeros(1, dtype=torch.int64)]
            for w_ids, w_cu in chosen:
                cu.append(w_cu[1:] + offsets)
                offsets += w_ids.numel()
            yield ids, torch.cat(cu)
