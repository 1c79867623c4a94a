"""Post-training records into token ids and supervision masks: chat templates rendered as transformers does.

`prepare --kind sft` turns each record into one token sequence and a mask of the tokens the loss
covers; `--kind dpo` turns each record into two (chosen, then rejected). A record holds either

- ``messages``: a list of ``{role, content}``, rendered with the tokenizer folder's own chat template
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``) by Jinja2 configured the
  way ``transformers`` configures it, so the ids equal ``AutoTokenizer.apply_chat_template(messages)``;
  the loss covers every assistant turn: its content and the special token that ends it (the template's
  end-of-turn), never the role header around it;
- ``prompt`` and ``completion`` strings: the prompt's ids, the completion's, the end-of-text token; the
  loss covers the completion and the end-of-text token.

DPO records hold ``prompt``, ``chosen`` and ``rejected``: strings, or message lists (the prompt's
messages, and the chosen and rejected assistant turns as a message or a list of them).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from astrai.common.contract import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from astrai.common.data_folder import DataError


class RecordError(ValueError):
    """A record that cannot be a training example; the message says what it holds."""


class ChatTemplate:
    """A tokenizer folder's chat template, compiled once in a sandbox, with the special tokens it may use."""

    def __init__(self, source: str, variables: dict[str, str]):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

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
        self._template = environment.from_string(source)
        self._variables = variables
        self._errors = (jinja2.TemplateError,)

    @classmethod
    def of_folder(cls, folder: Path) -> ChatTemplate | None:
        """The chat template of a tokenizer folder, or None when it has none."""
        folder = Path(folder)
        config = _tokenizer_config(folder)
        source = None
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            source = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):
            named = {entry.get("name"): entry.get("template") for entry in config["chat_template"]}
            source = named.get("default")
        if not source:
            return None
        variables = {}
        for key, value in config.items():
            if key.endswith("_token"):
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str):
                    variables[key] = text
        return cls(source, variables)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._variables,
            )
        except self._errors as error:
            raise RecordError(f"the chat template refused it: {error}") from None


def _tokenizer_config(folder: Path) -> dict:
    path = folder / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: unreadable ({error})") from None
    return config if isinstance(config, dict) else {}


class RecordEncoder:
    """Records of one kind into (token ids, supervision mask) sequences, with one tokenizer and its template."""

    def __init__(self, tokenizer, template: ChatTemplate | None, kind: str):
        self.tokenizer = tokenizer
        self.template = template
        self.kind = kind
        self._special = set(getattr(tokenizer, "special_tokens", {}).values())

    def encode(self, record) -> list[tuple[list[int], list[int]]]:
        """One (ids, mask) sequence for an SFT record, two (chosen, rejected) for a DPO record."""
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        if self.kind == "sft":
            if "messages" in record:
                return [self._conversation(_messages(record["messages"], "messages"))]
            if "prompt" in record and "completion" in record:
                return [self._plain(_text(record, "prompt"), _text(record, "completion"))]
            raise RecordError(f"has neither messages nor prompt and completion (its keys: {_keys(record)})")
        for key in ("prompt", "chosen", "rejected"):
            if key not in record:
                raise RecordError(
                    f"has no {key!r} field (its keys: {_keys(record)}); DPO records hold prompt, chosen, rejected"
                )
        prompt = record["prompt"]
        if isinstance(prompt, str):
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

    def _plain(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        prompt_ids, completion_ids = self.tokenizer.ids([prompt, completion])
        ids = prompt_ids + completion_ids + [self.tokenizer.end_of_text]
        return ids, [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)

    def _conversation(self, messages: list[dict], supervise_from: int = 0) -> tuple[list[int], list[int]]:
        if self.template is None:
            raise RecordError(
                "holds messages, but the tokenizer has no chat template; give a tokenizer folder whose "
                "tokenizer_config.json has a chat_template (or a chat_template.jinja), or use prompt/completion records"
            )
        text = self.template.render(messages)
        ids, offsets = self.tokenizer.ids_with_offsets(text)
        mask = [0] * len(ids)
        cursor = 0
        for index, message in enumerate(messages):
            content = message["content"]
            if message["role"] != "assistant":
                # Walked past, so that an assistant reply repeating an earlier turn's words is found as itself.
                found = text.find(content, cursor) if content else -1
                cursor = found + len(content) if found >= 0 else cursor
                continue
            start = text.find(content, cursor) if content else -1
            if start < 0 and content.strip():
                content = content.strip()
                start = text.find(content, cursor)
            if start < 0:
                raise RecordError(f"the chat template does not show assistant message {index}'s content as written")
            end = start + len(content)
            cursor = end
            if index < supervise_from:
                continue
            last = None
            for position, (begin, _) in enumerate(offsets):
                if start <= begin < end:
                    mask[position] = 1
                    last = position
            # The special token right after the content ends the turn: the model must learn to emit it.
            following = (
                (last + 1) if last is not None else next((p for p, (b, _) in enumerate(offsets) if b >= end), None)
            )
            if following is not None and following < len(ids) and ids[following] in self._special:
                if not text[end : offsets[following][0]].strip():
                    mask[following] = 1
        if not any(mask):
            raise RecordError("has no assistant turn to learn from")
        return ids, mask


def _keys(record: dict) -> str:
    return ", ".join(sorted(str(key) for key in record)[:12]) or "none"


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} holds {type(value).__name__}, not text")
    return value


def _messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {key!r} must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RecordError(f"{key}[{index}] must be an object with a role and a content")
        if not isinstance(message.get("content"), str):
            raise RecordError(f"{key}[{index}].content must be text, got {type(message.get('content')).__name__}")
        messages.append({**message})
    return messages


def _turns(value, key: str) -> list[dict]:
    """A DPO answer: a string (one assistant turn), a message, or a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    return _messages(value, key)
