"""Packed (quantised) expert weights: decoders with plain references, encoders and the rules they are built from
(grouping, scale choice, rounding to the grid), grouped dequantisation."""

from .experts import (DEFAULT_GROUP_SIZE, dequantize_experts, grouped_lora, grouped_lora_reference,
                      packed_grouped_linear, packed_grouped_linear_reference)
from .formats import (E2M1, FORMATS, GROUP, INT4_VALUES, PackedSpec, check_packed, decode, decode_int4,
                      decode_int4_reference, decode_mxfp4, decode_mxfp4_reference, encode, encode_int4, encode_mxfp4,
                      grid_codes, group_scales, groups, nbytes, packed_spec, round_to_grid, round_to_grid_reference,
                      scale_values, stored_scales)

__all__ = ["DEFAULT_GROUP_SIZE", "dequantize_experts", "grouped_lora", "grouped_lora_reference",
           "packed_grouped_linear", "packed_grouped_linear_reference", "E2M1", "FORMATS", "GROUP", "INT4_VALUES",
           "PackedSpec", "check_packed", "decode", "decode_int4", "decode_int4_reference", "decode_mxfp4",
           "decode_mxfp4_reference", "encode", "encode_int4", "encode_mxfp4", "grid_codes", "group_scales", "groups",
           "nbytes", "packed_spec", "round_to_grid", "round_to_grid_reference", "scale_values", "stored_scales"]
