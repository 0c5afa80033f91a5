"""The generation cache: one layer cache per decoder layer, and the number of positions already seen.

KDA layers keep a fixed-size recurrent state and conv tails; MLA layers keep the compressed kv latent and
the indexer keys. Both are updated in place by their layers, so the cache object itself only needs to
know how many positions it holds (to slice the prompt and place new queries).
"""

from __future__ import annotations

from typing import List

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
