"""DeepSeek sparse attention (DSA): the lightning indexer, top-k selection, sparse attention and the indexer loss."""

from .attention import (
    dense_causal_attention,
    dense_causal_attention_reference,
    sparse_attention_reference,
)
from .indexer import indexer_scores, indexer_topk
from .indexer_loss import attention_target, indexer_kl_loss
from .sparse_op import sparse_attention

__all__ = [
    "attention_target",
    "dense_causal_attention",
    "dense_causal_attention_reference",
    "indexer_kl_loss",
    "indexer_scores",
    "indexer_topk",
    "sparse_attention",
    "sparse_attention_reference",
]
