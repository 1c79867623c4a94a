"""A Python function as a tool a chat template shows the model: its JSON schema, from its signature and docstring.

The schema is the one ``transformers.utils.get_json_schema`` makes, so a chat template renders our tools as it renders
the library's (``apply_chat_template(messages, tools=...)``)::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {"type": "object",
     "properties": {NAME: {"type": ..., "description": ...}}, "required": [...]}, "return": {...}}}

The docstring is Google-style: the description, then ``Args:`` with a ``name: description`` line per parameter
(continued on indented lines; a trailing ``(choices: [...])`` in JSON becomes the parameter's ``enum``), then
``Returns:``. Every parameter needs a type hint and a description: a tool the model cannot read is refused with
:class:`ToolSchemaError`, naming the function and what it lacks. Types map as JSON Schema has them: ``str`` string,
``int`` integer, ``float`` number, ``bool`` boolean, ``None`` null, ``list[X]`` an array of X, ``tuple[X, Y]`` an array
of those items, ``dict[str, X]`` an object of X, ``Literal[...]`` an enum, ``X | None`` nullable, a union of several a
list of types, ``Any`` no type. Torch-free.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable

_SECTION = re.compile(r"^\s*(Args|Returns|Raises):\s*$")
_ARGUMENT = re.compile(r"^(\s*)(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE | re.DOTALL)
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


class ToolSchemaError(ValueError):
    """A function whose schema cannot be made (no docstring, a parameter without a type hint or a description)."""


def json_schema(function: Callable, name: str | None = None) -> dict:
    """The tool schema of ``function`` (a bound method leaves ``self`` out), named ``name`` (default: its own)."""
    name = name or function.__name__
    doc = inspect.getdoc(function)
    if not doc:
        raise ToolSchemaError(f"tool {name}: it has no docstring; say what it does and describe every argument")
    description, arguments, returns = _sections(doc)
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # the user's annotations: any error of theirs
        raise ToolSchemaError(f"tool {name}: its type hints cannot be read ({type(error).__name__}: {error})") from None
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {name}: *{parameter.name} cannot be shown to the model; name each argument")
        if parameter.name not in hints:
            raise ToolSchemaError(f"tool {name}: argument {parameter.name} has no type hint")
        if parameter.name not in arguments:
            raise ToolSchemaError(
                f"tool {name}: its docstring describes no argument {parameter.name} (under Args:, "
                f"'{parameter.name}: what it is')"
            )
        schema = _type_schema(hints[parameter.name], name)
        text = arguments[parameter.name]
        choices = _CHOICES.search(text)
        if choices:
            try:
                schema["enum"] = json.loads(choices.group(1))
            except ValueError:
                raise ToolSchemaError(
                    f"tool {name}: argument {parameter.name}'s (choices: ...) is not a JSON list"
                ) from None
            text = text[: choices.start()].strip()
        properties[parameter.name] = {**schema, "description": text}
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    parameters: dict = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    schema = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        schema["return"] = _type_schema(hints["return"], name)
        if returns:
            schema["return"]["description"] = returns
    return {"type": "function", "function": schema}


def _sections(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(the description, each argument's description, the return's description) of a Google-style docstring."""
    lines = doc.splitlines()
    parts: dict[str, list[str]] = {"": []}
    section = ""
    for line in lines:
        found = _SECTION.match(line)
        if found:
            section = found.group(1)
            parts[section] = []
            continue
        parts[section].append(line)
    description = "\n".join(parts[""]).strip()
    returns = "\n".join(parts.get("Returns", [])).strip() or None
    return description, _arguments(parts.get("Args", [])), returns


def _arguments(lines: list[str]) -> dict[str, str]:
    """``name: description`` entries, each continued by the lines indented deeper than its name."""
    found: dict[str, list[str]] = {}
    current, indent = None, 0
    for line in lines:
        match = _ARGUMENT.match(line)
        if match and (current is None or len(match.group(1)) <= indent):
            current, indent = match.group(2), len(match.group(1))
            found[current] = [match.group(3).strip()]
        elif current is not None and line.strip():
            found[current].append(line.strip())
    return {name: " ".join(part for part in text if part) for name, text in found.items()}


def _type_schema(hint, tool: str) -> dict:
    """The JSON Schema of a type hint."""
    if hint is typing.Any:
        return {}
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = sorted({_SIMPLE.get(type(value), "string") for value in arguments})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(arguments)}
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in arguments
        members = [_type_schema(argument, tool) for argument in arguments if argument is not type(None)]
        if len(members) == 1:
            schema = dict(members[0])
        elif all(set(member) == {"type"} and isinstance(member["type"], str) for member in members):
            schema = {"type": [member["type"] for member in members]}
        else:
            schema = {"anyOf": members}
        if nullable:
            schema["nullable"] = True
        return schema
    if hint is list or origin is list:
        return {"type": "array", **({"items": _type_schema(arguments[0], tool)} if arguments else {})}
    if hint is tuple or origin is tuple:
        if not arguments:
            return {"type": "array"}
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(arguments[0], tool)}
        return {"type": "array", "prefixItems": [_type_schema(argument, tool) for argument in arguments]}
    if hint is dict or origin is dict:
        if len(arguments) == 2:
            return {"type": "object", "additionalProperties": _type_schema(arguments[1], tool)}
        return {"type": "object"}
    raise ToolSchemaError(
        f"tool {tool}: the type {hint!r} has no JSON Schema; use str, int, float, bool, list, tuple, dict, Literal, "
        "Any, or a union of them"
    )
