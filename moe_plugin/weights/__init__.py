"""One state-dict adapter for the Hugging Face, megatron and K3 names: ``names`` (the name table and the
layout rules), ``plan`` (which checkpoint reads fill which model tensors, with one error for every mismatch)
and ``loader`` (streaming, per-rank, ZeRO-3-partition-aware loads)."""

from .loader import LoadStats, expert_ranges, load_state, model_tensors, state_from_tensors
from .names import NAME_TABLE, base_name, hf_to_megatron_name, is_expert_tensor, megatron_to_hf_name
from .plan import Plan, detect_layout, plan_reads, stored_tensors
from .reads import Read, Stored, Target

__all__ = [
    "LoadStats",
    "NAME_TABLE",
    "Plan",
    "Read",
    "Stored",
    "Target",
    "base_name",
    "detect_layout",
    "expert_ranges",
    "hf_to_megatron_name",
    "is_expert_tensor",
    "load_state",
    "megatron_to_hf_name",
    "model_tensors",
    "plan_reads",
    "state_from_tensors",
    "stored_tensors",
]
