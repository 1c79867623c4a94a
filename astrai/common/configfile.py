"""Reading train.yaml: one loader and one error for the host and the trainer alike.

The host tasks (``runtime:`` block) and the trainer (``model:``, ``data:``, ...)
read the same file with the same rules: PyYAML's safe loader, a key written
twice in one mapping is an error rather than a silent overwrite, and a syntax
error names the line and column. Standard library and PyYAML only.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path

import yaml

from astrai.common.errors import AstraiError


class ConfigError(AstraiError):
    """A rejected configuration; ``messages`` are 'FILE: dotted.key: problem' lines, sorted by the caller."""

    exit_code = 2
    prefix = ""

    def __init__(self, messages: str | Iterable[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


def load_yaml(config_path) -> dict:
    """The YAML document of ``config_path`` as a mapping (an empty file is an empty mapping)."""
    try:
        data = Path(config_path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: file not found (pass --config FILE)") from None
    except IsADirectoryError:
        raise ConfigError(f"{config_path}: is a folder, not a YAML file (pass --config FILE)") from None
    except OSError as exc:
        raise ConfigError(f"{config_path}: cannot read: {exc.strerror}") from None
    loader = _UniqueKeyLoader(data)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expansion(config_path, node)
        doc = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_problem(config_path, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config_path}: not readable as YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{config_path}: nested too deeply to be a configuration") from None
    finally:
        loader.dispose()
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{config_path}: expected a mapping of sections (runtime:, model:, ...) at the top level, "
            f"got {type(doc).__name__} {doc!r}"
        )
    return doc


EXPANSION_FLOOR = 10_000
"""Values a document may always expand to through aliases, however few it writes."""
EXPANSION_FACTOR = 20
"""Beyond the floor, aliases may repeat what is written at most this many times over."""


def _check_expansion(config_path, root: yaml.Node) -> None:
    """Refuse a document whose anchors and aliases expand far beyond what it writes (an alias bomb).

    PyYAML builds an alias as a second reference to the same object, so building is cheap, but every
    reader that walks the result (the schema validator, an error message) walks the expansion, which
    grows exponentially with nested aliases. The expanded size is counted on the node graph, each node
    once, before anything is built.
    """
    expanded: dict[int, int] = {}
    referenced: dict[int, int] = {}
    nodes: dict[int, yaml.Node] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
            continue
        referenced[key] = referenced.get(key, 0) + 1
        if key in expanded:
            continue
        if key in on_path:
            mark = node.start_mark
            raise ConfigError(f"{config_path}:{mark.line + 1}: an alias refers to the value that contains it")
        nodes[key] = node
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in expanded)
    total, written = expanded[id(root)], len(nodes)
    if total > max(EXPANSION_FLOOR, EXPANSION_FACTOR * written):
        worst = max((k for k in nodes if referenced[k] > 1), key=lambda k: expanded[k] * referenced[k])
        line = nodes[worst].start_mark.line + 1
        raise ConfigError(
            f"{config_path}:{line}: its anchors and aliases expand {written} written values to {total:,}; "
            "refusing to read it (write the values out instead of nesting aliases)"
        )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def unknown(what: str, name, allowed) -> str:
    """The one hint for an unknown name: ``unknown key; did you mean 'max_steps'?``, else the names allowed."""
    names = [str(choice) for choice in allowed]
    close = difflib.get_close_matches(str(name), names, n=1)
    return f"{what}; did you mean {close[0]!r}?" if close else f"{what}; allowed: {', '.join(sorted(names))}"


def close_match(value, allowed) -> str | None:
    """The allowed name closest to ``value``, if any is close."""
    matches = difflib.get_close_matches(str(value), [str(name) for name in allowed], n=1)
    return matches[0] if matches else None


def show_value(value, limit: int = 60) -> str:
    """``value`` as a user recognises it in a message (JSON-like), cut at about ``limit`` characters.

    Containers are rendered only as far as the limit, so a huge value never costs more than that.
    """
    parts: list[str] = []
    size = 0

    def emit(text: str) -> bool:
        nonlocal size
        parts.append(text)
        size += len(text)
        return size <= limit

    def walk(item) -> bool:
        if isinstance(item, dict):
            if not emit("{"):
                return False
            for index, (key, inner) in enumerate(item.items()):
                if (index and not emit(", ")) or not walk(key) or not emit(": ") or not walk(inner):
                    return False
            return emit("}")
        if isinstance(item, (list, tuple)):
            if not emit("["):
                return False
            for index, inner in enumerate(item):
                if (index and not emit(", ")) or not walk(inner):
                    return False
            return emit("]")
        if isinstance(item, str):
            return emit(json.dumps(item[: limit + 1], ensure_ascii=False))
        try:
            return emit(json.dumps(item, default=str))
        except (TypeError, ValueError):
            return emit(repr(item)[: limit + 1])

    walk(value)
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node, deep=False):
        first_seen = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                first = first_seen.setdefault(key_node.value, key_node)
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key '{key_node.value}' (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(config_path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"{config_path}:{mark.line + 1}:{mark.column + 1}" if mark else str(config_path)
    started = f", which started on line {exc.context_mark.line + 1}" if exc.context_mark and exc.problem_mark else ""
    context = f" ({exc.context}{started})" if exc.context else ""
    return f"{where}: YAML syntax error: {exc.problem}{context}"
