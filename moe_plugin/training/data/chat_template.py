"""A chat record's input ids and labels from the base's own chat template, whatever the template is.

Only ``tokenizer.apply_chat_template`` renders: assistant turn i starts after the rendering of
``messages[:i]`` with the generation prompt and ends with the end-of-turn tokens (``ChatTokens.end_of_turn``)
inside the rendering of ``messages[:i+1]``. Both renderings must be token-wise prefixes of the whole
conversation's rendering; a template for which they are not is refused, since its turns cannot be located.
Image items stay one placeholder token each (the template decides how it renders);
``expand_image_tokens`` then gives each image its number of tokens.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ...models.base_tokenizer import ChatTokens, chat_tokens
from .records import IGNORE


def _render(tokenizer, messages: List[dict], add_generation_prompt: bool, where: str, upto: int) -> List[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
        )
    except Exception as e:  # a template's raise_exception or a Jinja error, on this record's content
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{where}: the chat template fails on messages[:{upto}] ({type(e).__name__}: {first}); "
            f"fix the record or the base's chat template"
        ) from e
    return [int(t) for t in out["input_ids"]]


def _check(where: str, messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: needs a non-empty list of messages, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: messages[{i}] needs both 'role' and 'content', got {message!r}")
        if message["role"] != "assistant":
            continue
        content = message["content"]
        text = (
            content
            if isinstance(content, str)
            else "".join(
                item.get("text", "") for item in content if isinstance(item, dict) and item.get("type") == "text"
            )
            if isinstance(content, list)
            else None
        )
        if text is None or not text.strip():
            raise ValueError(
                f"{where}: messages[{i}] is an assistant turn with no text, so nothing would be "
                f"trained on it; give it the answer or drop the turn"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: has no assistant turn, so nothing would be trained; add an assistant message")


def _end_of(span: List[int], end_of_turn: Sequence[int]) -> int:
    """The length of ``span`` through its last occurrence of ``end_of_turn``, or -1."""
    n = len(end_of_turn)
    for end in range(len(span), n - 1, -1):
        if span[end - n : end] == list(end_of_turn):
            return end
    return -1


def tokenize_chat(
    tokenizer, messages: Sequence[dict], *, where: str, tokens: Optional[ChatTokens] = None
) -> Tuple[List[int], List[int]]:
    """``(input_ids, labels)`` of the conversation rendered by the tokenizer's chat template: labels are the
    ids on each assistant turn's content and its end-of-turn tokens, ``IGNORE`` elsewhere and on image
    placeholders. ``tokens`` (default: ``chat_tokens(tokenizer)``, two renderings; pass it when tokenizing
    many records) gives the end-of-turn and image placeholder ids. Any refusal is a ValueError naming
    ``where`` (e.g. ``data/train.jsonl:12``)."""
    _check(where, messages)
    messages = [dict(m) for m in messages]
    tokens = tokens if tokens is not None else chat_tokens(tokenizer)
    ids = _render(tokenizer, messages, False, where, len(messages))
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, where, i)
        through = _render(tokenizer, messages[: i + 1], False, where, i + 1)
        if ids[: len(before)] != before or ids[: len(through)] != through or len(through) <= len(before):
            raise ValueError(
                f"{where}: the chat template does not render prompts as prefixes (messages[:{i}] with "
                f"the generation prompt, or messages[:{i + 1}], is not the start of the whole "
                f"conversation), so assistant turn {i} cannot be located; use a base whose template "
                f"renders each prompt as a prefix of the conversation"
            )
        end = _end_of(through[len(before) :], tokens.end_of_turn)
        if end < 0:
            raise ValueError(
                f"{where}: messages[{i}] does not end with the template's end-of-turn tokens "
                f"{tokenizer.decode(list(tokens.end_of_turn))!r}; remove them from the content if "
                f"it holds them, or fix the base's chat template"
            )
        labels[len(before) : len(before) + end] = ids[len(before) : len(before) + end]
    if tokens.image_token_id is not None:
        labels = [IGNORE if t == tokens.image_token_id else label for t, label in zip(ids, labels)]
    return ids, labels


def expand_image_tokens(
    input_ids: Sequence[int], labels: Sequence[int], image_token_id: int, tokens_per_image: Sequence[int], *, where: str
) -> Tuple[List[int], List[int]]:
    """Each placeholder ``image_token_id`` in order repeated to its image's count of tokens (labels
    ``IGNORE``); a count of placeholders other than ``len(tokens_per_image)`` is refused naming ``where``."""
    found = sum(1 for t in input_ids if t == image_token_id)
    if found != len(tokens_per_image):
        raise ValueError(
            f"{where}: the conversation holds {found} image placeholders but {len(tokens_per_image)} "
            f"images were given; give exactly one image per image item"
        )
    counts = iter(tokens_per_image)
    out_ids: List[int] = []
    out_labels: List[int] = []
    for t, label in zip(input_ids, labels):
        if t == image_token_id:
            n = next(counts)
            out_ids += [t] * n
            out_labels += [IGNORE] * n
        else:
            out_ids.append(t)
            out_labels.append(label)
    return out_ids, out_labels
