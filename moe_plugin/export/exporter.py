"""``export_run(run_dir, to, out)``: the four exports, each written atomically and checked before it is published.

Formats (docs/exports.md):

* ``peft``: ``adapter_model.safetensors`` + ``adapter_config.json`` that plain peft loads onto the Hugging Face
  model (``PeftModel.from_pretrained(MoEPluginForCausalLM.from_pretrained(base), out)``), stacked expert adapters;
* ``per-expert``: the same adapters with one ``lora_A [r, in]`` / ``lora_B [out, r]`` per expert under the
  published per-expert names (``base_model.model.model.layers.{L}.block_sparse_moe.experts.{E}.w1.lora_A
  .weight``), the layout serving engines with MoE LoRA expect; ``adapter_config.json`` lists every target module;
* ``merged-hf`` / ``merged-k3``: full weights with the deltas merged, sharded safetensors in this project's
  Hugging Face layout or K3's published layout, streamed (``merge``); over a packed base the experts are
  decoded and written dense, or requantised (``packed``, ``requantised``); an image+text base keeps its
  vision tensors.

Every export writes ``moe_plugin_export.json`` (what was exported from where, the targets, the check's numbers,
every entry it wrote). The whole directory appears at ``out`` only once the check passed
(``fileio.atomic_directory``), and ``out`` must be new, empty, or an earlier export of the same run and format
holding nothing else (``output_paths.check_output_dir``, checked before any model loads), so that replacing it
can lose nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..compat.peft import quiet_wrapping
from ..config import require
from ..expert_adapters import split_experts
from ..fileio import atomic_directory
from ..output_paths import check_output_dir, real_path
from .configs import base_k3_config, plain_config
from .merge import check_packed_base, has_vision, write_merged
from .packed import dense_base_model, dense_config, dense_stream, packed_stacks
from .source import RunLocation, RunSource, locate_run, open_run
from .targets import Target, on_image_model, per_expert_key, select_targets
from .verify import (
    LOGITS_RTOL,
    LOW_PRECISION_RTOL,
    ROUNDED_RTOL,
    CheckResult,
    base_model,
    compare_deltas,
    logits_of,
    merged_differences,
    reference,
    relative_diff,
    rounded_reference_logits,
)

__all__ = ["FORMATS", "ExportReport", "export_run", "MANIFEST"]

FORMATS = ("peft", "per-expert", "merged-hf", "merged-k3")
MANIFEST = "moe_plugin_export.json"
ADAPTER_FILE = "adapter_model.safetensors"
# what an export wrote besides its tensors, for manifests from before they listed their contents
_WRITTEN_BESIDES = ("config.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class ExportReport:
    format: str
    out: str
    targets: List[str]
    expert_deltas: int  # expert deltas carried (targets x experts)
    check: CheckResult
    files: List[str] = field(default_factory=list)
    peak_expert_layers: Optional[int] = None  # merged exports: the most MoE layers' experts held at once
    # merged exports over a packed base: how the experts were written ("bfloat16"/"float32" dense, or the
    # packed format when requantised), and for a requantised one the expert values whose decoded value
    # changed from the base's, out of the values requantised
    expert_format: Optional[str] = None
    requantised_changed_values: Optional[int] = None
    requantised_values: Optional[int] = None

    def _rounded(self) -> str:
        rounded = self.check.rounded_to
        return f" with its merged tensors rounded to {rounded} as written" if rounded else ""

    def summary(self) -> str:
        text = (
            f"{self.format} export written to {self.out}: {len(self.targets)} targets ({self.expert_deltas} "
            f"expert deltas); check passed: {self.check.deltas_checked} deltas compared, logits within "
            f"{self.check.logits_rel_diff:.2e} of the adapted model"
            + (
                f" with its merged tensors rounded to {self.check.rounded_to} as written"
                if self.check.rounded_to
                else ""
            )
            + f" (allowed {self.check.tolerance:g})"
        )
        if self.requantised_values is not None:
            text += (
                f"; packed base: experts requantised to {self.expert_format}, {self.requantised_changed_values}"
                f" of {self.requantised_values} expert values changed from the base (lossy: the merged weights "
                f"are rounded to the format's grid again; {self.check.requantised_ties} rounding ties)"
            )
        elif self.expert_format is not None:
            text += f"; packed base: experts dequantised and written in {self.expert_format}"
        return text


def _leaf(weight: str) -> str:
    parts = weight.split(".")
    return parts[-2] if parts[-1] == "weight" else parts[-1]


def _tokenizer(source: RunSource, directory: str) -> List[str]:
    """The base's tokenizer files copied unchanged (a preset run's base/ holds the byte tokenizer it trained
    with); a base that holds none gets none, never a tokenizer other than the one the run trained with."""
    from ..recipe.resolved_model import copy_tokenizer_files

    return copy_tokenizer_files(source.base_path, directory)


def _write_peft(source: RunSource, targets: Dict[str, Target], tmp: str) -> List[str]:
    from safetensors.torch import save_file

    config = source.lora_config.__class__(**source.lora_config.to_dict())
    config.task_type, config.inference_mode = "CAUSAL_LM", True
    config.base_model_name_or_path = os.path.abspath(source.base_path)
    state = {k: source.state[k].contiguous() for t in targets.values() for k in (t.key_a, t.key_b)}
    save_file(state, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    return [ADAPTER_FILE, "adapter_config.json", *_tokenizer(source, tmp)]


def _check_peft(source: RunSource, targets: Dict[str, Target], tmp: str, expected, ref_logits) -> CheckResult:
    from peft import PeftModel

    # plain peft (no project layer registered) onto dense experts: a packed base's decoded exactly, in fp32
    base = dense_base_model(source) if packed_stacks(source.hf_config) else base_model(source)
    with quiet_wrapping():
        model = PeftModel.from_pretrained(base, tmp).eval()
    result = CheckResult(tolerance=LOGITS_RTOL)
    with torch.no_grad():
        for name, target in targets.items():
            try:
                module = model.get_submodule(target.module)
                got = module.get_delta_weight("default").float() if "default" in module.lora_A else None
            except AttributeError:
                got = None
            compare_deltas(result, target, got, expected[name])
    result.logits_rel_diff = relative_diff(logits_of(model, source.hf_config.vocab_size), ref_logits)
    return result


def _write_per_expert(source: RunSource, targets: Dict[str, Target], tmp: str) -> List[str]:
    from safetensors.torch import save_file

    from ..lora import lora_config

    state = {}
    for target in targets.values():
        a, b = source.state[target.key_a], source.state[target.key_b]
        if not target.experts:
            state[target.key_a], state[target.key_b] = a.contiguous(), b.contiguous()
            continue
        for e, (a_e, b_e) in enumerate(split_experts(a, b, target.experts)):
            state[per_expert_key(target, e, "A")], state[per_expert_key(target, e, "B")] = a_e, b_e
    save_file(state, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
    trained = source.lora_config
    config = lora_config(trained.r, trained.lora_alpha, sorted({_leaf(w) for w in targets}))
    config.use_rslora = trained.use_rslora
    config.task_type, config.inference_mode = "CAUSAL_LM", True
    config.base_model_name_or_path = os.path.abspath(source.base_path)
    config.save_pretrained(tmp)
    return [ADAPTER_FILE, "adapter_config.json", *_tokenizer(source, tmp)]


def _check_per_expert(source: RunSource, targets: Dict[str, Target], tmp: str, expected, ref_logits) -> CheckResult:
    """Read the files back as a serving engine would (per-expert adapters, scaling from adapter_config.json),
    apply every delta to a fresh base, run it."""
    import math

    from safetensors.torch import load_file

    with open(os.path.join(tmp, "adapter_config.json")) as f:
        written = json.load(f)
    r = written["r"]
    scaling = written["lora_alpha"] / (math.sqrt(r) if written.get("use_rslora") else r)
    state = load_file(os.path.join(tmp, ADAPTER_FILE))
    listed = set(written.get("target_modules") or [])
    # a serving engine adds the deltas to dense weights: a packed base's experts decoded (exactly, fp32)
    model = dense_base_model(source) if packed_stacks(source.hf_config) else base_model(source)
    params = dict(model.named_parameters())
    result = CheckResult(tolerance=LOGITS_RTOL)
    unlisted = sorted({_leaf(w) for w in targets} - listed)
    if unlisted:
        result.problems.append(f"adapter_config.json does not list the targets {unlisted}")
    with torch.no_grad():
        for name, target in targets.items():
            if not target.experts:
                have = target.key_a in state and target.key_b in state
                got = scaling * (state[target.key_b].float() @ state[target.key_a].float()) if have else None
            else:
                per = []
                for e in range(target.experts):
                    a, b = state.get(per_expert_key(target, e, "A")), state.get(per_expert_key(target, e, "B"))
                    per.append(
                        scaling * (b.float() @ a.float())
                        if a is not None and b is not None
                        else torch.zeros_like(expected[name][e])
                    )
                got = torch.stack(per)
            compare_deltas(result, target, got, expected[name])
            if got is not None and tuple(got.shape) == tuple(params[name].shape):
                params[name].add_(got)
    result.logits_rel_diff = relative_diff(logits_of(model, source.hf_config.vocab_size), ref_logits)
    return result


def _write_merged_dir(source: RunSource, targets, tmp: str, layout: str, max_bytes: int, requantise: bool):
    from ..models.k3_config import config_to_k3

    written = write_merged(
        source.base_path, source.hf_config, targets, source.state, tmp, layout, max_bytes, requantise=requantise
    )
    # dense experts carry a dense config; requantised ones the base's (its quantization_config)
    config = source.hf_config if requantise else dense_config(source.hf_config)
    if layout == "hf":
        plain_config(config).save_pretrained(tmp)
    else:
        k3 = base_k3_config(source.base_path, written, requantise)
        if k3 is None:  # a Hugging Face-layout base: its config in K3's form
            k3 = config_to_k3(config, multimodal=has_vision(source.base_path))
            k3["torch_dtype"] = written["float_dtype"]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(k3, f, indent=2, sort_keys=True)
    _tokenizer(source, tmp)
    return written


def _check_merged(
    source: RunSource, targets, tmp: str, layout: str, expected, ref_logits, requantised: bool
) -> CheckResult:
    from ..fileio import safetensors_weight_map
    from ..models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
    from ..models.k3_format import load_k3_checkpoint
    from ..weights.plan import stored_tensors

    # packed scales (INT4's are bf16 as published) say nothing of the weights' precision
    dtypes = {s.dtype for n, s in stored_tensors(safetensors_weight_map(tmp)).items() if not n.endswith("scale")}
    low = bool(dtypes & {"bfloat16", "float16"})
    result = CheckResult(tolerance=LOW_PRECISION_RTOL if low else LOGITS_RTOL)
    if low and not requantised:
        # the reference rounds each merged tensor as the export writes it: what is left is the export's own error
        written = torch.bfloat16 if "bfloat16" in dtypes else torch.float16
        base = dense_base_model(source) if packed_stacks(source.hf_config) else base_model(source)
        ref_logits = rounded_reference_logits(base, targets, expected, written, source.hf_config.vocab_size)
        result.tolerance, result.rounded_to = ROUNDED_RTOL, str(written).removeprefix("torch.")
    if requantised:
        from .requantised import requantised_check

        ref_logits = requantised_check(source, targets, tmp, expected, result)
    else:  # both streamed side by side: one base tensor and one written tensor held at a time
        written_config = dense_config(source.hf_config)
        merged_differences(
            dense_stream(source.base_path, source.hf_config),
            dense_stream(tmp, written_config),
            targets,
            expected,
            result,
        )
    # an image+text export reloads as the image+text model; the adapters are its language model's
    cls = MoEPluginForConditionalGeneration if has_vision(tmp) else MoEPluginForCausalLM
    # read in fp32 (transformers 5 defaults to the config's dtype, which would round the fp32 families once more)
    loaded = cls.from_pretrained(tmp, dtype=torch.float32) if layout == "hf" else load_k3_checkpoint(tmp, model_cls=cls)
    model = loaded.float().eval()
    if not on_image_model(targets):  # a text adapter's reference is the text model
        model = getattr(model, "language_model", model)
    result.logits_rel_diff = relative_diff(logits_of(model, source.hf_config.vocab_size), ref_logits)
    return result


def _earlier_export(run_real: str, to: str):
    """``accept_existing`` for ``check_output_dir``: a directory is an earlier export of this run in format
    ``to`` when its manifest names both and it holds nothing the export did not write (None), else why not."""

    def reason(real: str) -> Optional[str]:
        manifest = os.path.join(real, MANIFEST)
        if not os.path.isfile(manifest):
            return f"it has no {MANIFEST}"
        try:
            with open(manifest, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError):
            return f"its {MANIFEST} cannot be read as JSON"
        if not isinstance(values, dict):
            return f"its {MANIFEST} is not a JSON object"
        if not isinstance(values.get("run"), str) or real_path(values["run"]) != run_real:
            return f"it is an export of the run {values.get('run')!r}, not of {run_real}"
        if values.get("format") != to:
            return f"it is a {values.get('format')!r} export, not {to!r}"
        listed = values.get("contents")
        if not isinstance(listed, list):
            listed = list(values.get("files") or []) + list(_WRITTEN_BESIDES)
        foreign = sorted(set(os.listdir(real)) - set(listed) - {MANIFEST})
        if foreign:
            return f"it also holds entries the export did not write ({', '.join(foreign[:5])})"
        return None

    return reason


def _check_out(out: str, to: str, location: RunLocation) -> str:
    run = location.run_dir
    protected = [
        ("the run's adapter", os.path.join(run, "adapter")),
        ("the run's checkpoints", os.path.join(run, "checkpoints")),
        ("the base checkpoint", location.base_path),
        ("the run directory", run),
    ]
    return check_output_dir(
        out,
        option="OUT",
        protected=protected,
        accept_existing=_earlier_export(run, to),
        kind=f"an earlier {to} export of this run",
    )


def export_run(
    run_dir: str,
    to: str,
    out: str,
    step: Optional[int] = None,
    targets: Optional[Sequence[str]] = None,
    max_shard_size: str = "5GB",
    requantise: bool = False,
    allow_changed_inputs: bool = False,
) -> ExportReport:
    """Export the run at ``run_dir`` (final adapter, or checkpoint ``step``) as ``to`` into ``out``.

    targets: module/parameter names to export (default: every trained target); a list that leaves a trained
    target out is refused. max_shard_size: merged exports' shard size ("5GB", bytes). requantise: over a
    packed (MXFP4/INT4) base, write the merged experts packed again in the base's format (lossy; the report
    counts the values that changed) instead of dense in the base's floating dtype (BF16 for the release).
    allow_changed_inputs: go on when the base differs from what the run recorded (``--allow-changed-inputs``).
    ``out`` must be new, empty, or an earlier export of this run and format (docs/exports.md "Where it writes").
    Raises ValueError for bad input, ``ExportCheckError`` when the written export does not reproduce the adapted
    model (``out`` is then left as it was)."""
    from ..compat.transformers import convert_file_size_to_int

    require(to in FORMATS, "to", f"must be one of {list(FORMATS)}, got {to!r}")
    require(
        not requantise or to.startswith("merged"),
        "requantise",
        "only merged exports hold base weights to requantise; leave --requantise out for adapter exports",
    )
    location = locate_run(run_dir, allow_changed_inputs)
    out_real = _check_out(out, to, location)  # before anything expensive loads
    source = open_run(run_dir, step, location=location)
    if to.startswith("merged"):  # before the reference loads the base
        check_packed_base(source.base_path, requantise)
    chosen = select_targets(source.targets, targets, active=source.targets)
    _, ref_logits, expected = reference(source)
    report = ExportReport(to, out_real, sorted(chosen), sum(t.experts for t in chosen.values()), CheckResult())
    with atomic_directory(out_real) as tmp:
        if to == "peft":
            report.files = _write_peft(source, chosen, tmp)
            check = _check_peft(source, chosen, tmp, expected, ref_logits)
        elif to == "per-expert":
            report.files = _write_per_expert(source, chosen, tmp)
            check = _check_per_expert(source, chosen, tmp, expected, ref_logits)
        else:
            layout = to.split("-")[1]
            written = _write_merged_dir(
                source, chosen, tmp, layout, convert_file_size_to_int(max_shard_size), requantise
            )
            report.files, report.peak_expert_layers = written["files"], written["peak_expert_layers"]
            report.expert_format = written["expert_format"]
            report.requantised_changed_values = written["requantised_changed_values"]
            report.requantised_values = written["requantised_values"]
            check = _check_merged(source, chosen, tmp, layout, expected, ref_logits, requantise)
        check.raise_if_failed(f"--to {to}")
        report.check = check
        _write_manifest(tmp, report, source)
        _check_out(out, to, location)  # again: what appeared at OUT while the export ran is not replaced either
    return report


def _write_manifest(tmp: str, report: ExportReport, source: RunSource) -> None:
    values = {
        "format": report.format,
        "run": source.run_dir,
        "step": source.step,
        "base": source.base_path,
        "targets": report.targets,
        "expert_deltas": report.expert_deltas,
        "files": report.files,
        "check": {
            "logits_max_rel_diff": report.check.logits_rel_diff,
            "allowed": report.check.tolerance,
            "deltas_compared": report.check.deltas_checked,
        },
        "peak_expert_layers": report.peak_expert_layers,
        "expert_format": report.expert_format,
        "requantised_changed_values": report.requantised_changed_values,
        "requantised_values": report.requantised_values,
        "contents": sorted(os.listdir(tmp)) + [MANIFEST],
    }
    if report.check.requantised_ties is not None:
        values["check"]["requantised_ties"] = report.check.requantised_ties
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
