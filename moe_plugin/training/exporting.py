"""What a run leaves for its user: the PEFT adapter (or, for full training, the whole model) and the base's
tokenizer beside it (its files copied byte for byte; the byte tokenizer only for a preset, which has no other).

The adapter directory ``output_dir/adapter`` is what plain peft loads onto the Hugging Face model
(``PeftModel.from_pretrained(MoEPluginForCausalLM.from_pretrained(base), adapter)``): ``adapter_config.json``
(``base_model_name_or_path`` absolute, so it loads from any working directory) and
``adapter_model.safetensors`` with every adapter gathered across expert-parallel and ZeRO ranks, stacked expert
adapters over all ``E`` experts. Full-parameter training writes ``output_dir/model`` in ``save_pretrained``
layout instead (gathered whole on rank 0: for models that fit one process, such as the tiny presets); a LoRA
run over a preset (weights drawn from the seed, no checkpoint) writes that base to ``output_dir/base``.
"""

from __future__ import annotations

import os

from ..fileio import atomic_directory
from ..weights.names import has_vision

__all__ = ["write_outputs"]


def write_outputs(backend, module, recipe, output_dir: str, rank: int) -> str:
    """Gather and write the run's result (collective: every rank calls it); returns a line for the user."""
    if recipe.lora is not None:
        base = backend.base_path
        if base is None:  # a preset built from the seed: keep the base beside the adapter so that it loads
            base = os.path.join(output_dir, "base")
            state = backend.full_state(module)
            if rank == 0:
                _write_model(state, backend.resolved, base)
        state = backend.adapter_state(module)
        path = os.path.join(output_dir, "adapter")
        if rank == 0:
            _write_adapter(state, recipe, backend.resolved, path, base)
        base = os.path.abspath(base)
        if backend.base_path is not None and _model_class(state) == "MoEPluginForCausalLM" and has_vision(base):
            # a text run over an image+text base: the base loads as the image model, the adapter names the text one
            return (
                f"adapter saved to {path} (the text model's names; the base is an image+text model): "
                f"`moe-plugin export --run {output_dir} --to peft OUT` writes it for the base, or load it with "
                f"peft (after `import moe_plugin`) onto the base's language model: PeftModel.from_pretrained("
                f"MoEPluginForConditionalGeneration.from_pretrained({base!r}).language_model, {path!r})"
            )
        return (
            f"adapter saved to {path}; load it with peft (after `import moe_plugin`): PeftModel.from_pretrained("
            f"{_model_class(state)}.from_pretrained({base!r}), {path!r})"
        )
    state = backend.full_state(module)
    path = os.path.join(output_dir, "model")
    if rank == 0:
        _write_model(state, backend.resolved, path)
    return f"model saved to {path}; load it with {_model_class(state)}.from_pretrained({path!r})"


def _model_class(state) -> str:
    """The Hugging Face class whose names the state has: the image model nests the text model."""
    image = any(".language_model." in k or k.startswith("language_model.") for k in state)
    return "MoEPluginForConditionalGeneration" if image else "MoEPluginForCausalLM"


def _write_adapter(state, recipe, resolved, path: str, base_path: str) -> None:
    from safetensors.torch import save_file

    from ..lora import lora_config

    section = recipe.lora
    config = lora_config(section.r, section.alpha, section.target_modules, section.target_parameters, section.dropout)
    config.task_type = "CAUSAL_LM"
    config.inference_mode = True
    config.base_model_name_or_path = os.path.abspath(base_path)
    with atomic_directory(path) as tmp:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(tmp, "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        config.save_pretrained(tmp)
        resolved.save_tokenizer(tmp)


def _write_model(state, resolved, path: str) -> None:
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(resolved.hf_config)
    # what save_pretrained records, and how AutoModelForCausalLM tells an image+text base from a text one (a
    # config may carry a vision tower that a text run never built: the written names decide)
    config.architectures = [_model_class(state)]
    with atomic_directory(path) as tmp:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"},
        )
        config.save_pretrained(tmp)
        resolved.save_tokenizer(tmp)
