"""Reading train.yaml: one loader and one error for the host and the trainer alike.

The host tasks (``runtime:`` block) and the trainer (``model:``, ``data:``, ...)
read the same file with the same rules: PyYAML's safe loader, a key written
twice in one mapping is an error rather than a silent overwrite, and a syntax
error names the line and column. Standard library and PyYAML only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml


class ConfigError(Exception):
    """A rejected configuration; ``messages`` are 'FILE: dotted.key: problem' lines, sorted by the caller."""

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
    try:
        doc = yaml.load(data, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_problem(config_path, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config_path}: not readable as YAML: {' '.join(str(exc).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{config_path}: expected a mapping of sections (runtime:, model:, ...) at the top level, "
            f"got {type(doc).__name__} {doc!r}"
        )
    return doc


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
