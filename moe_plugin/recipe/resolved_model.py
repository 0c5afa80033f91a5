"""The recipe's model resolved once: where it is, its layout, its configs, and its own tokenizer.

``resolve_model(recipe.model)`` is the one place that reads a base's ``config.json`` and tokenizer; the
trainer, both backends, the held-out answers, the run's ``adapter/`` and the exports take the
``ResolvedModel`` it returns instead of deriving any of it again. A ``model.from_pretrained`` base brings
its own tokenizer (``AutoTokenizer`` on its directory, ``models/base_tokenizer.py``): its chat template,
end-of-turn, eos, pad and image placeholder tokens. Only a preset, which has no directory, uses the
built-in byte tokenizer, and ``tokenizer_note`` says so in one line.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, List, Literal, Optional

from ..config import HF_MODEL_TYPE

__all__ = ["ResolvedModel", "resolve_model", "base_hf_config", "tokenizer_files", "copy_tokenizer_files", "Format"]

Format = Literal["preset", "hf", "k3"]

# What a tokenizer or processor is saved as (transformers' names, K2's tiktoken.model, the template files):
# the files an adapter or export copies from its base, byte for byte
_TOKENIZER_FILE_NAMES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    # not the tokenizer's, but what generate() stops on (K3's eos <|end_of_msg|> is not the tokenizer's eos)
    "generation_config.json",
)


@dataclass(frozen=True)
class ResolvedModel:
    """A recipe's base. ``path``: the real absolute directory (None for a preset); ``format``: "preset",
    "hf" (``save_pretrained`` layout) or "k3"; ``hf_config``: its ``MoEPluginConfig`` with the recipe's
    overrides; ``model_config``: the validated dataclasses; ``tokenizer``: the base's own (the byte tokenizer
    for a preset); ``processor``: a ``MoEProcessor`` around that tokenizer for a base with a vision tower,
    else None; ``tokens``: its ``ChatTokens``."""

    path: Optional[str]
    format: Format
    hf_config: Any
    model_config: Any
    tokenizer: Any
    processor: Any
    tokens: Any
    preset: Optional[str] = None

    @property
    def byte_tokenizer(self) -> bool:
        """Whether the run uses the built-in byte tokenizer (a preset, which ships no tokenizer)."""
        return self.format == "preset"

    @property
    def tokenizer_note(self) -> str:
        """The run's one line on where its tokenizer comes from."""
        if self.byte_tokenizer:
            return (
                f"tokenizer: the built-in byte tokenizer (preset {self.preset!r} has no tokenizer of its own; "
                f"{len(self.tokenizer)} ids)"
            )
        return f"tokenizer: the base's own {type(self.tokenizer).__name__} from {self.path} ({len(self.tokenizer)} ids)"

    def save_tokenizer(self, directory: str) -> List[str]:
        """Write the base's tokenizer into ``directory``: its files copied byte for byte, or for a preset the
        byte tokenizer it trained with. Returns the names written."""
        if self.path is not None:
            return copy_tokenizer_files(self.path, directory)
        before = set(os.listdir(directory)) if os.path.isdir(directory) else set()
        self.tokenizer.save_pretrained(directory)
        return sorted(set(os.listdir(directory)) - before)


def _read_config_json(path: str) -> dict:
    from ..models.base_tokenizer import read_json

    config = read_json(os.path.join(path, "config.json"))
    if config is None:
        raise ValueError(
            f"model.from_pretrained: {path} has no config.json, so it is not a saved model; give "
            f"the directory that save_pretrained wrote (or a K3 checkpoint directory)"
        )
    return config


def _format_of(config_json: dict, path: Optional[str] = None) -> Format:
    """The tensors' layout: "hf" for this project's config.json, or (given ``path``) for a K3 config.json over
    stacked experts (a K3 base written back by save_pretrained: the config keeps K3's layout, the tensors are
    this project's); "k3" otherwise."""
    if config_json.get("model_type") == HF_MODEL_TYPE:
        return "hf"
    from ..weights.names import stores_stacked_experts

    return "hf" if path is not None and stores_stacked_experts(path) else "k3"


def base_hf_config(model_section, config_json: Optional[dict] = None):
    """The ``MoEPluginConfig`` of the recipe's model section (a preset's, or a checkpoint's ``config.json``
    read in either layout), the recipe's overrides applied. ``config_json``: that file's contents if read."""
    from ..models.configuration import MoEPluginConfig
    from ..models.k3_config import config_from_k3
    from ..models.presets import preset_config

    overrides = dict(model_section.overrides)
    if getattr(model_section, "ignore_vision", False):  # the text model: the vision_config is never read
        overrides.update(vision_config=None)
    if model_section.from_pretrained is None:
        return preset_config(model_section.preset, **overrides)
    path = model_section.from_pretrained
    config_json = config_json if config_json is not None else _read_config_json(path)
    if _format_of(config_json) == "hf":
        return MoEPluginConfig.from_pretrained(path, **overrides)
    if "text_config" in config_json and "vision_config" in overrides:  # K3's layout: its own vision_config key
        config_json = {**config_json, "vision_config": overrides.pop("vision_config")}
    return config_from_k3(config_json, **overrides)


def resolve_model(model_section) -> ResolvedModel:
    """The ``ResolvedModel`` of the recipe's ``model`` section. A base without a tokenizer, or whose tokenizer
    or config maps to code in its directory while ``model.trust_remote_code`` is false, is refused with a
    one-line ValueError naming the field and the fix (before anything from the directory runs)."""
    from ..models.base_tokenizer import chat_tokens, check_remote_code, load_base_tokenizer, read_json

    trust = bool(getattr(model_section, "trust_remote_code", False))
    if model_section.from_pretrained is None:
        from ..models.tokenizer import ByteTokenizer

        hf_config = base_hf_config(model_section)
        model_config = hf_config.to_model_config()
        tokenizer = ByteTokenizer()
        processor = _processor(None, tokenizer, model_config)
        tokens = chat_tokens(tokenizer, hf_config.to_dict(), processor)
        return ResolvedModel(
            None, "preset", hf_config, model_config, tokenizer, processor, tokens, model_section.preset
        )
    path = os.path.realpath(os.path.expanduser(model_section.from_pretrained))
    config_json = _read_config_json(path)
    check_remote_code(path, trust)  # config.json's auto_map too, before transformers reads the config
    hf_config = base_hf_config(model_section, config_json)
    model_config = hf_config.to_model_config()
    tokenizer = load_base_tokenizer(path, trust_remote_code=trust)
    processor = _processor(path, tokenizer, model_config)
    # the ids the model embeds: the recipe's overrides win over the file (image_token_id, eos/pad ids)
    ids = {
        k: v
        for k, v in hf_config.to_dict().items()
        if k in ("image_token_id", "eos_token_id", "pad_token_id") and v is not None
    }
    # stop ids: generation_config.json's eos too (K3's <|end_of_msg|>, not the tokenizer's [EOS])
    generation = read_json(os.path.join(path, "generation_config.json"))
    tokens = chat_tokens(tokenizer, {**config_json, **ids}, processor, generation_config=generation)
    _check_vocabulary(path, tokenizer, model_config)
    layout = _format_of(config_json, path)
    return ResolvedModel(path, layout, hf_config, model_config, tokenizer, processor, tokens)


def _processor(path: Optional[str], tokenizer, model_config):
    """A ``MoEProcessor`` around the base's tokenizer for a base with a vision tower (its image processor
    from ``preprocessor_config.json`` when the base has one), else None."""
    if model_config.vision is None:
        return None
    from ..models.image_processing import ImageProcessor
    from ..models.k3_image_processing import load_image_processor
    from ..models.processing import MoEProcessor

    saved = path is not None and os.path.isfile(os.path.join(path, "preprocessor_config.json"))
    # K3's media_proc_cfg or this project's settings, whichever the base saved
    return MoEProcessor(tokenizer, load_image_processor(path) if saved else ImageProcessor())


def _check_vocabulary(path: str, tokenizer, model_config) -> None:
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(
            f"model.from_pretrained: the tokenizer in {path} has {len(tokenizer)} ids but the model's "
            f"vocab_size is {model_config.vocab_size}, so some ids have no embedding; give the base's "
            f"own tokenizer files (or a config.json whose vocab_size covers them)"
        )


def tokenizer_files(path: str) -> List[str]:
    """The names of the tokenizer and processor files in the directory ``path`` (with the code modules a
    remote-code tokenizer's ``auto_map`` names), sorted."""
    if not os.path.isdir(path):
        return []
    names = {n for n in _TOKENIZER_FILE_NAMES if os.path.isfile(os.path.join(path, n))}
    from ..models.base_tokenizer import read_json

    for config_name in ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        if config_name not in names:
            continue
        auto_map = (read_json(os.path.join(path, config_name)) or {}).get("auto_map") or {}
        refs = auto_map.values() if isinstance(auto_map, dict) else auto_map
        for ref in refs:
            for item in ref if isinstance(ref, (list, tuple)) else [ref]:
                module = f"{str(item).split('--')[-1].rsplit('.', 1)[0]}.py" if item else None
                if module and os.path.isfile(os.path.join(path, module)):
                    names.update(_with_relative_imports(path, module))
    return sorted(names)


def _relative_imports(source: str) -> List[str]:
    """The sibling module names a Python source imports relatively (``from .x import y``, ``from . import x``):
    what transformers' remote code loader needs beside the module (K3's tokenization_kimi.py imports
    encoding_k3.py)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.append(node.module.split(".")[0])
            else:
                found.extend(alias.name.split(".")[0] for alias in node.names)
    return found


def _with_relative_imports(path: str, module: str) -> List[str]:
    """``module`` (a .py file in ``path``) and the .py files of ``path`` it imports relatively, transitively."""
    seen, todo = [], [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        with open(os.path.join(path, name), encoding="utf-8", errors="replace") as f:
            source = f.read()
        todo.extend(f"{m}.py" for m in _relative_imports(source) if os.path.isfile(os.path.join(path, f"{m}.py")))
    return seen


def copy_tokenizer_files(base: str, directory: str) -> List[str]:
    """Copy the base's tokenizer files (``tokenizer_files``) into ``directory`` unchanged; returns their names."""
    names = tokenizer_files(base)
    os.makedirs(directory, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(base, name), os.path.join(directory, name))
    return names
