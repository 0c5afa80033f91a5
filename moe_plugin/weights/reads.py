"""The read plan's records (``Stored``: a checkpoint tensor's header, ``Target``: a model tensor this rank
holds, ``Read``: one slice to copy) and its checks: the shapes and dtypes a target cannot take, and the ONE
ValueError ``plan.plan_reads`` raises naming every missing, unknown and misshapen tensor."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from ..config import ModelConfig
from .names import TEXT_PREFIX, VISION_PREFIXES, is_mtp, k3_shape_fits
from .packed import bit_compatible, is_packed_expert_stack, logical_shape, shape_tensor_name, stack_of, viewed_shape

__all__ = ["LISTED", "Stored", "Target", "Read"]

LISTED = 20  # names shown per category in an error


LISTED = 20  # names shown per category in an error


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor as its header describes it: shard file, shape, torch dtype name."""

    file: str
    shape: Tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Target:
    """One tensor of the target model.

    shape: the full shape this rank holds (under ZeRO-3 ``ds_shape``, not the empty placeholder's); for a
    routed-expert stack ``[E_local, ...]``. experts: for such a stack, the global experts ``[first, last)``
    its rows are. flat_range: under ZeRO-3, the elements ``[lo, hi)`` of the flattened tensor this rank's
    partition holds (None: all of them)."""

    shape: Tuple[int, ...]
    experts: Optional[Tuple[int, int]] = None
    flat_range: Optional[Tuple[int, int]] = None
    dtype: Optional[str] = None  # torch dtype name; what a packed expert target must be given (weights.packed)


@dataclass(frozen=True)
class Read:
    """Read ``name`` from ``file`` (rows ``[a, b)`` of dim 0 through ``get_slice``, or the whole tensor when
    ``rows`` is None) and write it, flattened, at element ``offset`` of the flattened ``target``; ``convert``:
    first unpad it (K3's padded ``A_log``, ``names.tensor_from_k3``)."""

    target: str
    file: str
    name: str
    rows: Optional[Tuple[int, int]]
    offset: int
    convert: bool = False
    expert: bool = False
    bitcast: Optional[str] = None  # reinterpret the stored bits as this dtype (a packed target, weights.packed)


def _listing(names: List[str]) -> str:
    more = f" ... ({len(names) - LISTED} more)" if len(names) > LISTED else ""
    return f"{names[:LISTED]}{more}"


def _mismatches(
    tname: str,
    target: Target,
    stored_name: str,
    wanted: List[str],
    stored: Mapping[str, Stored],
    layout: str,
    num_experts: int,
) -> List[str]:
    """One "name: checkpoint [...], model [...]" entry per stored tensor whose shape the target cannot take."""
    present = [n for n in wanted if n in stored]
    if target.experts is not None and layout == "k3":
        row = list(target.shape[1:])
        packed = is_packed_expert_stack(tname, target.dtype)  # compared as the bytes the target will see
        return [
            f"{n}: checkpoint {list(stored[n].shape)} {stored[n].dtype}, model {row} (one expert of {tname})"
            for n in present
            if list(viewed_shape(stored[n].shape, stored[n].dtype, target.dtype) if packed else stored[n].shape) != row
        ]
    if not present:
        return []
    have = stored[present[0]].shape
    if target.experts is not None:
        want = (num_experts, *target.shape[1:])
        first, last = target.experts
        note = f" (this rank holds experts {first}..{last - 1})" if last - first != num_experts else ""
        return [] if tuple(have) == want else [f"{present[0]}: checkpoint {list(have)}, model {list(want)}{note}"]
    if layout == "k3":
        reason = k3_shape_fits(stored_name, have, target.shape)
    else:
        reason = None if tuple(have) == tuple(target.shape) else ""
    if reason is None:
        return []
    return [f"{present[0]}: checkpoint {list(have)}, model {list(target.shape)}" + (f" ({reason})" if reason else "")]


def _packed_dtype_problems(tname: str, target: Target, wanted: List[str], stored: Mapping[str, Stored]) -> List[str]:
    """Stored tensors whose bits a packed target cannot take as they are (no byte is ever converted)."""
    if not is_packed_expert_stack(tname, target.dtype):
        return []
    return [
        f"{n}: checkpoint dtype {stored[n].dtype}, model {target.dtype} (packed experts take the stored bits "
        "unconverted; was the model built with this checkpoint's expert format?)"
        for n in wanted
        if n in stored and not bit_compatible(stored[n].dtype, target.dtype)
    ]


def _shape_checks(
    tname: str, reads: List[Read], stored: Mapping[str, Stored], config: ModelConfig, mismatched: List[str]
) -> List[Tuple[str, Tuple[int, int], str]]:
    """(``weight_shape`` name, the logical ``[out, in]`` the model needs, model tensor) of each expert this
    rank reads into the packed codes ``tname``; a record whose header is not an integer ``[2]`` is added to
    ``mismatched`` at once (its values could not be read)."""
    found = stack_of(tname.removeprefix(TEXT_PREFIX))
    if found is None or found[2]:
        return []  # the scales: their experts' records are checked with the codes
    moe = config.moe
    want = logical_shape(found[1], moe.expert_intermediate_size, moe.latent_size or moe.hidden_size)
    out = []
    for read in reads:
        name = shape_tensor_name(read.name)
        if name not in stored:
            continue  # MXFP4 has none; compressed-tensors' INT4 always writes it, but it adds nothing
        entry = stored[name]
        if entry.dtype not in ("int32", "int64") or tuple(entry.shape) != (2,):
            mismatched.append(
                f"{name}: checkpoint {list(entry.shape)} {entry.dtype}, expected int32 [2] (the "
                f"logical [out, in] of one expert of {tname})"
            )
        else:
            out.append((name, want, tname))
    return out


def _weight_shape_problems(checks: List[Tuple[str, Tuple[int, int], str]], stored: Mapping[str, Stored]) -> List[str]:
    """Read each ``weight_shape`` record (8 bytes, once per shard file) and name those that differ from the
    model's logical expert shape. In-memory plans (no shard file) have no values to read and check headers only."""
    from safetensors import safe_open  # a header-only planner otherwise; only these records are read

    by_file: Dict[str, List[Tuple[str, Tuple[int, int], str]]] = defaultdict(list)
    for check in checks:
        if stored[check[0]].file:
            by_file[stored[check[0]].file].append(check)
    out = []
    for file, items in sorted(by_file.items()):
        with safe_open(file, framework="pt") as handle:
            for name, want, tname in items:
                got = tuple(int(v) for v in handle.get_tensor(name).tolist())
                if got != tuple(want):
                    out.append(
                        f"{name}: checkpoint weight_shape {list(got)}, model {list(want)} (the logical "
                        f"[out, in] of one expert of {tname}; was the model built from this checkpoint's "
                        "config?)"
                    )
    return out


def _raise_problems(
    field_name: str,
    missing: List[str],
    unknown: List[str],
    mismatched: List[str],
    layout: str,
    config: ModelConfig,
    source: Optional[str],
) -> None:
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors of the model are missing: {_listing(missing)}")
    if unknown:
        parts.append(f"{len(unknown)} tensors the model does not have: {_listing(unknown)} (strict=False to skip them)")
        if layout == "k3" and any(is_mtp(n, config.num_layers) for n in unknown):
            parts.append("multi-token-prediction layers are not supported: pass ignore_mtp=True to drop them")
        if any(n.startswith(VISION_PREFIXES) for n in unknown):
            parts.append(
                f"the unknown tensors under {'/'.join(VISION_PREFIXES)} belong to the image model: load "
                "them into MoEPluginForConditionalGeneration, or pass ignore_vision=True to drop them"
            )
    if mismatched:
        parts.append(
            f"{len(mismatched)} tensors differ in shape from the model: "
            + "; ".join(mismatched[:LISTED])
            + (f" ... ({len(mismatched) - LISTED} more)" if len(mismatched) > LISTED else "")
        )
    if not parts:
        return
    fix = " (was the model built from this checkpoint's own config?)" if missing or mismatched else ""
    where = f"{source}: " if source else ""
    raise ValueError(
        f"{field_name}: "
        + "; ".join(parts)
        + f" [{where}{len(missing)} missing, {len(unknown)} unknown, {len(mismatched)} misshapen]{fix}"
    )
