"""What every data source shares: the ``Example`` a record becomes, the tokenizer default, and the reader of
data files (``.jsonl`` line by line, errors naming the file and the 1-based line: invalid UTF-8 with the byte
and its column, invalid JSON; ``.parquet``, ``.csv`` and ``.json`` through ``datasets.load_dataset``, errors
naming the file, and the 1-based row once it is read)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

from ...config import require
from .images import Images

_DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
IGNORE = -100


@dataclass
class Example:
    """One tokenized document: ``input_ids`` and ``labels`` of the same length, labels -100 where untrained."""

    input_ids: List[int]
    labels: List[int]
    # the images of its placeholders, in order, and the data file and line (for errors); == compares only the
    # tokens (tensors have no single truth value)
    images: Optional[Images] = field(default=None, compare=False)
    where: str = field(default="", compare=False)

    def __post_init__(self):
        require(
            len(self.input_ids) == len(self.labels) > 0,
            "Example.labels",
            f"must be as long as input_ids and non-empty, got {len(self.labels)} labels for {len(self.input_ids)} ids",
        )


def default_tokenizer(tokenizer):
    """``tokenizer``, or the byte tokenizer when None: the presets' tokenizer (a base from a directory brings
    its own, ``resolved_model``), and the default of the data functions' callers that give none."""
    if tokenizer is not None:
        return tokenizer
    from ...models.tokenizer import ByteTokenizer  # imported late: transformers is slow to import

    return ByteTokenizer()


def encode(tokenizer, text: str) -> List[int]:
    # the callers add bos/eos (or the chat template does): nothing may be added twice
    return list(tokenizer.encode(text, add_special_tokens=False))


def read_records(path: str) -> Iterator[Tuple[str, object]]:
    """(where, record) per record of ``path``; ``where`` names the file and the 1-based line or row."""
    require(isinstance(path, str) and bool(path), "data.path", f"must name a data file, got {path!r}")
    require(os.path.isfile(path), "data.path", f"no such file: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _DATASETS_BUILDERS:
        for row_no, record in enumerate(_dataset_table(path, _DATASETS_BUILDERS[suffix]), 1):
            yield f"row {row_no} of {path}", record
        return
    require(
        suffix == ".jsonl",
        "data.path",
        f"{path}: unsupported file type {suffix!r}; use .jsonl (one JSON object per line), .json, .csv or .parquet",
    )
    with open(path, "rb") as f:  # bytes: a bad byte is named by its line and column, not by a stream offset
        for line_no, raw in enumerate(f, 1):
            where = f"line {line_no} of {path}"
            line = _utf8(where, raw, first=line_no == 1)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"data.path: {where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                ) from None
            except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, deep nesting
                raise ValueError(
                    f"data.path: {where}: JSON this reader cannot take ({type(e).__name__}: "
                    f"{str(e).split(':')[0]}); write the value as a string or flatten it"
                ) from None
            yield where, record


def _utf8(where: str, raw: bytes, first: bool) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        column = len(raw[: e.start].decode("utf-8")) + 1  # the bytes before the first bad one decode
        raise ValueError(
            f"data.path: {where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); "
            "save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff") if first else text  # a byte-order mark some editors write


def _dataset_table(path: str, builder: str):
    import datasets  # imported late: only these formats need it

    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # datasets and its readers (pyarrow, pandas) raise many kinds for one bad file
        cause = e.__cause__ or e
        text = str(cause).strip().splitlines()
        raise ValueError(
            f"data.path: {path}: cannot be read as {builder} ({type(cause).__name__}"
            f"{': ' + text[0][:200] if text else ''}); check that it is a valid {builder} file in "
            "UTF-8, or convert it to .jsonl"
        ) from None


def describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
