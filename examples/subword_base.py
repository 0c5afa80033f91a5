"""Builds the second shipped tiny base, ``recipes/bases/tiny-subword``: its start, its data, its finish.

The base is the ``tiny`` preset without vision over the repo's 240-id BPE (``models/subword_tokenizer.py``). A
preset trains with the byte tokenizer, so the pretrain recipe starts ``from_pretrained`` a directory that
``init`` writes: a freshly initialised model (seeded) beside a byte-identical copy of the tokenizer files.

Text task, like the main job's pictures: "A red square on a blue background." The base learns "What color is
the shape?" (pretrain), the LoRA job "What color is the background?". Both copy a word of the sentence, so
held-out colour/shape combinations are answerable by either question. All files are generated without
randomness; the same call writes the same bytes.

    python -m examples.subword_base data recipes/data
    python -m examples.subword_base init outputs/tiny-subword-init
    OMP_NUM_THREADS=1 .venv/bin/python -m moe_plugin.train --recipe recipes/tiny_subword_pretrain.json
    python -m examples.subword_base finish outputs/tiny-subword/model recipes/bases/tiny-subword
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Dict, List, Tuple

TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "..", "recipes", "bases", "tiny-subword")
COLORS = ("red", "green", "blue", "yellow")
SHAPES = ("square", "circle", "triangle")
SHAPE_QUESTION = "What color is the shape?"
BACKGROUND_QUESTION = "What color is the background?"
# ids of the shipped tokenizer (subword_tokenizer.SPECIAL_TOKENS): [PAD] 0, [BOS] 1, [EOS] 2, <|im_end|> 8,
# <|media_pad|> 12; a chat turn ends with <|im_end|>, so generation stops there or at [EOS]
OVERRIDES = {
    "vocab_size": 240,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": [8, 2],
    "image_token_id": 12,
    "vision_config": None,
}
WEIGHT_FILES = ("model.safetensors", "config.json")


def combinations() -> List[Tuple[str, str, str]]:
    """Every (shape colour, shape, background colour) with the two colours different, in a fixed order."""
    return [(c, s, b) for c in COLORS for s in SHAPES for b in COLORS if b != c]


def split() -> Tuple[List[Tuple[str, str, str]], List[Tuple[str, str, str]]]:
    """(train, held-out): every fourth combination is held out (9 of 36), so no held-out sentence is trained."""
    combos = combinations()
    return [x for i, x in enumerate(combos) if i % 4], [x for i, x in enumerate(combos) if i % 4 == 0]


def record(combo: Tuple[str, str, str], question: str) -> Dict:
    """One chat record: the sentence and the question from the user, the one-word answer from the assistant."""
    color, shape, background = combo
    answer = color if question == SHAPE_QUESTION else background
    return {
        "messages": [
            {"role": "user", "content": f"A {color} {shape} on a {background} background. {question}"},
            {"role": "assistant", "content": answer},
        ]
    }


def write_data(directory: str) -> List[str]:
    """Write the four JSONL files the two recipes read into ``directory``; returns their paths."""
    train, heldout = split()
    files = {
        "subword_shape_train.jsonl": (train, SHAPE_QUESTION),
        "subword_shape_heldout.jsonl": (heldout, SHAPE_QUESTION),
        "subword_background_train.jsonl": (train, BACKGROUND_QUESTION),
        "subword_background_heldout.jsonl": (heldout, BACKGROUND_QUESTION),
    }
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, (combos, question) in files.items():
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record(c, question)) + "\n" for c in combos)
        paths.append(path)
    return paths


def _tokenizer_names(tokenizer_dir: str) -> List[str]:
    return sorted(n for n in os.listdir(tokenizer_dir) if n not in WEIGHT_FILES + ("generation_config.json",))


def write_init(directory: str, tokenizer_dir: str = TOKENIZER_DIR, seed: int = 0) -> str:
    """Write a freshly initialised model (``torch.manual_seed(seed)``) and a copy of the tokenizer files into
    ``directory``, which must not exist yet (nothing is overwritten). Returns ``directory``."""
    import torch

    from moe_plugin.models import MoEPluginForCausalLM
    from moe_plugin.models.presets import preset_config

    if os.path.exists(directory):
        raise ValueError(f"init directory {directory}: already exists; give a new directory (it is never overwritten)")
    torch.manual_seed(seed)
    model = MoEPluginForCausalLM(preset_config("tiny", **OVERRIDES))
    model.save_pretrained(directory)
    for name in _tokenizer_names(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(directory, name))
    return directory


def finish(model_dir: str, base_dir: str = TOKENIZER_DIR) -> None:
    """Copy a trained model's weights and config into ``base_dir`` and write its generation config; the
    tokenizer files already there are left as they are."""
    from transformers import GenerationConfig, PretrainedConfig

    for name in WEIGHT_FILES:
        src = os.path.join(model_dir, name)
        if not os.path.isfile(src):
            raise ValueError(
                f"model directory {model_dir}: has no {name}; give the run's model/ directory "
                f"(outputs/tiny-subword/model after the pretrain recipe)"
            )
        shutil.copyfile(src, os.path.join(base_dir, name))
    config = PretrainedConfig.from_json_file(os.path.join(base_dir, "config.json"))
    GenerationConfig.from_model_config(config).save_pretrained(base_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.subword_base",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("data").add_argument("directory")
    sub.add_parser("init").add_argument("directory")
    p = sub.add_parser("finish")
    p.add_argument("model_dir")
    p.add_argument("base_dir")
    args = parser.parse_args(argv)
    if args.command == "data":
        print("\n".join(write_data(args.directory)))
    elif args.command == "init":
        print(write_init(args.directory))
    else:
        finish(args.model_dir, args.base_dir)


if __name__ == "__main__":
    main()
