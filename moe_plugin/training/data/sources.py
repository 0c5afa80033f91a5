"""Where training examples come from: generated arithmetic, plain text or chat (SFT) files by the recipe's
``data`` section, and their held-out split by content hash (``pipeline`` packs them into rows)."""

from __future__ import annotations

import hashlib
import random
from typing import List, Tuple

from ...config import require
from .chat import sft_examples
from .records import Example, default_tokenizer, describe, encode, read_records

__all__ = ["arithmetic_documents", "arithmetic_examples", "text_examples", "split_examples", "load_examples"]

_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_documents(count: int, seed: int = 0, operation: str = "+") -> List[str]:
    """Short questions on two-digit numbers: learnable by a tiny model, so a falling loss means something."""
    require(operation in _OPERATIONS, "data.operation", f"expected one of {sorted(_OPERATIONS)}, got {operation!r}")
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        docs.append(f"Q: {a} {operation} {b} = ? A: {_OPERATIONS[operation](a, b)}.")
    return docs


def _document_example(tokenizer, text: str, where: str = "") -> Example:
    # a tokenizer without a bos token (many subword ones) starts the document with its first token
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ids = bos + encode(tokenizer, text) + [tokenizer.eos_token_id]
    return Example(ids, list(ids), where=where)


def arithmetic_examples(count: int, seed: int = 0, operation: str = "+", tokenizer=None) -> List[Example]:
    """``<|bos|>Q: a - b = ? A: c.<|eos|>`` per document, loss on every token."""
    tokenizer = default_tokenizer(tokenizer)
    return [
        _document_example(tokenizer, doc, f"generated arithmetic document {i}")
        for i, doc in enumerate(arithmetic_documents(count, seed, operation), 1)
    ]


def text_examples(path: str, tokenizer=None) -> List[Example]:
    """One ``{"text": ...}`` record per document, tokenized as ``<|bos|> text <|eos|>``, loss on every token."""
    tokenizer = default_tokenizer(tokenizer)
    examples = []
    for where, record in read_records(path):
        require(
            isinstance(record, dict) and isinstance(record.get("text"), str),
            "data.path",
            f"{where}: needs an object with a string field 'text', got {describe(record)}",
        )
        examples.append(_document_example(tokenizer, record["text"], where))
    return examples


def _held_out_score(example: Example) -> float:
    """A number in [0, 1) fixed by the example's content alone, so the split survives reordered or added lines."""
    content = ",".join(map(str, example.input_ids)) + "|" + ",".join(map(str, example.labels))
    return int.from_bytes(hashlib.blake2b(content.encode(), digest_size=8).digest(), "big") / 2.0**64


def split_examples(examples: List[Example], eval_fraction: float) -> Tuple[List[Example], List[Example]]:
    """(train, held_out): an example is held out when its content hash falls below ``eval_fraction``, so about
    that fraction is held out and identical examples always land on the same side."""
    require(
        isinstance(eval_fraction, (int, float)) and 0 <= eval_fraction <= 0.5,
        "data.eval_fraction",
        f"must be a number in [0, 0.5], got {eval_fraction!r}",
    )
    train, held_out = [], []
    for example in examples:
        (held_out if _held_out_score(example) < eval_fraction else train).append(example)
    return train, held_out


def load_examples(
    section, seed: int = 0, tokenizer=None, tokens=None, processor=None
) -> Tuple[List[Example], List[Example]]:
    """(train, held_out) examples for the recipe's data section (duck-typed: ``kind``, ``path``, ``operation``,
    ``num_documents``, ``eval_fraction``, for sft ``tools`` and ``chat_template_kwargs``); ``seed`` draws the
    arithmetic questions. ``tokenizer``, ``tokens`` (its ``ChatTokens``) and ``processor`` are the base's
    (``ResolvedModel``); without a tokenizer, the byte tokenizer of the presets."""
    kind = section.kind
    if kind == "arithmetic":
        examples = arithmetic_examples(section.num_documents, seed, section.operation, tokenizer)
    elif kind == "sft":
        require(bool(section.path), "data.path", f"is required when data.kind is {kind!r}")
        examples = sft_examples(
            section.path,
            tokenizer,
            processor,
            tokens,
            tools=getattr(section, "tools", None),
            template_kwargs=getattr(section, "chat_template_kwargs", None) or None,
        )
    elif kind == "text":
        require(bool(section.path), "data.path", f"is required when data.kind is {kind!r}")
        examples = text_examples(section.path, tokenizer)
    else:
        raise ValueError(f"data.kind: must be 'arithmetic', 'sft' or 'text', got {kind!r}")
    require(
        len(examples) > 0,
        "data.num_documents" if kind == "arithmetic" else "data.path",
        f"must be positive to generate examples, got {section.num_documents}"
        if kind == "arithmetic"
        else f"{section.path} holds no examples; add records",
    )
    fraction = getattr(section, "eval_fraction", 0.0)
    train, held_out = split_examples(examples, fraction)
    require(len(train) > 0, "data.eval_fraction", f"{fraction} holds out all {len(examples)} examples; lower it")
    require(
        fraction == 0 or len(held_out) > 0,
        "data.eval_fraction",
        f"{fraction} of {len(examples)} examples selects none for the held-out split; raise it, add "
        f"examples, or set it to 0",
    )
    return train, held_out
