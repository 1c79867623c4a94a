"""The tools an episode's model may call, and how a call is answered.

A tool is a Python function of ``training.tools`` (``FILE.py:function`` or ``module:function``, loaded as reward
functions are) or a public method of the episode's environment (:mod:`astrai.trainer.objectives.agents.environments`).
Its JSON schema comes from its signature and docstring (:func:`astrai.data.tool_schemas.json_schema`, transformers' own
shape), and the chat template renders the schemas into the prompt.

A call is answered with a tool message, whatever happens (:func:`answer`):

- the tool's return value (text as it is, anything else as JSON);
- a call to a tool that does not exist, with arguments the tool does not take, that raises, or that runs past
  ``training.tool_timeout``: an error message naming the tool and what went wrong, counted as a tool error;
- a call that does not parse: an error message saying why, counted as an unparsed call.

None of them stops the run: the model learns from the episode as it went. A stop asked for while a tool runs does not
wait for it (:class:`StepAbandoned`: the round is given up, as a stop during the rewards gives it up).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from astrai.common.errors import AstraiError
from astrai.data.tool_calls import ToolCall, UnparsedCall
from astrai.data.tool_schemas import ToolSchemaError, json_schema
from astrai.trainer.objectives.rewards import StepAbandoned, user_object

POLL_SECONDS = 0.05
"""How often a wait on user code looks whether a stop was asked for."""


class AgentError(AstraiError):
    """A tool or an environment that cannot be loaded or used (not an error of one call: those are messages)."""


@dataclass(frozen=True)
class Tool:
    """A tool as the model sees it (its name and JSON schema) and the function that answers it (None: a method of
    the episode's environment, bound to each episode's instance)."""

    name: str
    schema: dict
    function: Callable | None = None


def load_tools(targets: tuple[str, ...]) -> list[Tool]:
    """The functions of ``training.tools``, each with its schema; AgentError names one that cannot be a tool."""
    tools = []
    for target in targets:
        function = user_object(target, "tool", "function", AgentError)
        try:
            tools.append(Tool(target.rpartition(":")[2], json_schema(function), function))
        except ToolSchemaError as error:
            raise AgentError(f"training.tools: {target}: {str(error).removeprefix('tool ')}") from None
    return tools


@dataclass(frozen=True)
class Outcome:
    """What a tool message says, and which count the call goes into (None: it answered)."""

    content: str
    problem: str | None = None
    """None, ``tool_error`` or ``unparsed``."""


TOOL_ERROR = "tool_error"
UNPARSED = "unparsed"


def unparsed(call: UnparsedCall) -> Outcome:
    return Outcome(_error(f"the tool call could not be read: {call.problem}"), UNPARSED)


def answer(function: Callable | None, call: ToolCall, known: list[str], timeout: float, stop_requested) -> Outcome:
    """The tool message of ``call`` to ``function`` (None: no tool of that name among ``known``)."""
    if function is None:
        return Outcome(_error(f"there is no tool {call.name}; the tools are {', '.join(known) or 'none'}"), TOOL_ERROR)
    try:
        inspect.signature(function).bind(**call.arguments)
    except TypeError as error:
        return Outcome(_error(f"{call.name} does not take these arguments: {error}"), TOOL_ERROR)
    except ValueError:
        pass  # a builtin without a signature: the call itself says what is wrong
    value, failure = run_limited(lambda: function(**call.arguments), timeout, stop_requested, f"tool {call.name}")
    if failure is not None:
        return Outcome(_error(failure), TOOL_ERROR)
    return Outcome(content_of(value))


def content_of(value) -> str:
    """A tool's return value as a tool message's content: text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


def run_limited(call: Callable[[], object], timeout: float, stop_requested, what: str) -> tuple[object, str | None]:
    """(the value of ``call()``, or None and what went wrong): the user's code runs in a thread of its own, given up
    past ``timeout`` seconds (a daemon: one that never returns does not keep the process from exiting);
    StepAbandoned when a stop is asked for meanwhile."""
    outcome: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # the user's code: whatever it raises is said in the message
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    began = time.monotonic()
    while not done.wait(POLL_SECONDS):
        if stop_requested():
            raise StepAbandoned(f"a stop was asked for while {what} was running")
        if time.monotonic() - began > timeout:
            return None, f"{what} did not return within training.tool_timeout ({timeout:g} s)"
    if "error" in outcome:
        error = outcome["error"]
        return None, f"{what} raised {type(error).__name__}: {error}"
    return outcome["value"], None
