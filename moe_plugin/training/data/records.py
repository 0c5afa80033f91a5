"""What every data source shares: the ``Example`` a record becomes, the tokenizer default, and the reader of
data files, streamed (``.jsonl`` line by line, errors naming the file and the 1-based line: invalid UTF-8 with
the byte and its column, invalid JSON; ``.parquet`` through ``datasets.load_dataset`` in streaming
mode, ``.csv``, ``.json`` and a ``save_to_disk`` directory memory-mapped, errors naming the file, and the
1-based row once it is read)."""

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
    """(where, record) per record of ``path``, read as a stream (never the whole file at once); ``where``
    names the file and the 1-based line or row. ``.jsonl`` is read line by line here; ``.parquet`` through
    ``datasets`` in streaming mode, ``.csv`` and ``.json`` through its memory-mapped cache; a directory
    written by ``datasets``' ``save_to_disk`` is memory-mapped and read row by row."""
    require(isinstance(path, str) and bool(path), "data.path", f"must name a data file, got {path!r}")
    if os.path.isdir(path):
        for row_no, record in enumerate(_saved_dataset(path), 1):
            yield f"row {row_no} of {path}", record
        return
    require(os.path.isfile(path), "data.path", f"no such file: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _DATASETS_BUILDERS:
        for row_no, record in enumerate(_dataset_stream(path, _DATASETS_BUILDERS[suffix]), 1):
            yield f"row {row_no} of {path}", record
        return
    require(
        suffix == ".jsonl",
        "data.path",
        f"{path}: unsupported file type {suffix!r}; use .jsonl (one JSON object per line), .json, .csv, "
        ".parquet or a directory written by datasets' save_to_disk",
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


def _saved_dataset(path: str):
    import datasets  # imported late: only these formats need it

    try:
        data = datasets.load_from_disk(path)
    except Exception as e:  # not a saved dataset, or a damaged one
        cause = e.__cause__ or e
        text = str(cause).strip().splitlines()
        raise ValueError(
            f"data.path: {path} is a directory but not a dataset written by datasets' save_to_disk "
            f"({type(cause).__name__}{': ' + text[0][:200] if text else ''}); give a data file or such a directory"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        require(
            "train" in data,
            "data.path",
            f"{path} holds the splits {sorted(data)} but no 'train'; save the training split as 'train'",
        )
        data = data["train"]
    yield from data  # a memory-mapped Arrow table: rows are read as they are iterated


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


def _dataset_stream(path: str, builder: str):
    import datasets  # imported late: only these formats need it

    try:
        # Parquet streams with its stored schema. JSON and CSV are converted once into datasets' memory-mapped
        # Arrow cache instead: their streaming reader infers types per batch and turns a column of mixed
        # strings and lists into JSON text, which would train on the wrong text without a word.
        streaming = builder == "parquet"
        rows = iter(datasets.load_dataset(builder, data_files=path, split="train", streaming=streaming))
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            yield row
    except ValueError as e:
        if str(e).startswith("data.path:"):
            raise
        _unreadable(path, builder, e)
    except Exception as e:  # datasets and its readers (pyarrow, pandas) raise many kinds for one bad file
        _unreadable(path, builder, e)


def _unreadable(path: str, builder: str, e: Exception):
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
