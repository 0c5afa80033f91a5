"""pydantic's validation errors turned into what a recipe's author can act on: the field's dotted path, what is
wrong and what would fix it (the schema itself is ``recipe.py``)."""

from __future__ import annotations

import difflib
import inspect
import json
from typing import Any, Dict, List, Literal, Optional, Tuple, get_args, get_origin

from pydantic import BaseModel, ValidationError

__all__ = ["describe_errors"]


def describe_errors(err: ValidationError, root: type) -> List[Tuple[str, str]]:
    """``[(dotted.path, "<what is wrong>; <what would fix it>")]`` for every error of validating ``root``."""
    return [(_dotted(e["loc"]), _describe(root, e)) for e in err.errors()]


def _model_in(annotation: Any) -> Optional[type]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _model_at(root: type, loc: Tuple) -> Optional[type]:
    model: Optional[type] = root
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a JSON object"
    kind = {bool: "a bool", int: "an int", float: "a float", str: "a str"}.get(type(value), type(value).__name__)
    shown = json.dumps(value) if isinstance(value, bool) else repr(value)
    return f"{shown[:60]} ({kind})"


_TYPE_ERRORS = {
    "int_type": ("an integer", "write a whole number without quotes"),
    "float_type": ("a number", "write a number without quotes"),
    "bool_type": ("true or false", "write true or false without quotes"),
    "string_type": ("a string", "write it in double quotes"),
    "list_type": ("a list", "use a list"),
}


def _describe(root: type, error: Dict[str, Any]) -> str:
    """pydantic's error as "<what is wrong>; <what would fix it>" for the recipe's author."""
    kind, loc, value, ctx = error["type"], error["loc"], error.get("input"), error.get("ctx") or {}
    owner = _model_at(root, loc[:-1]) if loc else None
    info = owner.model_fields.get(loc[-1]) if owner is not None and loc[-1] in owner.model_fields else None
    extra = info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}
    default = info.get_default(call_default_factory=True) if info is not None and not info.is_required() else None
    example = extra.get("example", default)
    example = "" if example is None else ", e.g. " + json.dumps(example, default=lambda _: "{...}")
    if kind == "recipe":
        return ctx["message"]
    if kind == "extra_forbidden":
        allowed = sorted(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, 1)
        return f"unknown key; allowed keys are {allowed}" + (f"; did you mean {close[0]!r}?" if close else "")
    if kind in ("missing", "string_too_short"):
        return ("is required; " if kind == "missing" else "is empty; ") + extra.get("fix", "add it")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if not loc:
            return f'must be a JSON object of sections, got {_show(value)}; write it as {{"output_dir": ...}}'
        null = ", or null to train every parameter" if loc == ("lora",) else ""
        return (
            f'must be a JSON object, got {_show(value)}; write it as {{"key": value, ...}} ({{}} for the '
            f"defaults{null})"
        )
    if kind in _TYPE_ERRORS:
        wanted, fix = _TYPE_ERRORS[kind]
        return f"must be {wanted}, got {_show(value)}; {fix}{example if kind != 'bool_type' else ''}"
    if kind == "literal_error":
        choices = (
            [json.dumps(c) for c in get_args(info.annotation)]
            if info is not None and get_origin(info.annotation) is Literal
            else [ctx.get("expected", "")]
        )
        return f"must be one of {', '.join(choices)}, got {_show(value)}; choose one of them"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        bound = next(iter(ctx.values()), "")
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # "> 0", not "> 0.0"
        return f"must be {bounds[kind]} {bound}, got {value!r}; " + extra.get("fix", "change the value")
    return error["msg"]


def _dotted(loc: Tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "recipe"
