"""Peak memory of a merged export against the size of the experts (docs/exports.md "Merging streams").

The claim: a merged export holds no more than one MoE layer's experts at a time, so its memory does not grow
with the number of layers. Two models whose routed experts dominate (64 experts of 512 x 256 per matrix, fp32:
96 MiB per layer) differ only in their number of MoE layers (2 and 6). For each, a run directory is made (the
base saved by ``save_pretrained``, a peft adapter on the attention, the router and every expert with random
``lora_B``), and in a fresh process the streamed merge (``export.merge.write_merged``, merged-hf, the default
5GB shards) runs after the peak-RSS counter was reset; the peak-RSS increase is printed beside one layer's
experts and all experts. The full ``export_run`` is measured too: its self-check builds the whole adapted model
once (docs/exports.md "The self-check"), so it is expected to exceed all experts; that half is for models that
fit one process.

    .venv/bin/python benchmarks/exports.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import _status_kib, machine_line  # noqa: E402

EXPERTS, F, L = 64, 512, 256
MIB = 2**20


def overrides(moe_layers: int) -> dict:
    layers = moe_layers + 1  # first_k_dense_replace = 1: layer 0 is dense
    return {
        "num_hidden_layers": layers,
        "layer_types": ["kda"] * (layers - 1) + ["mla"],
        "num_experts": EXPERTS,
        "moe_intermediate_size": F,
        "routed_expert_hidden_size": L,
        "attn_res": False,
    }


def make_run(directory: str, moe_layers: int) -> None:
    """A run directory as the trainer leaves it: recipe marker, base/, adapter/ (random expert deltas)."""
    import torch
    from peft import get_peft_model

    from moe_plugin.lora import lora_config
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.training.run_dir import MARKER

    recipe = {
        "output_dir": directory,
        "model": {"preset": "tiny", "overrides": overrides(moe_layers)},
        "lora": {
            "r": 4,
            "alpha": 8,
            "target_modules": ["q_proj", "k_proj", "gate"],
            "target_parameters": ["experts.w1", "experts.w2", "experts.w3"],
        },
    }
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny", **overrides(moe_layers)))
    model.save_pretrained(os.path.join(directory, "base"))
    peft_model = get_peft_model(
        model, lora_config(4, 8, recipe["lora"]["target_modules"], recipe["lora"]["target_parameters"])
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(os.path.join(directory, "adapter"))
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(recipe, f)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux)
    return _status_kib("VmRSS")


def child(run_dir: str, what: str) -> None:
    """In a fresh process: the peak-RSS increase (KiB) of the merge alone, or of the whole export."""
    import torch

    from moe_plugin.export import export_run
    from moe_plugin.export.merge import write_merged
    from moe_plugin.export.source import open_run

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as out:  # merged models of every size: removed
        if what == "merge":
            source = open_run(run_dir)
            base = _reset_peak()
            written = write_merged(
                source.base_path, source.hf_config, source.targets, source.state, out, "hf", 5 * 10**9
            )
            layers = written["peak_expert_layers"]
        else:
            base = _reset_peak()
            layers = export_run(run_dir, "merged-hf", os.path.join(out, "x")).peak_expert_layers
        peak_kib = _status_kib("VmHWM") - base
    print(json.dumps({"peak_kib": peak_kib, "peak_expert_layers": layers}))


def measure(run_dir: str, what: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", run_dir, what], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    print(machine_line(2))
    layer_bytes = 3 * EXPERTS * F * L * 4  # w1, w3, w2 of one layer, fp32
    print(f"experts: {EXPERTS} x 3 matrices of {F} x {L} fp32 per MoE layer = {layer_bytes / MIB:.0f} MiB a layer")
    print(
        f"{'MoE layers':>10} {'one layer':>10} {'all experts':>12} {'merge peak':>11} {'/ layer':>8} "
        f"{'/ all':>6} {'held':>5} {'export peak':>12} {'/ all':>6}"
    )
    for moe_layers in (2, 6):
        with tempfile.TemporaryDirectory(prefix="export-bench-run-") as run_dir:
            make_run(run_dir, moe_layers)
            merge, full = measure(run_dir, "merge"), measure(run_dir, "export")
        total = moe_layers * layer_bytes
        peak, whole = merge["peak_kib"] * 1024, full["peak_kib"] * 1024
        print(
            f"{moe_layers:>10} {layer_bytes / MIB:>8.0f}Mi {total / MIB:>10.0f}Mi {peak / MIB:>9.0f}Mi "
            f"{peak / layer_bytes:>8.2f} {peak / total:>6.2f} {merge['peak_expert_layers']:>5} "
            f"{whole / MIB:>10.0f}Mi {whole / total:>6.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
