"""Chat (SFT) data as the field writes it: OpenAI chat messages, rendered with the base's own chat format
(``chat_template``), loss only on the assistant turns (docs/training.md, "Chat data").

A record is ``{"messages": [...], "tools": [...]?, "images": [...]?}``. Messages: ``system``, ``user``,
``assistant`` and ``tool``; ``content`` a string or a list of ``{"type": "text"}`` / ``{"type": "image"}`` /
``{"type": "image_url"}`` parts (an assistant's may be empty or null when it has ``tool_calls``); an assistant's
``reasoning_content`` and ``tool_calls`` (``function.arguments`` a JSON string or an object); a tool's
``tool_call_id`` and ``name``. Images in the content (docs/multimodal.md 2, ``image_data``) are expanded to their
merged tokens, never trained, and travel with the example. A key the chat data does not read, or a field the
base's chat format does not render, is named (``Unrendered``), never dropped silently.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterator, List, Optional, Tuple

from ...config import require
from .images import Images, image_sources, inline_source, load_images, record_has_images
from .records import Example, default_tokenizer, describe, read_records

_ROLES = ("system", "user", "assistant", "tool")
# the message keys the chat data reads; a non-null other key is named, since no template sees it
_KEYS = {"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"}


def _check_tools(at: str, tools) -> Optional[list]:
    """``tools`` as the record (or ``data.tools``) gives it: None or a list of OpenAI tool specs."""
    if tools is None:
        return None
    require(
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance((t.get("function") or t).get("name"), str) for t in tools),
        "data.path" if at != "data.tools" else "data.tools",
        f'{at} must be a list of tools, each {{"type": "function", "function": {{"name": ..., '
        f'"parameters": ...}}}}, got {describe(tools)}',
    )
    return tools


def _check_tool_calls(at: str, calls) -> list:
    require(
        isinstance(calls, list) and len(calls) > 0, "data.path", f"{at} must be a non-empty list, got {describe(calls)}"
    )
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        require(
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and (arguments is None or isinstance(arguments, (str, dict))),
            "data.path",
            f'{at}[{k}] must be {{"id": ..., "type": "function", "function": {{"name": <string>, '
            f'"arguments": <JSON string or object>}}}}, got {describe(call)}',
        )
        out.append({k2: v for k2, v in call.items() if v is not None})
    return out


def _checked_content(at: str, content, inline: List[str]):
    if isinstance(content, list):
        items = []
        for j, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind in ("image", "image_url"):
                source = inline_source(f"{at}.content[{j}]", item)
                inline += [source] if source is not None else []
                items.append({"type": "image"})
                continue
            require(
                kind == "text" and isinstance(item.get("text"), str),
                "data.path",
                f'{at}.content[{j}] must be {{"type": "text", "text": <string>}} or '
                f'{{"type": "image", "image": <path or data URL>}}, got {describe(item)}',
            )
            items.append({"type": "text", "text": item["text"]})
        return items
    # datasets infers one column type for all rows and may coerce mixed contents (e.g. "2." to 2.0)
    hint = (
        (
            "; a file read through datasets needs the same content form (all strings or all lists) "
            "in every message, .jsonl has no such limit"
        )
        if at.startswith("row ")
        else ""
    )
    require(
        isinstance(content, str),
        "data.path",
        f'{at}.content must be a string or a list of {{"type": "text", ...}} items, got {describe(content)}{hint}',
    )
    return content


def _checked_messages(where: str, record, unread: Optional[List[str]] = None) -> Tuple[List[dict], List[str]]:
    """The record's messages in the form the chat format takes (content a string or a list of text/image
    items; reasoning, tool calls, tool ids and names kept where given), and the sources of its inline image
    items in order (``image_data``). Keys the chat data does not read are appended to ``unread``."""
    require(
        isinstance(record, dict),
        "data.path",
        f"{where}: must be a JSON object with a 'messages' list, got {describe(record)}",
    )
    messages = record.get("messages")
    require(
        isinstance(messages, list) and len(messages) > 0,
        "data.path",
        f"{where}: needs a non-empty 'messages' list, got {describe(messages)}",
    )
    checked, inline = [], []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        require(
            isinstance(message, dict) and "role" in message,
            "data.path",
            f"{at} needs a 'role', got {describe(message)}",
        )
        role = message["role"]
        require(role in _ROLES, "data.path", f"{at}.role must be one of {list(_ROLES)}, got {role!r}")
        out = {"role": role}
        calls = message.get("tool_calls")
        if calls is not None:
            require(role == "assistant", "data.path", f"{at}.tool_calls: only an assistant message makes tool calls")
            out["tool_calls"] = _check_tool_calls(f"{at}.tool_calls", calls)
        content = message.get("content")
        if content is None and calls is None:
            require("content" in message, "data.path", f"{at} needs both 'role' and 'content', got {describe(message)}")
            require(
                False,
                "data.path",
                f"{at}.content is null; write the message's text (null is for an assistant with tool_calls)",
            )
        out["content"] = "" if content is None else _checked_content(at, content, inline)
        for key in ("reasoning_content", "tool_call_id", "name"):
            value = message.get(key)
            if value is not None:
                require(isinstance(value, str), "data.path", f"{at}.{key} must be a string, got {describe(value)}")
                out[key] = value
        if role == "assistant":
            require(
                not _is_empty(out["content"]) or "tool_calls" in out or "reasoning_content" in out,
                "data.path",
                f"{at} is an assistant turn with empty content, so it would teach only to end at once; write "
                "the answer (or its tool_calls) or remove the turn",
            )
        if unread is not None:
            unread += [f"messages[{i}].{k}" for k, v in message.items() if k not in _KEYS and v is not None]
        checked.append(out)
    require(
        any(m["role"] == "assistant" for m in checked),
        "data.path",
        f"{where}: has no assistant turn, so nothing would be trained; add an assistant message",
    )
    return checked, inline


class Unrendered:
    """What records held that the chat format did not render or the chat data does not read: one warning (or
    ``describe()`` line) with the count of records, each field name and the first record holding it."""

    def __init__(self):
        self.first = {}
        self.records = 0

    def add(self, where: str, names: List[str]) -> None:
        if names:
            self.records += 1
        for name in names:
            # grouped by field; a message the format leaves out whole by "message"
            field = name.split(".", 1)[1] if "." in name else "message"
            self.first.setdefault(field, (name, where))

    def describe(self) -> str:
        if not self.records:
            return ""
        fields = ", ".join(f"{field} (first: {name} of {where})" for field, (name, where) in self.first.items())
        return (
            f"data.path: {self.records} records hold fields that the base's chat format does not render "
            f"(or the chat data does not read), so they are not trained: {fields}; remove them, or use a base "
            f"whose chat template renders them"
        )

    def warn(self) -> None:
        if self.records:
            warnings.warn(self.describe(), stacklevel=3)


def _is_empty(content) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return all(item["type"] == "text" and not item["text"].strip() for item in content)


def chat_example(
    messages: List[dict],
    tokenizer=None,
    where: str = "messages",
    images: Optional[Images] = None,
    merge_size: int = 2,
    tokens=None,
    *,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
    unrendered: Optional[List[str]] = None,
) -> Example:
    """The chat rendered by the tokenizer's own chat format (``chat_template.tokenize_chat``, with ``tools``
    and ``template_kwargs``): loss only on each assistant turn's body and its end-of-turn tokens. With
    ``images`` (one per image placeholder token of the rendering, in order; a different count raises a
    ValueError), each placeholder becomes its image's ``h * w / merge_size**2`` placeholder tokens, which are
    never trained. ``tokens``: the base's ``ChatTokens`` (default: read from ``tokenizer``; pass them when
    tokenizing many records). Fields the format does not render go to ``unrendered`` (a ValueError if None)."""
    from ...models.base_tokenizer import chat_tokens
    from .chat_template import expand_image_tokens, tokenize_chat

    tokenizer = default_tokenizer(tokenizer)
    tokens = tokens if tokens is not None else chat_tokens(tokenizer, template_kwargs=template_kwargs)
    sizes = images.sizes if images is not None else None
    ids, labels = tokenize_chat(
        tokenizer,
        messages,
        where=f"data.path: {where}",
        tokens=tokens,
        tools=tools,
        template_kwargs=template_kwargs,
        image_sizes=sizes,
        unrendered=unrendered,
    )
    num_images = 0 if images is None else int(images.grid_hw.shape[0])
    image_id = tokens.image_token_id
    require(
        image_id is not None or num_images == 0,
        "data.path",
        f"{where}: holds {num_images} images but the base's tokenizer has no image placeholder token; give "
        "a base with a vision tower and an image token (config.json image_token_id), or drop the images",
    )
    if image_id is not None:
        placeholders = sum(1 for t in ids if t == image_id)
        require(
            placeholders == num_images,
            "data.path",
            f"{where}: the conversation holds {placeholders} {tokens.image_token} placeholders but "
            f"{num_images} images; give exactly one image per placeholder",
        )
        counts = images.tokens_per_image(merge_size) if images is not None else []
        ids, labels = expand_image_tokens(ids, labels, image_id, counts, where=f"data.path: {where}")
    return Example(ids, labels, images, where)


def check_template_kwargs(tokenizer, template_kwargs: Optional[dict], tools: Optional[list] = None) -> None:
    """Refuse ``data.chat_template_kwargs`` (or ``data.tools``) that the base's chat format rejects, naming
    them, before any record is read."""
    from ...models.base_tokenizer import render_ids

    if not template_kwargs and not tools:
        return
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    kwargs = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
    try:
        render_ids(tokenizer, probe, False, **kwargs)
    except Exception as e:  # the template's own refusal (an assert, a raise_exception, a TypeError)
        first = (str(e).strip().splitlines() or [""])[0]
        name = "data.chat_template_kwargs" if template_kwargs else "data.tools"
        raise ValueError(
            f"{name}: the base's chat format rejects {describe(template_kwargs or tools)} "
            f"({type(e).__name__}: {first}); use values its template takes"
        ) from None
    # a switch that changes nothing is misspelt, unread by this template, or its default: say which key
    whole = render_ids(tokenizer, probe, True, **kwargs)
    for key in template_kwargs or {}:
        rest = {k: v for k, v in kwargs.items() if k != key}
        try:
            same = render_ids(tokenizer, probe, True, **rest) == whole
        except Exception:  # the template needs the key: it reads it
            same = False
        if same:
            warnings.warn(
                f"data.chat_template_kwargs: {key}={template_kwargs[key]!r} changes nothing in the base's chat "
                f"format (its default, or a key its template does not read); check the name",
                stacklevel=3,
            )


def iter_sft_examples(
    path: str,
    tokenizer=None,
    processor=None,
    tokens=None,
    *,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
    unrendered: Optional[Unrendered] = None,
) -> Iterator[Example]:
    """Each record of ``path`` (read as a stream, ``records.read_records``) as its ``Example``; ``tools`` is
    the recipe-wide default for records without their own. What records hold that is not rendered is
    collected in ``unrendered``."""
    from ...models.base_tokenizer import chat_tokens

    tokenizer = default_tokenizer(tokenizer)
    check_template_kwargs(tokenizer, template_kwargs, _check_tools("data.tools", tools))
    tokens = tokens if tokens is not None else chat_tokens(tokenizer, processor=processor)
    unrendered = unrendered if unrendered is not None else Unrendered()
    base_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    for where, record in read_records(path):
        names: List[str] = []
        messages, inline = _checked_messages(where, record, names)
        own = _check_tools(f"{where}: tools", record.get("tools"))
        sources = image_sources(where, record, inline)
        if sources and processor is None:
            from ...models.processing import MoEProcessor  # imported late: transformers is slow to import

            processor = MoEProcessor(tokenizer=tokenizer)
        images = load_images(where, sources, base_dir, processor.image_processor) if sources else None
        merge = processor.image_processor.merge_size if processor is not None else 2
        example = chat_example(
            messages,
            tokenizer,
            where,
            images,
            merge,
            tokens,
            tools=own if own is not None else tools,
            template_kwargs=template_kwargs,
            unrendered=names,
        )
        unrendered.add(where, names)
        yield example


def sft_examples(
    path: str,
    tokenizer=None,
    processor=None,
    tokens=None,
    *,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
) -> List[Example]:
    """One OpenAI-format conversation per record, loss only on assistant turns (``iter_sft_examples``);
    images (``image_data``) through ``processor`` (default: a ``MoEProcessor`` around ``tokenizer``);
    ``tokens``: the base's ``ChatTokens`` (default: read from ``tokenizer`` once). Fields not rendered are
    named in one warning."""
    unrendered = Unrendered()
    examples = list(
        iter_sft_examples(
            path, tokenizer, processor, tokens, tools=tools, template_kwargs=template_kwargs, unrendered=unrendered
        )
    )
    unrendered.warn()
    return examples


def has_images(section) -> bool:
    """Whether the recipe's data section (``kind``, ``path``) holds any image, without reading one."""
    return (
        section.kind == "sft"
        and bool(section.path)
        and any(record_has_images(record) for _, record in read_records(section.path))
    )
