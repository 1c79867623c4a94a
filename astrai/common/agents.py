"""The agent keys as written: the tools a job's model may call (``training.tools``), the environment its episodes run
in (``training.environment``), and the limits of an episode (:class:`EpisodeSettings`). Torch-free, so the config,
the run plan, preflight and the trainer read them with the same rules.

An environment is a Python class (``module:Class`` or ``FILE.py:Class``, made once per episode in the trainer's
process) or a server the product starts beside the trainer (``{server: NAME}``, naming
``runtime.environments.NAME``). Loading and calling them is the trainer's (:mod:`astrai.trainer.objectives.agents`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from astrai.common.settings import SettingError

SERVER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
"""A server environment's name: a Compose service, a Kubernetes container and a host name are made of it."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """``training.environment``: a class (``target``) or a server environment (``server``), exactly one."""

    target: str | None = None
    """``module:Class`` or ``FILE.py:Class``."""
    server: str | None = None
    """The name of ``runtime.environments.NAME``."""

    @property
    def name(self) -> str:
        """What metrics and messages call it: the class's name, or the server's."""
        return self.server if self.server is not None else self.target.rpartition(":")[2]

    @property
    def source(self) -> str | None:
        """The class's file (``/data/env.py``) or module; None for a server."""
        return None if self.target is None else self.target.rpartition(":")[0]

    @property
    def is_file(self) -> bool:
        return self.source is not None and self.source.endswith(".py")

    def describe(self) -> str:
        return f"server {self.server}" if self.server is not None else self.target


def _target(value, what: str, kind: str) -> str:
    head, colon, name = str(value).rpartition(":") if isinstance(value, str) else ("", "", "")
    if not colon or not head or not name.isidentifier():
        raise ValueError(f"{what} must be 'FILE.py:{kind}' or 'module:{kind}', got {value!r}")
    return value


def parse_environment(value) -> EnvironmentSpec | None:
    """``training.environment`` as written in YAML; ValueError says what is allowed."""
    if value is None:
        return None
    if isinstance(value, dict):
        if set(value) != {"server"} or not isinstance(value["server"], str):
            raise ValueError(f"expected {{server: NAME}} (a name of runtime.environments), got {value!r}")
        if not SERVER_NAME.match(value["server"]):
            raise ValueError(
                f"server {value['server']!r}: a name of lower-case letters, digits and '-' (at most 40), as "
                "runtime.environments names it"
            )
        return EnvironmentSpec(server=value["server"])
    return EnvironmentSpec(target=_target(value, "an environment", "Class"))


def parse_tools(value) -> tuple[str, ...]:
    """``training.tools`` as written in YAML: a list of ``FILE.py:function`` / ``module:function``."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of 'FILE.py:function' or 'module:function', got {value!r}")
    tools = tuple(_target(entry, f"entry {index}", "function") for index, entry in enumerate(value))
    names = [tool.rpartition(":")[2] for tool in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"two tools named {twice[0]}: the model calls a tool by its name")
    return tools


@dataclass(frozen=True)
class EpisodeSettings:
    """The limits of an episode: past any of them it ends as truncated, with ``truncated_reward``."""

    max_turns: int = 4
    """Assistant turns an episode may take (a turn is a completion of at most max_completion_length tokens)."""
    max_tool_calls: int = 8
    """Tool calls an episode may make, over all its turns."""
    max_episode_tokens: int = 1024
    """Tokens after the prompt: the assistant's turns and the tool and environment replies together."""
    tool_timeout: float = 30.0
    """Seconds a tool call (or an environment's reset, step or reward) may take; past it the call is answered with
    an error message."""
    truncated_reward: float | None = 0.0
    """The reward of an episode a limit ended; null: scored by the rewards like any other."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise SettingError("max_turns", "an integer >= 1", self.max_turns)
        if self.max_tool_calls < 0:
            raise SettingError("max_tool_calls", "an integer >= 0", self.max_tool_calls)
        if self.max_episode_tokens < 1:
            raise SettingError("max_episode_tokens", "an integer >= 1", self.max_episode_tokens)
        if not self.tool_timeout > 0:
            raise SettingError("tool_timeout", "a number of seconds > 0", self.tool_timeout)
        if self.truncated_reward is not None and not math.isfinite(self.truncated_reward):
            raise SettingError("truncated_reward", "a finite number, or null", self.truncated_reward)

    def describe(self) -> str:
        reward = "scored by the rewards" if self.truncated_reward is None else f"reward {self.truncated_reward:g}"
        return (
            f"episodes of at most {self.max_turns} turns, {self.max_tool_calls} tool calls and "
            f"{self.max_episode_tokens} tokens after the prompt; tools time out after {self.tool_timeout:g} s; "
            f"a truncated episode: {reward}"
        )


AGENT_KEYS = (
    "tools",
    "environment",
    "max_turns",
    "max_tool_calls",
    "max_episode_tokens",
    "tool_timeout",
    "truncated_reward",
)
"""The training keys of episodes, which the online train types take."""
