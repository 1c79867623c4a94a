"""Post-training records into token ids and supervision masks: chat templates rendered as transformers does.

`prepare --kind sft` turns each record into one token sequence and a mask of the tokens the loss
covers; `--kind dpo` turns each record into two (chosen, then rejected). A record holds either

- ``messages``: a list of ``{role, content}``, rendered with the tokenizer folder's own chat template
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``; ``prepare --chat_template FILE``
  gives another) by Jinja2 configured the way ``transformers`` configures it, so the ids equal
  ``AutoTokenizer.apply_chat_template(messages)``; the loss covers every assistant turn: what the model generates
  after the generation prompt, through the special token that ends it (the template's end-of-turn), never the role
  header around it. A template that marks that text with ``{% generation %}`` ... ``{% endgeneration %}`` is
  followed as transformers' ``return_assistant_tokens_mask`` follows it: the tokens overlapping a marked span;
- ``prompt`` and ``completion`` strings: the prompt's ids, the completion's, the end-of-text token; the
  loss covers the completion and the end-of-text token.

DPO records hold ``prompt``, ``chosen`` and ``rejected``: strings, or message lists (the prompt's
messages, and the chosen and rejected assistant turns as a message or a list of them).

`--kind kto` reads TRL's unpaired preference records, ``prompt``, ``completion`` and ``label`` (true: desirable),
the prompt and completion rendered as DPO's prompt and answer are: each record one sequence, its completion
supervised, with a fields line ``{"label": ...}`` beside it.

`--kind prompts` keeps what the online train types sample from: each record's ``prompt`` (a string, tokenized
as it is, or messages rendered with the template's generation prompt, as TRL's GRPO trainer tokenizes them)
and, beside its tokens, the prompt's text and every other field of the record (``answer``, say), which reward
functions receive.
"""

from __future__ import annotations

import json
import math
import os.path
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from astrai.common.contract import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from astrai.common.data_folder import DataError
from astrai.data.sources import not_unicode_text
from astrai.data.tokenizing import token_text, tokenizer_settings

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


class RecordError(ValueError):
    """A record that cannot be a training example; the message says what it holds."""


class ChatTemplate:
    """A tokenizer folder's chat template, compiled once in a sandbox, with the special tokens it may use."""

    def __init__(self, source: str, variables: dict[str, str], origin: str = "chat template"):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = self

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body, and
            while a render tracks them (:meth:`render_with_spans`) notes where in the text the body went."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                text = caller()
                if template._tracking is not None:
                    blocks, spans = template._tracking
                    start = sum(len(block) for block in blocks)  # every block before this one is out already
                    spans.append((start, start + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise DataError(
                f"{origin}: the chat template does not compile (line {error.lineno}: {error.message})"
            ) from None
        self._variables = variables
        self._errors = (jinja2.TemplateError,)
        self._tracking: tuple[list[str], list[tuple[int, int]]] | None = None
        self.marks_generation = GENERATION_TAG.search(source) is not None
        """Whether the template marks what the model writes with {% generation %} (then the marks say it)."""

    @classmethod
    def of_tokenizer(cls, tokenizer) -> ChatTemplate | None:
        """The chat template a tokenizer's records are rendered with: the file ``prepare --chat_template`` gave it,
        else its folder's own; None for the byte tokenizer or a folder without one."""
        given = getattr(tokenizer, "chat_template_file", None)
        if given is None:
            return cls.of_folder(tokenizer.file.parent) if hasattr(tokenizer, "file") else None
        try:
            source = Path(given).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"--chat_template {given}: cannot be read ({error})") from None
        return cls(source, _template_variables(tokenizer_settings(tokenizer.file.parent)), str(given))

    @classmethod
    def of_folder(cls, folder: Path) -> ChatTemplate | None:
        """The chat template of a tokenizer folder, or None when it has none."""
        folder = Path(folder)
        config = tokenizer_settings(folder)
        source, origin = None, folder / TOKENIZER_CONFIG_FILE
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            source, origin = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"), folder / CHAT_TEMPLATE_FILE
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):
            named = {
                entry.get("name"): entry.get("template") for entry in config["chat_template"] if isinstance(entry, dict)
            }
            source = named.get("default")
        if not source:
            return None
        return cls(source, _template_variables(config), str(origin))

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        """The conversation as text; ``tools``: the JSON schemas of the tools it may call (the template's own
        ``tools`` argument, as transformers passes it; None renders none)."""
        return "".join(self._blocks(messages, add_generation_prompt, tools))

    def render_with_spans(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation rendered, and the (start, end) characters of every {% generation %} block in it."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        self._tracking = (blocks, spans)
        try:
            for block in self._blocks(messages, False, tools):
                blocks.append(block)
        finally:
            self._tracking = None
        return "".join(blocks), spans

    def _blocks(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None):
        """The rendered text as the template yields it, block by block."""
        try:
            yield from self._template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self._variables,
            )
        except self._errors as error:
            raise RecordError(f"the chat template refused it: {error}") from None
        except Exception as error:  # the template is code from the tokenizer folder: any error is its own
            raise RecordError(f"the chat template failed on it ({type(error).__name__}: {error})") from None


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""What tells a template that marks the assistant's text (the test transformers makes)."""
REMEDY = (
    "copy the template, put {% generation %} ... {% endgeneration %} around what the model writes in an "
    "assistant turn (through its end-of-turn token), and prepare with --chat_template FILE"
)
"""What to do with a template from which the generated tokens cannot be told."""


def _template_variables(config: dict) -> dict[str, str]:
    """The special tokens a template may use (bos_token, eos_token, ...), from the tokenizer's settings."""
    variables = {key: token_text(value) for key, value in config.items() if key.endswith("_token")}
    return {key: text for key, text in variables.items() if text is not None}


class RecordEncoder:
    """Records of one kind into (token ids, supervision mask) sequences, with one tokenizer and its template."""

    def __init__(self, tokenizer, template: ChatTemplate | None, kind: str, messages_field: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.kind = kind
        self.messages_field = messages_field
        """The field holding an SFT record's messages (``--field``); default ``messages`` or ``conversations``."""
        # A template's markers (end-of-turn tokens among them) are the tokenizer's added tokens.
        self._markers = frozenset(getattr(tokenizer, "added_ids", ())) | {tokenizer.end_of_text}
        library = getattr(tokenizer, "tokenizer", None)
        self._marker_texts = sorted(
            {text for text in (library.id_to_token(i) for i in self._markers) if text} if library else (),
            key=len,
            reverse=True,
        )

    def encode(self, record) -> list[tuple[list[int], list[int]]]:
        """One (ids, mask) sequence for an SFT record, two (chosen, rejected) for a DPO record."""
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        if self.kind == "sft":
            if self.messages_field is not None:
                if self.messages_field not in record:
                    raise RecordError(
                        f"has no {self.messages_field!r} field (its keys: {_keys(record)}); --field names the "
                        "field that holds each record's messages"
                    )
                messages = _messages(record[self.messages_field], self.messages_field)
                return [self._conversation(messages, tools=_tools(record))]
            for key in ("messages", "conversations"):
                if key in record:
                    return [self._conversation(_messages(record[key], key), tools=_tools(record))]
            if "prompt" in record and "completion" in record:
                return [self._plain(_text(record, "prompt"), _text(record, "completion"))]
            raise RecordError(
                f"has neither messages (or ShareGPT conversations) nor prompt and completion (its keys: "
                f"{_keys(record)}); --field NAME names another field holding the messages"
            )
        for key in ("prompt", "chosen", "rejected"):
            if key not in record:
                raise RecordError(
                    f"has no {key!r} field (its keys: {_keys(record)}); DPO records hold prompt, chosen, rejected"
                )
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = _text(record, "prompt")
            return [self._plain(prompt, _text(record, "chosen")), self._plain(prompt, _text(record, "rejected"))]
        prompt_messages = _messages(prompt, "prompt")
        return [
            self._conversation(
                prompt_messages + _turns(record["chosen"], "chosen"), supervise_from=len(prompt_messages)
            ),
            self._conversation(
                prompt_messages + _turns(record["rejected"], "rejected"), supervise_from=len(prompt_messages)
            ),
        ]

    def pair_fields(self, record) -> list[str]:
        """A DPO record's line for the fields file of each of its two sequences: its ``margin`` (TRL's reward model
        column: the chosen answer's lead its reward should keep over the rejected one's), when it gives one."""
        margin = record.get("margin")
        if margin is None:
            return ["{}", "{}"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise RecordError(f"field 'margin' holds {margin!r}: expected a finite number (or no margin)")
        line = json.dumps({"margin": float(margin)})
        return [line, line]

    def prompt(self, record) -> tuple[list[int], str]:
        """A prompt record: its token ids, and its line for the fields file (the prompt's text and the other fields)."""
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        if "prompt" not in record:
            raise RecordError(
                f"has no 'prompt' field (its keys: {_keys(record)}); a prompt record holds a prompt (text or "
                "messages) and any other fields the rewards read"
            )
        messages = None
        if isinstance(record["prompt"], str):
            text = _text(record, "prompt")
        elif not isinstance(record["prompt"], list):
            raise RecordError(
                f"field 'prompt' holds {type(record['prompt']).__name__}: expected text, or a list of chat messages"
            )
        else:
            messages = _messages(record["prompt"], "prompt")
            if messages[-1]["role"] == "assistant":
                raise RecordError("the prompt's last message is the assistant's: a prompt ends where the reply begins")
            if self.template is None:
                raise RecordError(
                    "holds messages, but the tokenizer has no chat template; give a tokenizer folder whose "
                    "tokenizer_config.json has a chat_template (or a chat_template.jinja), or a text prompt"
                )
            text = self.template.render(messages, add_generation_prompt=True)
        (ids,) = self.tokenizer.ids([text])
        if not ids:
            raise RecordError("the prompt is empty: there is no token to start a completion from")
        fields = {key: value for key, value in record.items() if key != "prompt"}
        clash = sorted({"prompts", "completions"} & set(fields))
        if clash:
            raise RecordError(f"has a field named {clash[0]!r}, which reward functions receive as the texts; rename it")
        # A chat prompt keeps its messages: an episode renders them again, with the tools
        # (astrai.trainer.objectives.agents).
        kept = (
            {"prompt": text, "fields": fields}
            if messages is None
            else {"prompt": text, "fields": fields, "messages": messages}
        )
        try:
            line = json.dumps(kept, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise RecordError(f"a field is not plain JSON ({error}): the rewards receive the fields as JSON") from None
        return ids, line

    def scored(self, record) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
        """An offline GRPO record (prompt, completions, rewards): each completion as a sequence with its prompt
        (the completion's tokens marked, through its end-of-turn), and each one's line for the fields file."""
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        for key in ("prompt", "completions", "rewards"):
            if key not in record:
                raise RecordError(
                    f"has no {key!r} field (its keys: {_keys(record)}); a grpo record holds a prompt, its "
                    "completions and their rewards"
                )
        completions, rewards = record["completions"], record["rewards"]
        if not isinstance(completions, list) or len(completions) < 2:
            raise RecordError("field 'completions' must be a list of at least two (a group to compare)")
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise RecordError(
                f"field 'rewards' must be a list of one number (or null) per completion, {len(completions)} here"
            )
        for index, reward in enumerate(rewards):
            if reward is not None and (
                isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)
            ):
                raise RecordError(f"rewards[{index}] is {reward!r}: expected a finite number, or null")
        prompt = record["prompt"]
        sequences = []
        if isinstance(prompt, str):
            text = _text(record, "prompt")
            for index, completion in enumerate(completions):
                if not isinstance(completion, str):
                    what = type(completion).__name__
                    raise RecordError(f"completions[{index}] holds {what}: with a text prompt, a completion is text")
                sequences.append(self._plain(text, completion))
        elif isinstance(prompt, list):
            messages = _messages(prompt, "prompt")
            if self.template is None:
                raise RecordError(
                    "holds messages, but the tokenizer has no chat template; give a tokenizer folder whose "
                    "tokenizer_config.json has a chat_template (or a chat_template.jinja), or a text prompt"
                )
            text = self.template.render(messages, add_generation_prompt=True)
            for index, completion in enumerate(completions):
                turns = _turns(completion, f"completions[{index}]")
                sequences.append(self._conversation(messages + turns, supervise_from=len(messages)))
        else:
            what = type(prompt).__name__
            raise RecordError(f"field 'prompt' holds {what}: expected text, or a list of chat messages")
        lines = [
            json.dumps({"prompt": text, "reward": reward, "index": index, "of": len(completions)}, ensure_ascii=False)
            for index, reward in enumerate(rewards)
        ]
        return sequences, lines

    def unpaired(self, record) -> tuple[tuple[list[int], list[int]], str]:
        """A KTO record (prompt, completion, label): its sequence with the completion supervised, as DPO's prompt and
        answer are rendered, and its line for the fields file (the label)."""
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        for key in ("prompt", "completion", "label"):
            if key not in record:
                raise RecordError(
                    f"has no {key!r} field (its keys: {_keys(record)}); a kto record holds a prompt, a completion and "
                    "a label (true: desirable, false: undesirable)"
                )
        label = record["label"]
        if not isinstance(label, bool):
            raise RecordError(
                f"field 'label' holds {label!r}: expected true (a desirable completion) or false (an undesirable one)"
            )
        prompt = record["prompt"]
        if isinstance(prompt, str):
            if not isinstance(record["completion"], str):
                what = type(record["completion"]).__name__
                raise RecordError(f"field 'completion' holds {what}: with a text prompt, the completion is text")
            sequence = self._plain(_text(record, "prompt"), _text(record, "completion"))
        elif isinstance(prompt, list):
            messages = _messages(prompt, "prompt")
            turns = _turns(record["completion"], "completion")
            sequence = self._conversation(messages + turns, supervise_from=len(messages))
        else:
            what = type(prompt).__name__
            raise RecordError(f"field 'prompt' holds {what}: expected text, or a list of chat messages")
        return sequence, json.dumps({"label": label})

    def _plain(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        prompt_ids, completion_ids = self.tokenizer.ids([prompt, completion])
        ids = prompt_ids + completion_ids + [self.tokenizer.end_of_text]
        return ids, [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)

    def _conversation(
        self, messages: list[dict], supervise_from: int = 0, tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """The conversation's ids and supervision mask; ``tools``: the JSON schemas the template renders (TRL's
        tool-calling records carry them)."""
        if self.template is None:
            raise RecordError(
                "holds messages, but the tokenizer has no chat template; give a tokenizer folder whose "
                "tokenizer_config.json has a chat_template (or a chat_template.jinja), or use prompt/completion records"
            )
        for index, message in enumerate(messages):
            said = (message.get("content") or "").strip() or message.get("tool_calls")
            if message["role"] == "assistant" and index >= supervise_from and not said:
                raise RecordError(
                    f"assistant message {index} is empty: there is no reply to learn; drop the turn or the record"
                )
        render = _with_tools(self.template, tools)
        if self.template.marks_generation:
            text, spans = self.template.render_with_spans(messages, tools)
        else:
            text, spans = render.render(messages), None
        if problem := not_unicode_text(text):  # a role, a name or any other field the template shows
            raise RecordError(f"the rendered conversation {problem}")
        ids, offsets = self.tokenizer.ids_with_offsets(text)
        mask = [0] * len(ids)
        if spans is not None:
            _mark_overlapping(mask, offsets, self._spans_from(spans, messages, supervise_from, text, render))
        for index, message in enumerate(messages):
            if spans is not None or message["role"] != "assistant" or index < supervise_from:
                continue
            start, end = self._generated_span(messages, index, text, ids, offsets, render)
            for position, (begin, finish) in enumerate(offsets):
                # A token overlapping the span is generated, also one that straddles its start.
                if begin < end and (finish > start or (begin == finish and begin >= start)):
                    mask[position] = 1
        if not any(mask):
            raise RecordError("has no assistant turn to learn from")
        return ids, mask

    def _spans_from(
        self, spans: list[tuple[int, int]], messages: list[dict], supervise_from: int, text: str, render
    ) -> list[tuple[int, int]]:
        """The marked spans of the turns supervised: those after the first ``supervise_from`` messages (a DPO
        prompt's own assistant turns are context, not supervised)."""
        if supervise_from == 0:
            return spans
        before = self._without_closing_markers(self._prompt_of(messages[:supervise_from], render)[0])
        boundary = _common_prefix(before, text)
        return [(start, end) for start, end in spans if start >= boundary]

    def _generated_span(
        self, messages: list[dict], index: int, text: str, ids: list[int], offsets: list[tuple[int, int]], render
    ) -> tuple[int, int]:
        """The characters of ``text`` (the whole conversation rendered, tokenized as ``ids`` with ``offsets``) that
        the model generates as turn ``index``.

        They begin where the conversation before the turn, rendered with its generation prompt, ends, and end
        with the turn's end-of-turn token: what a chat client sends is the prompt, what the model must write is
        the rest, through the token that stops it. Found from rendered text, never by looking for the reply.
        """
        rendered, prompt = self._prompt_of(messages[:index], render)
        # A template may close a conversation it renders without a generation prompt (Phi-3's eos_token): the
        # history must be a prefix of the whole but for such closing markers.
        history = self._without_closing_markers(rendered)
        if not text.startswith(history):
            raise RecordError(
                f"the chat template renders the turns before assistant message {index} differently when they "
                f"are followed by more; cannot tell which tokens the model generates: {REMEDY}"
            )
        # Most prompts are a prefix of the whole; a template may also open a block in the prompt (<think>) that a
        # finished turn renders otherwise: then the turn begins where the two part.
        start = max(len(history), _turn_start(rendered, prompt, text))
        turn = render.render(messages[: index + 1])
        cut = _turn_start(rendered, prompt, turn)
        tail = turn[cut:]
        followed = self._followed(messages[: index + 1], render)
        agreed = len(tail) if followed is None else max(0, _common_prefix(turn, followed) - cut)
        length = self._through_end_of_turn(tail, agreed)
        if text[start : start + length] == tail[:length]:
            return start, start + length
        # The template renders this turn otherwise when later turns follow (an earlier turn's reasoning dropped,
        # another end token than the last turn's): the turn ends at its last marker token before the two
        # renderings part, or else at the first one after.
        parted = start + _common_prefix(text[start:], tail)
        ends = [
            finish
            for token, (begin, finish) in zip(ids, offsets, strict=True)
            if token in self._markers and begin >= start
        ]
        before = [finish for finish in ends if finish <= parted]
        after = [finish for finish in ends if finish > parted]
        if before or after:
            return start, before[-1] if before else after[0]
        raise RecordError(
            f"the chat template renders assistant message {index} differently when later turns follow it, "
            f"and without an end-of-turn token; cannot tell which tokens the model generates: {REMEDY}"
        )

    def _prompt_of(self, before: list[dict], render) -> tuple[str, str]:
        """The turns before an assistant turn rendered, without and with the generation prompt."""
        try:
            return render.render(before), render.render(before, add_generation_prompt=True)
        except RecordError:
            if before:
                raise
            return "", ""  # a conversation that opens with the assistant: many templates cannot render none

    def _followed(self, turns: list[dict], render) -> str | None:
        """The turns rendered with one more user message after them (None when the template refuses that)."""
        try:
            return render.render([*turns, {"role": "user", "content": "more"}])
        except RecordError:
            return None

    def _through_end_of_turn(self, tail: str, agreed: int) -> int:
        """How much of a turn's rendered text (``tail``) the model generates; ``agreed``: how much of it the
        turn renders the same when the conversation goes on.

        Through the turn's end-of-turn token: the last marker (added token) of the part that stays the same —
        a template may close a conversation after its last turn (Phi-3's eos_token), and the newline it puts
        between turns is not the model's to write either — else the tail's own last marker, else all of it (a
        template with no end-of-turn token).
        """
        ids, offsets = self.tokenizer.ids_with_offsets(tail)
        markers = [finish for token, (_, finish) in zip(ids, offsets, strict=True) if token in self._markers]
        # Whole tokens only: "<|end|>\n<|endoftext|>" and "<|end|>\n<|user|>" also share the characters "<|".
        agreed = max((finish for _, finish in offsets if finish <= agreed), default=0)
        shared = [finish for finish in markers if finish <= agreed]
        if shared and not tail[shared[-1] : agreed].strip():
            return shared[-1]
        if markers and not tail[markers[-1] :].strip():
            return markers[-1]
        return len(tail)

    def _without_closing_markers(self, text: str) -> str:
        """``text`` without the marker tokens (and whitespace) it ends with."""
        while True:
            stripped = text.rstrip()
            for marker in self._marker_texts:
                if stripped.endswith(marker):
                    stripped = stripped[: -len(marker)]
                    break
            else:
                return stripped
            text = stripped


@dataclass(frozen=True)
class _WithTools:
    """A template whose renders show ``tools`` (a record's, or none)."""

    template: ChatTemplate
    tools: list[dict] | None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt, self.tools)


def _with_tools(template: ChatTemplate, tools: list[dict] | None) -> _WithTools:
    return _WithTools(template, tools)


def _tools(record: dict) -> list[dict] | None:
    """A record's ``tools``: the JSON schemas of the functions its conversation may call, as TRL's tool-calling
    datasets carry them (a list, or that list as JSON text); None when it has none."""
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise RecordError("field 'tools' is text that is not JSON: expected a list of tool schemas") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordError(
            'field \'tools\' must be a list of tool schemas ({"type": "function", "function": {"name": ...}})'
        )
    return tools


def _mark_overlapping(mask: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> None:
    """Mark every token that overlaps a span, as transformers' return_assistant_tokens_mask marks them."""
    for position, (begin, finish) in enumerate(offsets):
        if any(begin < end and finish > start for start, end in spans):
            mask[position] = 1


def _turn_start(history: str, prompt: str, rendered: str) -> int:
    """Where an assistant turn begins in ``rendered`` (the conversation through it, or further): where the prompt
    (``history``, the conversation before the turn, and its generation prompt) parts from it. A template that renders
    the last message before the turn otherwise once the turn follows it (Hermes 3's last tool message, closed without
    its newline) parts before the generation prompt: the turn then begins after the generation prompt's own text."""
    start = _common_prefix(prompt, rendered)
    if prompt.startswith(history) and not rendered.startswith(history):
        opening = prompt[len(history) :]
        found = rendered.find(opening, _common_prefix(history, rendered)) if opening else -1
        if found >= 0:
            return found + len(opening)
    return start


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings."""
    return len(os.path.commonprefix([a, b]))


def _keys(record: dict) -> str:
    return ", ".join(sorted(str(key) for key in record)[:12]) or "none"


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} holds {type(value).__name__}, not text")
    if problem := not_unicode_text(value):
        raise RecordError(f"field {key!r} {problem}")
    return value


def _messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {key!r} must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    messages = []
    for index, message in enumerate(value):
        if isinstance(message, dict) and "role" not in message and {"from", "value"} <= message.keys():
            # ShareGPT's layout, as TRL and axolotl read it: {"from": "human" | "gpt" | "system", "value": ...}.
            sender, rest = message["from"], {k: v for k, v in message.items() if k not in ("from", "value")}
            message = {**rest, "role": SHAREGPT_ROLES.get(sender, sender), "content": message["value"]}
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RecordError(f"{key}[{index}] must be an object with a role and a content")
        calls = message.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, f"{key}[{index}]", message["role"])
        if not (calls and message.get("content") is None) and not isinstance(message.get("content"), str):
            raise RecordError(f"{key}[{index}].content must be text, got {type(message.get('content')).__name__}")
        if problem := not_unicode_text(message.get("content") or ""):
            raise RecordError(f"{key}[{index}].content {problem}")
        messages.append({**message})
    return messages


def _check_tool_calls(calls, where: str, role: str) -> None:
    """An assistant message's ``tool_calls``: a non-empty list of ``{"type": "function", "function": {"name": ...,
    "arguments": ...}}`` (OpenAI's and TRL's shape)."""
    if role != "assistant":
        raise RecordError(f"{where}: only an assistant message calls tools, not a {role} message")
    if not isinstance(calls, list) or not calls:
        raise RecordError(f"{where}.tool_calls must be a non-empty list of calls")
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(
                f'{where}.tool_calls[{number}] must be {{"type": "function", "function": {{"name": ..., '
                '"arguments": {...}}}'
            )


def _turns(value, key: str) -> list[dict]:
    """A DPO answer: a string (one assistant turn), a message, or a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    return _messages(value, key)
