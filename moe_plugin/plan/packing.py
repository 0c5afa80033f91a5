"""The segment lengths the planner plans activations at: the recipe's training rows as the trainer packs them
(``training.data``), computed from lengths alone (docs/planner.md)."""

from __future__ import annotations

from typing import List

from ..config import require
from ..limits import check_limit

__all__ = ["document_lengths", "packed_lengths"]


def document_lengths(recipe, seq_len: int, seq_len_field: str = "data.seq_len") -> List[int]:
    """The segment lengths of the recipe's training rows as the trainer packs them (``training.data``), in
    order: its documents and each row's trailing padding segment."""
    from ..training.data.pipeline import load_examples
    from ..recipe.resolved_model import resolve_model

    if recipe.data.kind == "arithmetic":
        check_limit(recipe.data.num_documents, "num_documents", "data.num_documents")
    # tokenized as the trainer does, with a base directory's own tokenizer and template; a preset's documents
    # in the byte tokenizer (a full-size preset, K3's, is planned but never trained here, and its config holds
    # K3's own token ids, beyond the byte tokenizer's)
    if recipe.model.from_pretrained is None:
        train, _ = load_examples(recipe.data, recipe.seed)
    else:
        resolved = resolve_model(recipe.model)
        train, _ = load_examples(recipe.data, recipe.seed, resolved.tokenizer, resolved.tokens, resolved.processor)
    for example in train:  # what pack_examples refuses: a cut would split an image from its tokens
        require(
            example.images is None or len(example.input_ids) <= seq_len,
            seq_len_field,
            f"{example.where or 'an example'} holds images and is {len(example.input_ids)} tokens long, more "
            f"than {seq_len}; raise it to at least {len(example.input_ids)}",
        )
    return packed_lengths([len(e.input_ids) for e in train], seq_len, getattr(recipe.data, "pack", True))


def packed_lengths(sizes: List[int], seq_len: int, pack: bool = True) -> List[int]:
    """The segment lengths ``training.data.pack_examples`` gives examples of ``sizes`` tokens: each cut to
    ``seq_len``, placed in the first row with room (first fit, in order) or one per row, each row's padding
    its last segment. Lengths only, so a row of 16M tokens costs nothing; the first row with room is found in
    a max-tree over the rows' free room (log time, where pack_examples scans every row)."""
    sizes = [min(size, seq_len) for size in sizes]
    if not pack:
        return [x for size in sizes for x in ((size, seq_len - size) if size < seq_len else (size,))]
    leaves = 1 << max(len(sizes) - 1, 0).bit_length()
    tree = [-1] * (2 * leaves)  # tree[i]: the most room of any row under node i (-1: no row opened there yet)
    rows: List[List[int]] = []
    for size in sizes:
        if tree[1] >= size:
            node = 1
            while node < leaves:  # the leftmost row with room, as first fit takes it
                node = 2 * node if tree[2 * node] >= size else 2 * node + 1
            index = node - leaves
        else:
            index, node = len(rows), len(rows) + leaves
            rows.append([])
            tree[node] = seq_len
        rows[index].append(size)
        tree[node] -= size
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    lengths: List[int] = []
    for index, members in enumerate(rows):
        free = tree[leaves + index]
        lengths += members + ([free] if free else [])
    return lengths
