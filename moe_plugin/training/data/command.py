"""``moe-plugin data --recipe R [--records N] [--ids] [--dump FILE.jsonl]``: what the trainer will train on.

It reads the recipe's base tokenizer (``recipe.resolved_model.resolve_model``: the tokenizer, its chat format
and config, never the model's weights) and data exactly as ``moe_plugin.train`` does (``load_examples``, then
``pack_examples`` with the recipe's ``seq_len``, ``pack`` and the base's pad id), and prints, record by record:
where it comes from, its split (train or held out), its tokens and trained tokens, whether ``seq_len`` cuts it,
and its text with every labelled span between ``[[`` and ``]]`` (``--ids``: its ids and labels too); then the
totals. ``--dump FILE.jsonl`` writes one line per packed row as training packs it (``split``, ``row``,
``input_ids``, ``labels``, ``cu_seqlens``, ``sources``), in packing order (training shuffles rows per epoch).
A bad input is one line on stderr and exit status 2 (``cli_errors``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import List, Optional

from ...cli_errors import ArgumentParser, run_command
from .records import IGNORE

__all__ = ["main", "render_labels"]

OPEN, CLOSE = "[[", "]]"


def render_labels(tokenizer, input_ids: List[int], labels: List[int]) -> str:
    """The text of ``input_ids`` with each run of labelled tokens between ``[[`` and ``]]``, special tokens kept."""
    out, start = [], 0
    for k in range(1, len(input_ids) + 1):
        if k == len(input_ids) or (labels[k] != IGNORE) != (labels[start] != IGNORE):
            text = tokenizer.decode(input_ids[start:k], skip_special_tokens=False)
            out.append(f"{OPEN}{text}{CLOSE}" if labels[start] != IGNORE else text)
            start = k
    return "".join(out)


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="moe-plugin data",
        description="Show what a recipe trains on, record by record: ids, labels, the text with labelled spans "
        "between [[ and ]], trained tokens, records cut by seq_len; no model is loaded.",
    )
    p.add_argument("--recipe", required=True, help="the recipe JSON (its model and data sections are read)")
    p.add_argument("--records", type=int, default=3, help="how many records to show (default 3; -1: all)")
    p.add_argument("--ids", action="store_true", help="print each shown record's input_ids and labels too")
    p.add_argument("--dump", metavar="FILE.jsonl", help="write every packed row (input_ids, labels, cu_seqlens)")
    return p


def _data(argv: List[str]) -> Optional[int]:
    args = _parser().parse_args(argv)
    if args.records < -1:
        raise ValueError(f"--records: must be -1 (all) or a count >= 0, got {args.records}")
    if args.dump is not None:
        parent = os.path.dirname(os.path.abspath(args.dump))
        if not os.path.isdir(parent):
            raise ValueError(f"--dump: the folder {parent} does not exist; create it or give another path")
    from ...recipe.resolved_model import resolve_model
    from ...recipe.schema import load_recipe
    from .pipeline import label_token_count, load_examples, pack_examples

    recipe = load_recipe(args.recipe)
    data = recipe.data
    resolved = resolve_model(recipe.model)
    tokenizer, tokens = resolved.tokenizer, resolved.tokens
    print(resolved.tokenizer_note)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, held_out = load_examples(data, recipe.seed, tokenizer, tokens, resolved.processor)
        rows = {
            "train": pack_examples(train, data.seq_len, data.pack, tokens.pad_id),
            "held_out": pack_examples(held_out, data.seq_len, data.pack, tokens.pad_id) if held_out else [],
        }
    shown = len(train) + len(held_out) if args.records == -1 else args.records
    examples = [("train", e) for e in train] + [("held out", e) for e in held_out]
    for number, (split, example) in enumerate(examples[:shown], 1):
        trained = sum(1 for t in example.labels if t != IGNORE)
        cut = len(example.input_ids) > data.seq_len
        print(
            f"\nrecord {number} ({example.where or 'generated'}; {split}): {len(example.input_ids)} tokens, "
            f"{trained} trained" + (f"; cut to data.seq_len={data.seq_len}" if cut else "")
        )
        print(render_labels(tokenizer, example.input_ids, example.labels))
        if args.ids:
            print(f"input_ids: {example.input_ids}")
            print(f"labels: {example.labels}")
    cut = sum(1 for _, e in examples if len(e.input_ids) > data.seq_len)
    print(
        f"\n{len(examples)} records ({len(train)} train, {len(held_out)} held out), "
        f"{sum(len(e.input_ids) for _, e in examples)} tokens, "
        f"{sum(1 for _, e in examples for t in e.labels if t != IGNORE)} trained; {cut} cut by "
        f"data.seq_len={data.seq_len}"
    )
    for split, packed in rows.items():
        if packed:
            scored = sum(label_token_count(r.labels, r.cu_seqlens) for r in packed)
            print(f"{split}: {len(packed)} rows of {data.seq_len} tokens, {scored} scored labels")
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.dump is not None:
        with open(args.dump, "w", encoding="utf-8") as f:
            for split, packed in rows.items():
                for k, row in enumerate(packed):
                    line = {
                        "split": split,
                        "row": k,
                        "input_ids": row.input_ids.tolist(),
                        "labels": row.labels.tolist(),
                        "cu_seqlens": row.cu_seqlens.tolist(),
                        "sources": list(row.sources),
                    }
                    f.write(json.dumps(line) + "\n")
        print(f"dump: {sum(len(p) for p in rows.values())} rows written to {args.dump}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``moe-plugin data`` with ``argv`` (default: the command line); the exit status."""
    return run_command("data", _data, argv)


if __name__ == "__main__":
    sys.exit(main())
