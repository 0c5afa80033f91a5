"""Mixture-of-experts ops: routing, dispatch, grouped experts, combine and load balancing."""

from .balance import (
    document_balance,
    document_balance_reference,
    document_ids,
    document_weights,
    expert_load,
    quantile_balance_bias,
    sequence_aux_loss,
    update_bias_sign,
)
from .experts import grouped_glu, grouped_glu_reference
from .forward import moe_forward
from .permute import inverse_order, permute, replicate_rows, unpermute
from .router import route

__all__ = [
    "route",
    "permute",
    "unpermute",
    "replicate_rows",
    "inverse_order",
    "grouped_glu",
    "grouped_glu_reference",
    "moe_forward",
    "expert_load",
    "update_bias_sign",
    "quantile_balance_bias",
    "sequence_aux_loss",
    "document_balance",
    "document_balance_reference",
    "document_ids",
    "document_weights",
]
