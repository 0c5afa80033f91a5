"""A chat record's input ids and labels from the base's own chat format, whatever the format is.

Only the tokenizer's ``apply_chat_template`` renders, to ids (``base_tokenizer.render_ids``): a Jinja template,
or a tokenizer's own Python (K3's, whose ``chat_template`` is None); the rendered text is never tokenized
again, so text a user types that looks like a control token (``<|open|>``) keeps its plain-text ids. Assistant
turn i starts after the rendering of ``messages[:i]`` with the generation prompt and ends with the last
end-of-turn id (``ChatTokens.end_of_turn[-1]``) inside the rendering of ``messages[:i+1]``; both renderings
must be token-wise prefixes of the whole conversation's rendering (which never has a generation prompt). So
what is labelled is each assistant turn's body as the format writes it, reasoning and tool calls included,
through its end-of-turn tokens, and never the generation prompt: K3's think opener
``<|open|>think<|sep|>`` (part of its generation prompt) is prompt, as at inference.

A field the format does not render (``reasoning_content`` of a history turn in K2.5's template, or in any
template that ignores it; ``tool_calls``) is named (``unrendered``) and left out, never silently dropped.
Image items stay one placeholder token each; ``expand_image_tokens`` then gives each image its tokens.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ...models.base_tokenizer import ChatTokens, chat_tokens, k3_image_prompt, render_ids
from .records import IGNORE

# message fields a template may leave out: each is checked to change the rendering when present
OPTIONAL_FIELDS = ("reasoning_content", "tool_calls")


def _render(tokenizer, messages: List[dict], add_generation_prompt: bool, where: str, upto: int, kwargs) -> List[int]:
    try:
        return render_ids(tokenizer, messages, add_generation_prompt, **kwargs)
    except Exception as e:  # a template's raise_exception or a Jinja error, on this record's content
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{where}: the chat template fails on messages[:{upto}] ({type(e).__name__}: {first}); "
            f"fix the record, the recipe's data.chat_template_kwargs or the base's chat template"
        ) from e


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(i.get("text") or "" for i in content if isinstance(i, dict) and i.get("type") == "text")
    return ""


def _check(where: str, messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: needs a non-empty list of messages, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{where}: messages[{i}] needs a 'role' and its 'content', got {message!r}")
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"{where}: messages[{i}] needs both 'role' and 'content', got {message!r}")
        if message["role"] != "assistant":
            continue
        if not (
            _text_of(message.get("content")).strip() or message.get("tool_calls") or message.get("reasoning_content")
        ):
            raise ValueError(
                f"{where}: messages[{i}] is an assistant turn with no text, so nothing would be "
                f"trained on it; give it the answer (or its tool_calls) or drop the turn"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: has no assistant turn, so nothing would be trained; add an assistant message")


def image_count(message: dict) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for i in content if isinstance(i, dict) and i.get("type") in ("image", "image_url"))


def _last(span: List[int], token: int) -> int:
    """The length of ``span`` through its last ``token``, or -1."""
    return max((k + 1 for k, t in enumerate(span) if t == token), default=-1)


def _same_without(tokenizer, trial: List[dict], whole: List[int], kwargs: dict) -> bool:
    try:
        return render_ids(tokenizer, trial, False, **kwargs) == whole
    except Exception:  # the template needs what was left out (a tool result without its call): it renders it
        return False


def _drop_unrendered(tokenizer, messages: List[dict], whole: List[int], kwargs: dict) -> List[str]:
    """Names of what the whole rendering does not change with: optional fields (``messages[i].field``) and
    whole system or tool messages (``messages[i]``, a template that ignores a role); they are removed from
    ``messages`` in place, so every prefix renders as the whole does. ``kwargs``: the whole's render kwargs."""
    names, unused = [], []
    for i, message in enumerate(messages):
        for name in OPTIONAL_FIELDS:
            if not message.get(name):
                continue
            trial = list(messages)
            trial[i] = {k: v for k, v in message.items() if k != name}
            if _same_without(tokenizer, trial, whole, kwargs):
                names.append(f"messages[{i}].{name}")
                messages[i] = message = trial[i]
        if message["role"] in ("system", "tool") and not image_count(message):
            if _same_without(tokenizer, messages[:i] + messages[i + 1 :], whole, kwargs):
                names.append(f"messages[{i}]")
                unused.append(i)
    for i in reversed(unused):
        del messages[i]
    return names


def tokenize_chat(
    tokenizer,
    messages: Sequence[dict],
    *,
    where: str,
    tokens: Optional[ChatTokens] = None,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
    image_sizes: Optional[Sequence[Tuple[int, int]]] = None,
    unrendered: Optional[List[str]] = None,
) -> Tuple[List[int], List[int]]:
    """``(input_ids, labels)`` of the conversation rendered by the tokenizer's own chat format: labels are the
    ids of each assistant turn's body and its end-of-turn tokens, ``IGNORE`` elsewhere and on image
    placeholders. ``tools`` (OpenAI function specs) and ``template_kwargs`` (e.g. ``thinking``,
    ``thinking_effort``) go to every rendering. ``image_sizes``: each image's original ``(width, height)``,
    for a format that writes images from ``image_prompts`` (``ChatTokens.image_prompts``, K3). ``tokens``
    (default: ``chat_tokens(tokenizer)``; pass it when tokenizing many records) gives the end-of-turn and
    image placeholder ids. Fields the format does not render are appended to ``unrendered`` as
    ``messages[i].field`` (a ValueError when ``unrendered`` is None). Any refusal is a ValueError naming
    ``where`` (e.g. ``data/train.jsonl:12``)."""
    _check(where, messages)
    messages = [dict(m) for m in messages]
    tokens = tokens if tokens is not None else chat_tokens(tokenizer, template_kwargs=template_kwargs)
    base = dict(template_kwargs or {})
    if tools:
        base["tools"] = list(tools)
    counts = [image_count(m) for m in messages]  # images per message: a prefix hands on the prompts of its own
    prompts = None
    if tokens.image_prompts and sum(counts):
        if image_sizes is None or len(image_sizes) != sum(counts):
            raise ValueError(
                f"{where}: the conversation holds {sum(counts)} images but "
                f"{0 if image_sizes is None else len(image_sizes)} image sizes were given; the base's chat "
                f"format writes each image with its size, so give one image per image item"
            )
        prompts = [k3_image_prompt(w, h) for w, h in image_sizes]

    def kwargs_for(upto: int) -> dict:
        return base if prompts is None else {**base, "image_prompts": prompts[: sum(counts[:upto])]}

    ids = _render(tokenizer, messages, False, where, len(messages), kwargs_for(len(messages)))
    dropped = _drop_unrendered(tokenizer, messages, ids, kwargs_for(len(messages)))
    counts = [image_count(m) for m in messages]  # a message left out held no image: only positions move
    if dropped and unrendered is None:
        raise ValueError(
            f"{where}: the base's chat format does not render {', '.join(dropped)}, so it would not be "
            f"trained; remove it from the record or use a base whose chat template renders it"
        )
    if unrendered is not None:
        unrendered.extend(dropped)
    labels = [IGNORE] * len(ids)
    closing = tokens.end_of_turn[-1]
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, where, i, kwargs_for(i))
        through = _render(tokenizer, messages[: i + 1], False, where, i + 1, kwargs_for(i + 1))
        if ids[: len(before)] != before or ids[: len(through)] != through or len(through) <= len(before):
            raise ValueError(
                f"{where}: the chat template does not render prompts as prefixes (messages[:{i}] with "
                f"the generation prompt, or messages[:{i + 1}], is not the start of the whole "
                f"conversation), so assistant turn {i} cannot be located; use a base whose template "
                f"renders each prompt as a prefix of the conversation (a template that writes a turn "
                f"differently once a later turn follows cannot be trained turn by turn)"
            )
        end = _last(through[len(before) :], closing)
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
