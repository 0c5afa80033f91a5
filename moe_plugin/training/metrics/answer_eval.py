"""Held-out answers by greedy generation (docs/main-job.md): what a user sees of a fine-tune, not its loss.

Each held-out record is a chat (``{"messages": [user, assistant]}``, images inline or listed, as the SFT data
reads) whose last assistant turn is the expected answer. The prompt (every message before it, with the
generation prompt, rendered by the base's own chat template) goes to the Hugging Face model's ``generate``
with greedy decoding, which stops at the base's stop tokens (``ChatTokens.stop_ids``: its eos and end of
turn) or after ``max_new_tokens``; the answer is the decoded new tokens without special tokens, stripped of
surrounding white space, and it counts when it equals the expected answer exactly.

``report_answers`` is what the trainer calls at the end of a run whose recipe has ``eval.answers``: every rank
loads the base and the run's adapter as a user would (plain peft), answers its share of the held-out records
with the adapter disabled ("before": the base) and enabled ("after"), the counts are summed over the ranks
(so every rank makes the same collectives), and rank 0 prints the chance level, one line
``held-out accuracy: before X after Y`` and how to load the adapter, and writes ``answers.json``.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ...compat.peft import quiet_wrapping
from ...config import require

__all__ = [
    "Question",
    "read_questions",
    "answer",
    "accuracy",
    "chance_level",
    "load_adapted",
    "report_answers",
    "loading_hint",
]


@dataclass
class Question:
    """One held-out record: the prompt's messages, its images (PIL, in placeholder order), the expected answer
    and where it comes from (file and line, for messages)."""

    messages: List[dict]
    images: list
    expected: str
    where: str


def read_questions(path: str, limit: Optional[int] = None) -> List[Question]:
    """The records of a chat JSONL file as questions (at most ``limit``); each must end with an assistant turn
    holding a string, the expected answer."""
    from ..data.chat import _checked_messages
    from ..data.records import read_records as _records
    from ..data.images import image_sources, open_image

    base_dir, questions = os.path.dirname(os.path.abspath(path)), []
    for where, record in _records(path):
        messages, inline = _checked_messages(where, record)
        last = messages[-1]
        require(
            last["role"] == "assistant" and isinstance(last["content"], str),
            "eval.answers.path",
            f"{where}: the last message must be the assistant's answer as a string, got "
            f"{last['role']!r} with {type(last['content']).__name__} content; end each record with "
            '{"role": "assistant", "content": "<answer>"}',
        )
        images = [open_image(where, s, base_dir) for s in image_sources(where, record, inline)]
        questions.append(Question(messages[:-1], images, last["content"].strip(), where))
        if limit is not None and len(questions) == limit:
            break
    require(len(questions) > 0, "eval.answers.path", f"{path} holds no records; add held-out chats")
    return questions


@torch.no_grad()
def answer(model, processor, question: Question, max_new_tokens: int = 16, tokens=None) -> str:
    """The model's greedy answer to ``question``: new tokens up to a stop token, decoded without special
    tokens, stripped. ``processor``: a ``MoEProcessor`` (needed for images) or a bare tokenizer; ``tokens``:
    the base's ``ChatTokens``, whose stop ids (eos and end of turn) and pad id generation then uses (default:
    the model's generation config)."""
    from ..data.chat_template import expand_image_tokens

    from ...models.base_tokenizer import k3_image_prompt, render_ids

    tokenizer = getattr(processor, "tokenizer", processor)
    # the tokenizer's own rendering in whatever shape it returns (K3's is a batch of one); a format that writes
    # each image from its size (K3's) is handed the images' prompts, as K3's processor does
    kwargs = {}
    if question.images and tokens is not None and tokens.image_prompts:
        kwargs["image_prompts"] = [k3_image_prompt(*image.size) for image in question.images]
    ids = render_ids(tokenizer, question.messages, True, **kwargs)
    inputs = {}
    if question.images:
        from ...models.image_tokens import tokens_per_image
        from ...models.k3_image_processing import image_outputs  # either processor's names (K3's pixel_values)

        pixels, grid = image_outputs(processor.image_processor(question.images, return_tensors="pt"))
        image_id = tokens.image_token_id if tokens is not None else processor.image_token_id
        counts = tokens_per_image(grid, processor.image_processor.merge_size)
        ids, _ = expand_image_tokens(ids, ids, image_id, counts, where=question.where)
        inputs = {"pixel_patches": pixels, "grid_hw": grid}
    inputs["input_ids"] = torch.tensor([ids], dtype=torch.int64)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    stops = {} if tokens is None else {"eos_token_id": list(tokens.stop_ids), "pad_token_id": tokens.pad_id}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **stops)
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def accuracy(
    model, processor, questions: Sequence[Question], max_new_tokens: int = 16, tokens=None
) -> Tuple[int, List[str]]:
    """(exact answers, the answers given) over ``questions``."""
    given = [answer(model, processor, q, max_new_tokens, tokens) for q in questions]
    return sum(g == q.expected for g, q in zip(given, questions)), given


def chance_level(expected: Sequence[str]) -> float:
    """The accuracy of always giving the most common expected answer (the best a guess without the image gets,
    since the question's text is the same for every record)."""
    require(len(expected) > 0, "expected", "needs at least one answer")
    return collections.Counter(expected).most_common(1)[0][1] / len(expected)


def _remote_tokenizer(adapter: str) -> bool:
    """Whether the tokenizer copied beside the adapter is remote code (an ``auto_map``, as K3's is)."""
    try:
        with open(os.path.join(adapter, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


def loading_hint(base: str, adapter: str, images: bool) -> str:
    """How a user loads the adapter with plain peft (``import moe_plugin`` registers the Auto classes); a
    remote-code tokenizer (K3's ``tokenization_kimi.py``, copied beside the adapter) needs trust_remote_code."""
    auto = "AutoModelForImageTextToText" if images else "AutoModelForCausalLM"
    trust = ", trust_remote_code=True" if _remote_tokenizer(adapter) else ""
    return (
        f"load it with plain peft:\n"
        f"    import moe_plugin  # registers the Auto classes\n"
        f"    from peft import PeftModel\n"
        f"    from transformers import {auto}, AutoTokenizer\n"
        f"    model = PeftModel.from_pretrained({auto}.from_pretrained({base!r}), {adapter!r})\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({adapter!r}{trust})  # the base's tokenizer and chat template"
        + ("\n    processor = moe_plugin.MoEProcessor(tokenizer)  # its images" if images else "")
    )


def load_adapted(base: str, adapter: str, images: bool):
    """The base (``images``: the image+text model) with the adapter of ``adapter`` through plain peft, eval mode."""
    from peft import PeftModel

    from ...models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration

    model_class = MoEPluginForConditionalGeneration if images else MoEPluginForCausalLM
    base_model = model_class.from_pretrained(base)
    with quiet_wrapping():
        return PeftModel.from_pretrained(base_model, adapter).eval()


def _load_run(output_dir: str, images: bool):
    """(model, base path, adapter path or None) of a finished run: its adapter over its base, or for full
    training the model it wrote."""
    adapter = os.path.join(output_dir, "adapter")
    if os.path.isdir(adapter):
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            base = json.load(f)["base_model_name_or_path"]
        return load_adapted(base, adapter, images), base, adapter
    from ...models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration

    path = os.path.join(output_dir, "model")
    model_class = MoEPluginForConditionalGeneration if images else MoEPluginForCausalLM
    return model_class.from_pretrained(path).eval(), path, None


def _in_file_order(parts: List[List[str]], n: int) -> List[str]:
    # rank r answered records r, r + world, r + 2 * world, ...
    out: List[Optional[str]] = [None] * n
    for r, given in enumerate(parts):
        for j, g in enumerate(given):
            out[r + j * len(parts)] = g
    return out


def report_answers(section, output_dir: str, rank: int, world_size: int, device=None, resolved=None) -> Optional[dict]:
    """Held-out accuracy of the run in ``output_dir`` (collective: every rank calls it once the run's outputs
    are written): with an adapter, "before" (adapter disabled: the base) and "after"; for full training, the
    written model ("after" only). ``section`` is the recipe's ``eval.answers``. Returns the record written to
    ``output_dir/answers.json`` on rank 0, None elsewhere. ``resolved``: the run's ``ResolvedModel``, whose
    tokenizer, processor and stop tokens the answers use (default: the byte tokenizer of the presets)."""
    import torch.distributed as dist

    from ...fileio import write_json_atomic
    from ...models import MoEProcessor

    dist.barrier()  # rank 0 has written the outputs
    questions = read_questions(section.path, section.limit)
    images = any(q.images for q in questions)
    model, base, adapter = _load_run(output_dir, images)
    if device is not None:
        model.to(device)
    if resolved is None:
        processor, tokens = MoEProcessor(), None
    else:
        processor, tokens = resolved.processor or resolved.tokenizer, resolved.tokens
    mine = questions[rank::world_size]
    before, before_given = 0, []
    if adapter is not None:
        with model.disable_adapter():
            before, before_given = accuracy(model, processor, mine, section.max_new_tokens, tokens)
    after, after_given = accuracy(model, processor, mine, section.max_new_tokens, tokens)
    counts = torch.tensor([before, after], dtype=torch.float64)
    dist.all_reduce(counts)
    parts: List = [None] * world_size
    dist.all_gather_object(parts, (before_given, after_given))
    if rank != 0:
        return None
    n, expected = len(questions), [q.expected for q in questions]
    record = {
        "examples": n,
        "chance": chance_level(expected),
        "after": float(counts[1]) / n,
        "before": float(counts[0]) / n if adapter is not None else None,
        "distinct_answers": sorted(set(expected)),
        "expected": expected,
        "given_after": _in_file_order([p[1] for p in parts], n),
        "given_before": _in_file_order([p[0] for p in parts], n) if adapter is not None else None,
        "model": base,
        "adapter": adapter,
    }
    write_json_atomic(os.path.join(output_dir, "answers.json"), record)
    print(
        f"chance level: {record['chance']:.2f} (always the most common of {len(set(expected))} answers, "
        f"{n} held-out examples)",
        flush=True,
    )
    if adapter is None:
        print(f"held-out accuracy: {record['after']:.2f} ({path_note(base)})", flush=True)
    else:
        print(f"held-out accuracy: before {record['before']:.2f} after {record['after']:.2f}", flush=True)
        print(f"adapter: {adapter}; " + loading_hint(base, adapter, images), flush=True)
    return record


def path_note(path: str) -> str:
    return f"the model written to {path}"
