"""The environment an episode runs in (``training.environment``): a class in the trainer's process, or a server
beside it.

- **A class** (``module:Class`` or ``FILE.py:Class``, TRL's ``environment_factory`` shape): one instance per episode.
  ``reset(**fields)`` starts the episode with the prompt record's fields (those its signature names, or all of them
  and ``prompt``, the prompt's messages, for ``**kwargs``; ``seed``, the episode's, when it names one) and may return
  an observation, text added to the prompt's last message. Its public methods are tools; the state they share lives
  in the instance. An optional ``reward()`` scores the episode when it ends (a number, or None: does not apply).
- **A server** (``{server: NAME}``): an OpenEnv-compatible server (``runtime.environments.NAME``) the product starts
  beside the trainer, whose address the host gives in ``ASTRAI_ENVIRONMENTS``. Each episode is a session of OpenEnv's
  own client (``openenv-core``'s ``GenericEnvClient``, over its WebSocket): ``reset(seed, **fields)``, then a step per
  call of its one tool, named NAME, whose parameters are the server's action schema (``GET /schema``). Its
  observations are the tool messages; the episode ends when the server says it is done, and its reward is the sum of
  the rewards its steps gave (None when none gave one).

An environment that cannot start an episode or score one (its reset or reward raises, or runs past
``training.tool_timeout``, a server that cannot be reached) stops the run with :class:`AgentError` naming it; a call
that fails is a tool message (:mod:`astrai.trainer.objectives.agents.tools`).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from astrai.common.agents import EnvironmentSpec
from astrai.common.contract import ENV_ENVIRONMENTS, OPENENV_PACKAGE
from astrai.data.tool_calls import ToolCall
from astrai.data.tool_schemas import ToolSchemaError, json_schema
from astrai.trainer.objectives.agents.tools import (
    TOOL_ERROR,
    AgentError,
    Outcome,
    Tool,
    answer,
    content_of,
    run_limited,
)
from astrai.trainer.objectives.rewards import user_object

RESERVED = ("reset", "reward", "close")
SERVER_START_SECONDS = 120
"""How long the trainer waits for a server environment that is still starting (its image's start-up)."""
"""Public methods of an environment class that are not tools."""


@dataclass(frozen=True)
class Limits:
    """What bounds the environment's calls: ``training.tool_timeout``, and what tells that a stop was asked for."""

    timeout: float
    stop_requested: object = lambda: False


@dataclass
class Episode:
    """One episode's environment: its tools, what its reset said, whether it has ended, and its reward."""

    observation: str | None = None
    done: bool = False
    """The environment ended the episode (a server that said it is done)."""
    rewards: list[float] = field(default_factory=list)

    def call(self, call: ToolCall, limits: Limits) -> Outcome | None:
        """The answer of a call to one of the environment's tools; None for a call it has no tool for."""
        return None

    def reward(self, limits: Limits) -> float | None:
        return None

    def close(self) -> None:
        """Release what the episode holds (a server's session)."""


class ClassEnvironment:
    """A Python class, one instance per episode."""

    def __init__(self, spec: EnvironmentSpec):
        self.spec = spec
        self.factory = user_object(spec.target, "environment", "class", AgentError)
        methods = dict(inspect.getmembers(self.factory, inspect.isfunction))
        if "reset" not in methods:
            raise AgentError(f"environment {spec.target}: it has no reset method (reset(**fields) starts an episode)")
        self.has_reward = "reward" in methods
        probe = self._instance()
        self.tools = []
        for name in sorted(name for name in methods if not name.startswith("_") and name not in RESERVED):
            try:
                self.tools.append(Tool(name, json_schema(getattr(probe, name))))
            except ToolSchemaError as error:
                raise AgentError(f"environment {spec.target}: {error}") from None
        self.reset_parameters = inspect.signature(probe.reset).parameters

    @property
    def name(self) -> str:
        return self.spec.name

    def _instance(self):
        try:
            return self.factory()
        except Exception as error:  # the user's code: any error of it is reported as theirs
            raise AgentError(
                f"environment {self.spec.target}: making an instance raised {type(error).__name__}: {error}"
            ) from None

    def open(self, seed: int, fields: dict, messages: list[dict], limits: Limits) -> Episode:
        instance = self._instance()
        arguments = reset_arguments(self.reset_parameters, fields, messages, seed)
        value, failure = run_limited(
            lambda: instance.reset(**arguments), limits.timeout, limits.stop_requested, "reset"
        )
        if failure is not None:
            raise AgentError(f"environment {self.spec.target}: {failure} (record fields {_short(fields)})")
        if value is not None and not isinstance(value, str):
            raise AgentError(
                f"environment {self.spec.target}: reset returned a {type(value).__name__}; it returns the opening "
                "observation as text, or None"
            )
        return ClassEpisode(value, instance=instance, environment=self)


@dataclass
class ClassEpisode(Episode):
    instance: object = None
    environment: ClassEnvironment | None = None

    def call(self, call: ToolCall, limits: Limits) -> Outcome | None:
        names = [tool.name for tool in self.environment.tools]
        if call.name not in names:
            return None
        method = getattr(self.instance, call.name)
        return answer(method, call, names, limits.timeout, limits.stop_requested)

    def reward(self, limits: Limits) -> float | None:
        if not self.environment.has_reward:
            return None
        what = f"environment {self.environment.spec.target}"
        value, failure = run_limited(self.instance.reward, limits.timeout, limits.stop_requested, "reward")
        if failure is not None:
            raise AgentError(f"{what}: {failure}")
        return checked_reward(value, what)


def reset_arguments(parameters, fields: dict, messages: list[dict], seed: int) -> dict:
    """What ``reset`` is called with: the record's fields and ``prompt`` (its messages), those its signature names
    (all of them for ``**kwargs``), and ``seed`` when it names one and the record has none."""
    anything = any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    given = {**fields, "prompt": messages}
    if "seed" in parameters and "seed" not in fields:
        given["seed"] = seed
    return given if anything else {key: value for key, value in given.items() if key in parameters}


def checked_reward(value, what: str) -> float | None:
    """An environment's reward as rewards are taken: None, a bool (0 or 1), or a finite number."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise AgentError(
            f"{what}: reward() gave {value!r}; it must be a finite number, or None where it does not apply"
        )
    return float(value)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ServerEnvironment:
    """An OpenEnv-compatible server beside the trainer, one session of OpenEnv's client per episode."""

    has_reward = True

    def __init__(self, spec: EnvironmentSpec, limits: Limits, addresses: dict[str, str] | None = None):
        self.spec = spec
        addresses = environment_addresses() if addresses is None else addresses
        if spec.server not in addresses:
            raise AgentError(
                f"training.environment {{server: {spec.server}}}: the trainer was given no address for it "
                f"({ENV_ENVIRONMENTS} names {', '.join(sorted(addresses)) or 'none'}); `invoke start` starts it from "
                f"runtime.environments.{spec.server}; a trainer run by hand needs "
                f'{ENV_ENVIRONMENTS}=\'{{"{spec.server}": "http://HOST:PORT"}}\''
            )
        self.url = addresses[spec.server].rstrip("/")
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as error:
            raise AgentError(
                f"training.environment {{server: {spec.server}}}: OpenEnv's client cannot be imported ({error}); the "
                f"image installs {OPENENV_PACKAGE} for a job with a server environment (pip install {OPENENV_PACKAGE})"
            ) from None
        self.client_class = GenericEnvClient
        self.tools = [Tool(spec.server, self._schema(limits))]

    @property
    def name(self) -> str:
        return self.spec.server

    def _schema(self, limits: Limits) -> dict:
        """The server's action, as the one tool the model calls; a server still starting is waited for (up to
        :data:`SERVER_START_SECONDS`)."""
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/schema", timeout=limits.timeout) as response:
                    action = json.loads(response.read().decode("utf-8"))["action"]
                break
            except (OSError, urllib.error.URLError) as error:
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                problem = f"it does not answer GET /schema ({error}) after {SERVER_START_SECONDS} s"
            except (ValueError, KeyError, TypeError) as error:
                problem = f"its answer to GET /schema has no action schema ({type(error).__name__}: {error})"
            raise AgentError(
                f"environment server {self.spec.server} at {self.url}: {problem}; is it an OpenEnv server, and running?"
            ) from None
        properties = {key: value for key, value in action.get("properties", {}).items() if key != "metadata"}
        parameters: dict = {"type": "object", "properties": properties}
        required = [key for key in action.get("required", []) if key in properties]
        if required:
            parameters["required"] = required
        description = action.get("description") or f"Act in the environment {self.spec.server}."
        return {
            "type": "function",
            "function": {"name": self.spec.server, "description": description, "parameters": parameters},
        }

    def open(self, seed: int, fields: dict, messages: list[dict], limits: Limits) -> Episode:
        what = f"environment server {self.spec.server} at {self.url}"
        client = self.client_class(
            base_url=self.url, connect_timeout_s=limits.timeout, message_timeout_s=limits.timeout
        )
        session = client.sync()
        result, failure = run_limited(
            lambda: (session.connect(), session.reset(seed=seed, **fields))[1],
            limits.timeout,
            limits.stop_requested,
            "reset",
        )
        if failure is not None:
            session.close()
            raise AgentError(f"{what}: {failure}")
        episode = ServerEpisode(content_of(result.observation), bool(result.done), session=session, environment=self)
        episode.add(result.reward, what)
        return episode


@dataclass
class ServerEpisode(Episode):
    session: object = None
    environment: ServerEnvironment | None = None

    def add(self, reward, what: str) -> None:
        value = checked_reward(reward, what)
        if value is not None:
            self.rewards.append(value)

    def call(self, call: ToolCall, limits: Limits) -> Outcome | None:
        if call.name != self.environment.name:
            return None
        what = f"environment server {self.environment.name}"
        result, failure = run_limited(
            lambda: self.session.step(call.arguments), limits.timeout, limits.stop_requested, f"step of {what}"
        )
        if failure is not None:
            if "ConnectionError" in failure or "ConnectionClosed" in failure:
                raise AgentError(f"{what} at {self.environment.url}: {failure}")
            return Outcome(json.dumps({"error": failure}, ensure_ascii=False), TOOL_ERROR)
        self.done = bool(result.done)
        self.add(result.reward, what)
        return Outcome(content_of(result.observation))

    def reward(self, limits: Limits) -> float | None:
        return float(sum(self.rewards)) if self.rewards else None

    def close(self) -> None:
        try:
            self.session.close()
        except Exception:  # noqa: BLE001 - a session that is gone already: nothing is left to release
            pass


def environment_addresses() -> dict[str, str]:
    """The server environments' addresses the host gave the trainer (``ASTRAI_ENVIRONMENTS``, a JSON object)."""
    text = os.environ.get(ENV_ENVIRONMENTS)
    if not text:
        return {}
    try:
        addresses = json.loads(text)
    except ValueError:
        raise AgentError(f"{ENV_ENVIRONMENTS} is not a JSON object of name -> address: {text[:80]!r}") from None
    if not isinstance(addresses, dict) or not all(isinstance(value, str) for value in addresses.values()):
        raise AgentError(f"{ENV_ENVIRONMENTS} is not a JSON object of name -> address: {text[:80]!r}")
    return addresses


def load_environment(spec: EnvironmentSpec | None, limits: Limits) -> ClassEnvironment | ServerEnvironment | None:
    """The environment ``training.environment`` names (None: none)."""
    if spec is None:
        return None
    return ServerEnvironment(spec, limits) if spec.server is not None else ClassEnvironment(spec)
