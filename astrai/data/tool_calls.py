"""Tool calls as chat templates write them: which format a template uses, reading the model's calls in it, and the
text a template puts between a turn that calls tools and the model's next turn.

The formats (:data:`FORMATS`), each of a family of chat templates:

- ``hermes`` — Qwen2.5, Qwen3, Hermes 2 Pro and Hermes 3, and other templates in their style: each call a JSON
  object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, after any text.
- ``llama3_json`` — Llama 3.1, 3.2 and 3.3: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``
  (after ``<|python_tag|>``, when the model writes it).
- ``mistral`` — Mistral 7B v0.3, Mixtral 8x22B and later Mistral templates: ``[TOOL_CALLS]`` then a JSON list of
  ``{"name": ..., "arguments": {...}}`` objects, or (newer templates) ``[TOOL_CALLS]name[ARGS]{...}`` per call.

Which format a template uses is found by rendering a probe conversation (:func:`template_tool_format`): a template that
does not show the tools to the model, or writes a call in none of these formats, is refused, with the formats named.
A reply whose call does not parse is an :class:`UnparsedCall` the episode answers with a tool message saying so.
Torch-free.
"""

from __future__ import annotations

import json
import os.path
import re
from dataclasses import dataclass, field

from astrai.data.chat import ChatTemplate, RecordError


class ToolFormatError(ValueError):
    """A chat template that cannot take part in tool calling (it does not render tools, or writes calls in no known
    format, or renders earlier turns otherwise once tool messages follow); the message says which."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool's name, its arguments, and the id the template gives it (Mistral's)."""

    name: str
    arguments: dict
    id: str | None = None

    def message(self, call_id: str) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI's and transformers' shape)."""
        return {
            "id": self.id or call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class UnparsedCall:
    """A call the model began but that does not parse: its text, and what is wrong with it."""

    text: str
    problem: str


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn read in a tool format: its text besides the calls, the calls, and the calls that did not
    parse."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    unparsed: tuple[UnparsedCall, ...] = field(default=())

    @property
    def calls_tools(self) -> bool:
        """Whether the turn asks for a tool (a call, or one that did not parse): the environment answers it."""
        return bool(self.calls or self.unparsed)


def _call(value, text: str, key: str = "arguments") -> ToolCall | UnparsedCall:
    """A decoded JSON value as a call ``{"name": ..., key: {...}}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return UnparsedCall(text, 'a call is a JSON object with a "name"')
    arguments = value.get(key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return UnparsedCall(text, f"the {key} of {value['name']} are not a JSON object")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return UnparsedCall(text, f"the {key} of {value['name']} are not a JSON object")
    call_id = value.get("id") if isinstance(value.get("id"), str) else None
    return ToolCall(value["name"], arguments, call_id)


def _loads(text: str) -> tuple[object, str | None]:
    try:
        return json.loads(text), None
    except ValueError as error:
        return None, f"not JSON ({error})"


def _split(found: list) -> tuple[tuple[ToolCall, ...], tuple[UnparsedCall, ...]]:
    calls = tuple(item for item in found if isinstance(item, ToolCall))
    return calls, tuple(item for item in found if isinstance(item, UnparsedCall))


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks after the reply's text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedTurn(text)
        content, rest = text[:start].rstrip("\n"), text[start:]
        found: list = []
        for block in re.split(re.escape(self.OPEN), rest)[1:]:
            body, closed, _ = block.partition(self.CLOSE)
            if not closed:
                found.append(UnparsedCall(self.OPEN + block, f"a {self.OPEN} without its {self.CLOSE}"))
                continue
            value, problem = _loads(body.strip())
            found.append(UnparsedCall(body.strip(), problem) if problem else _call(value, body.strip()))
        return ParsedTurn(content, *_split(found))


class Llama3JsonFormat:
    """The whole reply one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1's custom tools)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].strip()
        elif not body.startswith("{"):
            return ParsedTurn(text)
        value, problem = _loads(body)
        if problem:
            if '"name"' not in body:
                return ParsedTurn(text)  # a reply that happens to open a brace, not a call
            return ParsedTurn("", unparsed=(UnparsedCall(body, problem),))
        if isinstance(value, dict) and "name" not in value:
            return ParsedTurn(text)  # a JSON answer, not a call
        return ParsedTurn("", *_split([_call(value, body, "parameters")]))


class MistralFormat:
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self.MARKER)
        if start < 0:
            return ParsedTurn(text)
        content, rest = text[:start].strip(), text[start + len(self.MARKER) :].strip()
        if rest.startswith("["):
            value, problem = _loads(rest)
            if problem:
                return ParsedTurn(content, unparsed=(UnparsedCall(rest, problem),))
            if not isinstance(value, list):
                return ParsedTurn(content, unparsed=(UnparsedCall(rest, "the calls are not a JSON list"),))
            return ParsedTurn(content, *_split([_call(item, json.dumps(item)) for item in value]))
        found: list = []
        for block in rest.split(self.MARKER):
            name, marked, arguments = block.partition(self.ARGS)
            if not marked:
                found.append(UnparsedCall(block, f"a call without {self.ARGS}"))
                continue
            value, problem = _loads(arguments.strip())
            found.append(
                UnparsedCall(block, problem)
                if problem
                else _call({"name": name.strip(), "arguments": value}, block.strip())
            )
        return ParsedTurn(content, *_split(found))


FORMATS = (HermesFormat(), Llama3JsonFormat(), MistralFormat())
"""The tool-call formats the episodes read, in the order a template is tried against them."""
FORMAT_NAMES = ", ".join(f"{tool_format.name}" for tool_format in FORMATS)

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_lookup",
        "description": "Probe of the tool block: looks a zanzibar key up.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The key."}},
            "required": ["key"],
        },
    },
}
"""A tool whose description no template writes by itself: seeing it rendered tells that the template shows tools."""
PROBE_CALL = {"id": "probe0001", "type": "function", "function": {"name": "probe_lookup", "arguments": {"key": "k7"}}}


@dataclass(frozen=True)
class ToolTemplate:
    """A chat template that takes part in tool calling, with the format its calls are written in."""

    template: ChatTemplate
    format: HermesFormat | Llama3JsonFormat | MistralFormat
    end_markers: tuple[str, ...]
    """The texts of the tokens that end an assistant turn (the model's stop tokens)."""

    def reply(self, calls: list[dict], results: list[dict], tools: list[dict]) -> str:
        """The text the template puts after an assistant turn that made ``calls`` (tool_calls entries) and before the
        model's next turn: its tool messages ``results`` and the generation prompt, from the end-of-turn token that
        closed the turn on. The model's own tokens of the turn are kept as it wrote them (what it saw is what it
        learns from); only what follows them is rendered."""
        opening = [{"role": "user", "content": "start"}]
        turn = {"role": "assistant", "content": "", "tool_calls": calls}
        try:
            prompt = self.template.render(opening, add_generation_prompt=True, tools=tools)
            after = self.template.render([*opening, turn, *results], add_generation_prompt=True, tools=tools)
        except RecordError as error:
            raise ToolFormatError(f"the chat template cannot render a tool message: {error}") from None
        begins = _common_prefix(prompt, after)
        ends = [at + len(marker) for marker in self.end_markers if marker and (at := after.find(marker, begins)) >= 0]
        if not ends:
            raise ToolFormatError(
                "the chat template ends an assistant turn that calls tools with none of the model's stop tokens "
                f"({', '.join(self.end_markers)}), so the turn's end cannot be found"
            )
        return after[min(ends) :]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings."""
    return len(os.path.commonprefix([a, b]))


def template_tool_format(template: ChatTemplate, end_markers: tuple[str, ...]) -> ToolTemplate:
    """The tool format of ``template``; ToolFormatError when it shows no tools or writes calls in no known format."""
    question = [{"role": "user", "content": "What is under k7?"}]
    try:
        shown = template.render(question, add_generation_prompt=True, tools=[PROBE_TOOL])
        called = template.render(
            [*question, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}], tools=[PROBE_TOOL]
        )
    except RecordError as error:
        raise ToolFormatError(f"the chat template cannot render tools and tool calls: {error}") from None
    if "zanzibar" not in shown:
        raise ToolFormatError(
            "the chat template does not show the tools to the model (its `tools` argument renders nothing); use a "
            f"model whose template renders tools, in one of the formats {FORMAT_NAMES} (Qwen2.5 and Qwen3, "
            "Hermes, Llama 3.1+, Mistral), or give prepare --chat_template FILE one that does"
        )
    prompt = template.render(question, add_generation_prompt=True, tools=[PROBE_TOOL])
    written = called[_common_prefix(prompt, called) :]
    for marker in end_markers:
        if marker and marker in written:
            written = written[: written.rfind(marker)]
    for tool_format in FORMATS:
        parsed = tool_format.parse(written)
        if [(call.name, call.arguments) for call in parsed.calls] == [("probe_lookup", {"key": "k7"})]:
            return ToolTemplate(template, tool_format, end_markers)
    raise ToolFormatError(
        f"the chat template writes a tool call as {written.strip()[:120]!r}, in none of the formats the episodes "
        f"read ({FORMAT_NAMES})"
    )


def call_id(seed: int, number: int) -> str:
    """A call's id when the model gave none: 9 letters and digits (Mistral's templates take no other), the same for
    the same episode seed and call number (a resumed run renders what the uninterrupted one rendered)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    value = (seed * 1_000_003 + number) % (36**9)
    return "".join(alphabet[(value // 36**power) % 36] for power in range(9))
