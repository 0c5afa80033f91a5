"""The read plan of one load: which checkpoint tensors (file, stored name, rows) land where in each target.

``plan_reads`` takes the target model's tensors (``Target``: the full shape, for a routed-expert stack the
global ``[first, last)`` experts its rows are, under ZeRO-3 the flat range of this rank's partition) and a
checkpoint's weight map, and returns a ``Plan`` of ``Read`` s, or raises ONE ValueError that lists every
missing tensor, every unknown tensor (``strict``) and every shape mismatch by name. Only what this rank keeps
is planned: its own experts, and under ZeRO-3 the rows that cover its partition. Shapes and dtypes come from
the safetensors headers (``stored_tensors``), so planning reads no tensor data, except INT4's 8-byte
``weight_shape`` records of the experts this rank reads, checked against the model's logical expert shape.
Packed experts are found under K3's names or the K2 family's (``weights.packed.expert_naming``).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from ..config import HF_MODEL_TYPE, K3_TEXT_MODEL_TYPE, K3_VL_MODEL_TYPE, ModelConfig, require
from ..fileio import SAFETENSORS_DTYPES, SAFETENSORS_INDEX, read_safetensors_header
from .packed import (
    expert_naming,
    is_k2_expert,
    is_packed_expert_stack,
    k2_block_name,
    packed_expert_names,
    shape_tensor_name,
)
from .reads import (
    LISTED,
    Read,
    Stored,
    Target,
    _listing,
    _mismatches,
    _packed_dtype_problems,
    _raise_problems,
    _shape_checks,
    _weight_shape_problems,
)
from .names import (
    NAMINGS,
    TEXT_PREFIX,
    VISION_PREFIXES,
    is_indexer_tensor,
    is_mtp,
    is_stacked_expert,
    k3_expert_name,
    needs_k3_conversion,
    parse_k3_expert,
    quantised_tensors,
    to_hf_name,
)

__all__ = ["LAYOUTS", "Stored", "Target", "Read", "Plan", "stored_tensors", "detect_layout", "plan_reads"]

LAYOUTS = ("hf", "k3")  # stacked experts as the Hugging Face model saves them, or K3's published layout
CONFIG_NAME = "config.json"


@dataclass
class Plan:
    """Reads per target, in the checkpoint layout ``layout``; ``ignored``: checkpoint tensors dropped on
    request (vision, multi-token prediction); ``unknown``: tensors the model lacks, skipped (strict=False);
    ``fresh``: targets left as they are (a K3 checkpoint has no DSA indexer)."""

    layout: str
    reads: Dict[str, List[Read]]
    ignored: List[str] = field(default_factory=list)
    unknown: List[str] = field(default_factory=list)
    fresh: List[str] = field(default_factory=list)

    def by_file(self) -> Dict[str, List[Read]]:
        """The reads grouped by shard file (each file is opened once), in plan order within a file."""
        out: Dict[str, List[Read]] = defaultdict(list)
        for reads in self.reads.values():
            for read in reads:
                out[read.file].append(read)
        return dict(sorted(out.items()))


def stored_tensors(weight_map: Mapping[str, str]) -> Dict[str, Stored]:
    """``{name: Stored}`` of a weight map (``fileio.safetensors_weight_map``), from each shard's header.

    ValueError (``path: ...``) if a shard is damaged (``fileio.read_safetensors_header``), holds a tensor the
    index maps elsewhere (or not at all), or the index lists a tensor its shard does not hold."""
    by_file: Dict[str, List[str]] = defaultdict(list)
    for name, file in weight_map.items():
        by_file[file].append(name)
    out: Dict[str, Stored] = {}
    for file, names in sorted(by_file.items()):
        header = read_safetensors_header(file)
        strays = sorted(k for k in header if weight_map.get(k) != file)
        require(
            not strays,
            "path",
            f"{os.path.basename(file)} holds tensors that {SAFETENSORS_INDEX} maps to another "
            f"file or not at all: {strays[:LISTED]}",
        )
        absent = sorted(n for n in names if n not in header)
        require(
            not absent,
            "path",
            f"{SAFETENSORS_INDEX} lists tensors that {os.path.basename(file)} does not hold: {absent[:LISTED]}",
        )
        for name in names:
            entry = header[name]
            out[name] = Stored(file, tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]][0])
    return out


def _config_model_type(path: Optional[str]) -> Optional[str]:
    config_path = os.path.join(path, CONFIG_NAME) if path is not None else None
    if config_path is None or not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            return json.load(f).get("model_type")
    except ValueError as err:
        raise ValueError(f"path: {config_path} is not valid JSON ({err})") from None


def detect_layout(path: Optional[str], names: Iterable[str]) -> str:
    """ "k3" or "hf": by ``config.json``'s ``model_type`` in ``path`` (K3's "kimi_linear" / "kimi_k3", or this
    project's "moe_plugin"), else by the tensor names (K3 stores one tensor per expert). A K3 config.json over
    stacked experts (``...experts.w1``) is a K3 base written back by ``save_pretrained``: "hf"."""
    model_type = _config_model_type(path)
    if model_type in (K3_TEXT_MODEL_TYPE, K3_VL_MODEL_TYPE):
        return "hf" if any(is_stacked_expert(name) for name in names) else "k3"
    if model_type == HF_MODEL_TYPE:
        return "hf"
    return "k3" if any(parse_k3_expert(name) or is_k2_expert(name) for name in names) else "hf"


def _reads_of(
    tname: str, target: Target, stored_name: str, wanted: List[str], stored: Mapping[str, Stored], layout: str
) -> List[Read]:
    reads = _plain_reads_of(tname, target, stored_name, wanted, stored, layout)
    if not is_packed_expert_stack(tname, target.dtype):
        return reads
    return [r if stored[r.name].dtype == target.dtype else Read(**{**vars(r), "bitcast": target.dtype}) for r in reads]


def _plain_reads_of(
    tname: str, target: Target, stored_name: str, wanted: List[str], stored: Mapping[str, Stored], layout: str
) -> List[Read]:
    numel = math.prod(target.shape)
    lo, hi = target.flat_range or (0, numel)
    if lo >= hi:
        return []  # a ZeRO-3 partition of padding only
    if target.experts is not None:
        first, last = target.experts
        row = math.prod(target.shape[1:])
        reads = []
        for e in range(first, last):
            offset = (e - first) * row
            if offset >= hi or offset + row <= lo:
                continue  # outside this rank's partition
            if layout == "k3":
                reads.append(Read(tname, stored[wanted[e]].file, wanted[e], None, offset, expert=True))
            else:
                reads.append(Read(tname, stored[stored_name].file, stored_name, (e, e + 1), offset, expert=True))
        return reads
    entry = stored[stored_name]
    if layout == "k3" and needs_k3_conversion(stored_name, entry.shape, target.shape):
        return [Read(tname, entry.file, stored_name, None, 0, convert=True)]
    if (lo, hi) == (0, numel) or not entry.shape or math.prod(entry.shape) == 0:
        return [Read(tname, entry.file, stored_name, None, 0)]
    row = math.prod(entry.shape[1:])  # a K3 conv [C, 1, K] and a [C, K] layer agree row by row
    a, b = lo // row, -(-hi // row)
    rows = None if (a, b) == (0, entry.shape[0]) else (a, b)
    return [Read(tname, entry.file, stored_name, rows, a * row)]


def plan_reads(
    targets: Mapping[str, Target],
    weight_map: Mapping[str, str],
    *,
    names: str,
    config: ModelConfig,
    layout: Optional[str] = None,
    strict: bool = True,
    ignore_vision: bool = False,
    ignore_mtp: bool = False,
    stored: Optional[Mapping[str, Stored]] = None,
    field_name: str = "checkpoint",
    source: Optional[str] = None,
) -> Plan:
    """The reads that fill ``targets`` (model names in ``names``' naming, "hf" or "megatron") from a checkpoint.

    weight_map: ``{stored name: shard file}``; stored: the headers (default: read with ``stored_tensors``);
    layout: "hf" or "k3" (default: ``detect_layout`` by the names). A stored ``language_model.`` prefix is
    matched whatever the targets' prefix; a tied ``lm_head`` may be stored as the embedding only; a K3
    checkpoint without the DSA indexer leaves indexer targets fresh. ignore_vision / ignore_mtp: vision or
    multi-token-prediction tensors the model lacks are dropped (``Plan.ignored``) instead of being unknown.
    Raises one ValueError ``"<field_name>: ..."`` naming every missing, unknown (strict) and misshapen tensor;
    Quantised checkpoints are refused first unless the model's experts are packed; then packed experts are
    read under K3's names (``...block_sparse_moe.experts.{e}.w1.weight_packed``) or, when the checkpoint uses
    them, the K2 family's (``...mlp.experts.{e}.gate_proj.weight_packed``, the MoE block under ``mlp.``), and
    each INT4 ``weight_shape`` read must equal the model's logical ``[out, in]``.
    """
    require(names in NAMINGS, "names", f"must be one of {NAMINGS}, got {names!r}")
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    stored = dict(stored_tensors(weight_map) if stored is None else stored)
    layout = layout or detect_layout(None, stored)
    require(layout in LAYOUTS, "layout", f"must be one of {LAYOUTS}, got {layout!r}")
    quantised = quantised_tensors({n: s.dtype for n, s in stored.items()})
    packed_model = any(is_packed_expert_stack(n, t.dtype) for n, t in targets.items())
    require(
        not quantised or packed_model,
        field_name,
        "the checkpoint holds MXFP4-quantised tensors (FP4 e2m1 blocks with e8m0 "
        "scales) but the model's experts are dense: build it with the checkpoint's expert format (config.json's "
        "quantization_config sets expert_format; docs/packed-experts.md), or dequantise the experts first. "
        f"{len(quantised)} quantised tensor(s): {_listing(quantised)}",
    )

    prefix = TEXT_PREFIX if any(n.startswith(TEXT_PREFIX) for n in stored) else ""
    naming = expert_naming(stored) if layout == "k3" else "k3"  # K2's INT4 releases name their MoE blocks alike
    has_indexer = any(is_indexer_tensor(n) for n in stored)
    num_experts = config.moe.num_experts
    plan = Plan(layout, {})
    expected = {prefix + "lm_head.weight"} if config.tie_word_embeddings else set()  # tied: not an extra
    missing: List[str] = []
    mismatched: List[str] = []
    shape_checks: List[Tuple[str, Tuple[int, int], str]] = []
    for tname, target in targets.items():
        hf_name = to_hf_name(tname, names, config)
        stored_name = hf_name if hf_name.startswith(VISION_PREFIXES) else prefix + hf_name
        if naming == "k2":
            stored_name = k2_block_name(stored_name)
        if config.tie_word_embeddings and hf_name == "lm_head.weight" and stored_name not in stored:
            stored_name = prefix + "model.embed_tokens.weight"  # a tied embedding is stored once
        if layout == "k3" and is_indexer_tensor(hf_name) and not has_indexer:
            plan.fresh.append(tname)
            continue
        if target.experts is not None:
            first, last = target.experts
            require(
                len(target.shape) == 3 and target.shape[0] == last - first and 0 <= first < last <= num_experts,
                f"targets[{tname!r}]",
                f"an expert stack of shape {list(target.shape)} cannot hold experts [{first}, {last}) of {num_experts}",
            )
        per_expert = layout == "k3" and target.experts is not None
        packed = is_packed_expert_stack(tname, target.dtype)
        if per_expert:
            wanted = (
                packed_expert_names(stored_name, num_experts, naming)
                if packed
                else [k3_expert_name(stored_name, e) for e in range(num_experts)]
            )
        else:
            wanted = [stored_name]
        expected.update(wanted)
        if packed and per_expert:  # INT4's logical-shape records travel with the packed values
            expected.update(shape_tensor_name(n) for n in wanted)
        absent = [n for n in wanted if n not in stored]
        problems = _mismatches(tname, target, stored_name, wanted, stored, layout, num_experts)
        problems += _packed_dtype_problems(tname, target, wanted, stored)
        missing += absent
        mismatched += problems
        if not absent and not problems:
            plan.reads[tname] = _reads_of(tname, target, stored_name, wanted, stored, layout)
            if packed and per_expert:
                shape_checks += _shape_checks(tname, plan.reads[tname], stored, config, mismatched)
    mismatched += _weight_shape_problems(shape_checks, stored)

    extra = sorted(n for n in stored if n not in expected)
    plan.ignored = [
        n
        for n in extra
        if (ignore_vision and n.startswith(VISION_PREFIXES)) or (ignore_mtp and is_mtp(n, config.num_layers))
    ]
    plan.unknown = [n for n in extra if n not in set(plan.ignored)]
    _raise_problems(field_name, sorted(missing), plan.unknown if strict else [], mismatched, layout, config, source)
    return plan
