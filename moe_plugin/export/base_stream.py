"""The base checkpoint streamed one tensor at a time, under the text model's Hugging Face names, whatever its
layout: what the merged export (``merge``), the packed-base decoding (``packed``) and the requantised check
(``requantised``) read. Its own module because ``merge`` builds on ``packed``, which needs the stream too.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterator, Tuple

import torch

from ..fileio import safetensors_weight_map
from ..weights.names import is_stacked_expert
from ..weights.packed import is_packed_expert_stack

__all__ = ["base_tensors"]


def base_tensors(base_path: str, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base checkpoint's tensors under the text model's Hugging Face names, one at a time, in state-dict
    order (experts stacked ``[E, out, in]``), each a new tensor in the checkpoint's dtype. Packed experts come
    as a layer keeps them: codes ``...experts.w1`` ``[E, out, packed_cols]`` and ``...experts.w1_scale``. An
    image+text base's vision tensors (``vision_tower.``, ``mm_projector.``) follow, under their stored names."""
    from ..models import MoEPluginForCausalLM
    from ..weights.loader import LoadStats, _apply, _open_safetensors
    from ..weights.plan import detect_layout, plan_reads, stored_tensors
    from ..weights.reads import Target as ReadTarget

    config = hf_config.to_model_config()
    with torch.device("meta"):
        meta = MoEPluginForCausalLM(hf_config).state_dict()
    if hf_config.tie_word_embeddings:
        meta.pop("lm_head.weight", None)  # stored once, as the embedding
    targets = {}
    for n, t in meta.items():
        packed = is_packed_expert_stack(n, str(t.dtype).removeprefix("torch."))  # read as stored, never converted
        expert = (is_stacked_expert(n) or packed) and t.dim() == 3
        targets[n] = ReadTarget(
            tuple(t.shape),
            (0, t.shape[0]) if expert else None,
            dtype=str(t.dtype).removeprefix("torch.") if packed else None,
        )
    stored = stored_tensors(safetensors_weight_map(base_path))
    plan = plan_reads(
        targets,
        safetensors_weight_map(base_path),
        names="hf",
        config=config,
        strict=True,
        layout=detect_layout(base_path, stored),
        stored=stored,
        source=base_path,
        ignore_vision=True,
    )
    for name, reads in plan.reads.items():
        if not reads:
            continue
        first = reads[0].name
        tensor = torch.empty(targets[name].shape, dtype=getattr(torch, targets[name].dtype or stored[first].dtype))
        # the files are opened per tensor: a mapping kept open keeps every page read so far resident in this
        # process, which would make the stream hold the whole checkpoint by the end
        with ExitStack() as stack:
            handles = {f: stack.enter_context(_open_safetensors(f)) for f in {r.file for r in reads}}
            for read in reads:
                _apply(handles[read.file], read, tensor, targets[name], LoadStats(), config.moe.expert_format)
        yield name, tensor
    for name in plan.ignored:  # the vision tower and projector, which no text adapter touches
        with _open_safetensors(stored[name].file) as handle:
            tensor = handle.get_tensor(name)
        yield name, tensor
