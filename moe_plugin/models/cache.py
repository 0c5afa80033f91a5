"""The generation cache: one layer cache per decoder layer, and the number of positions already seen.

KDA layers keep a fixed-size recurrent state and conv tails; MLA layers keep the compressed kv latent, the
indexer keys and, after a left-padded prompt, which keys are padding. Both are updated in place by their layers, so the
cache object itself only needs to know how many positions it holds (to slice the prompt and place new queries) and how
to follow the beams of a beam search.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from ..layers.decoder import LayerCache


class HybridCache:
    def __init__(self, layer_caches: List[LayerCache]):
        self.layers = layer_caches
        self.seq_length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> LayerCache:
        return self.layers[index]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep, for every row of the batch, the cache of row ``beam_idx[row]`` (beam search); in place.

        beam_idx: ``[B]``; every cached tensor has the batch first (``[B, ...]``).
        """
        for layer in self.layers:
            for field in dataclasses.fields(layer):
                tensor = getattr(layer, field.name)
                if tensor is not None:
                    setattr(layer, field.name, tensor.index_select(0, beam_idx.to(tensor.device)))
