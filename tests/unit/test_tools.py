"""Tools as the model sees them and writes them: schemas from signatures as transformers makes them, the tool-call
format of every supported template family (read as the template writes it, and as transformers' own parser reads it),
the text a template puts after a call, the refusal of a template that cannot render tools, and tool-use SFT records
(TRL's shape) prepared and supervised token by token."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from real_chat_templates import train_tokenizer
from tool_templates import TOOL_FAMILIES

from astrai.data.chat import ChatTemplate
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.data.tool_calls import (
    FORMATS,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ToolFormatError,
    UnparsedCall,
    template_tool_format,
)
from astrai.data.tool_schemas import ToolSchemaError, json_schema

TEXTS = ["the key k1 hides the digit 7", "What digit does k1 hide? lookup add sum of numbers"] * 30


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key, as the question names it.
    """
    return "7"


def add(a: int, b: float = 1.0, note: str | None = None) -> float:
    """Add two numbers.

    Args:
        a: The first.
        b: The second,
            on two lines.
        note: Anything (choices: ["x", "y"])

    Returns:
        Their sum.
    """
    return a + b


def shapes(
    items: list[int], table: dict[str, float], pair: tuple[int, str], mode: Literal["a", "b"], anything: Any, flag: bool
) -> None:
    """Every shape of argument.

    Args:
        items: A list.
        table: A mapping.
        pair: A pair.
        mode: A mode.
        anything: Any value.
        flag: A flag.
    """


class Calculator:
    def multiply(self, a: int, b: int) -> int:
        """Multiply.

        Args:
            a: first
            b: second
        """
        return a * b


@pytest.mark.parametrize("function", [lookup, add, shapes, Calculator().multiply], ids=lambda f: f.__name__)
def test_a_tools_schema_is_transformers_get_json_schema(function):
    from transformers.utils import get_json_schema

    assert json_schema(function) == get_json_schema(function)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(x: int):\n    pass", "tool f: it has no docstring"),
        ('def f(x):\n    """Do.\n\n    Args:\n        x: the x\n    """', "tool f: argument x has no type hint"),
        ('def f(x: int):\n    """Do."""', "tool f: its docstring describes no argument x"),
        ('def f(*x: int):\n    """Do."""', "tool f: *x cannot be shown to the model"),
        ('def f(x: set):\n    """Do.\n\n    Args:\n        x: the x\n    """', "tool f: the type <class 'set'> has no"),
    ],
)
def test_a_function_the_model_could_not_read_is_refused_naming_it(source, message):
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(ToolSchemaError, match=re.escape(message)):
        json_schema(namespace["f"])


def _family_folder(root: Path, family: str) -> Path:
    source, kind, specials, config, _, _ = TOOL_FAMILIES[family]
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(kind, TEXTS, specials).save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **config, "chat_template": source()}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool families")
    return {family: _family_folder(root, family) for family in TOOL_FAMILIES}


def _tool_template(folder: Path, family: str):
    return template_tool_format(ChatTemplate.of_folder(folder), TOOL_FAMILIES[family][4])


CALLS = [
    {"id": "call00001", "type": "function", "function": {"name": "lookup", "arguments": {"key": "k1"}}},
    {"id": "call00002", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2.5}}},
]


@pytest.mark.parametrize("family", list(TOOL_FAMILIES))
def test_each_family_is_read_in_its_format_and_its_calls_parse_as_its_template_writes_them(families, family):
    tool_template = _tool_template(families[family], family)
    assert tool_template.format.name == TOOL_FAMILIES[family][5]
    template = tool_template.template
    tools = [json_schema(lookup), json_schema(add)]
    calls = CALLS[:1] if tool_template.format.name == "llama3_json" else CALLS  # Llama 3.1 takes one call a turn
    question = [{"role": "user", "content": "What digit does k1 hide?"}]
    prompt = template.render(question, add_generation_prompt=True, tools=tools)
    whole = template.render([*question, {"role": "assistant", "content": "", "tool_calls": calls}], tools=tools)
    written = whole[len(prompt) :]
    for marker in TOOL_FAMILIES[family][4]:
        written = written.split(marker)[0]
    parsed = tool_template.format.parse(written)
    assert [(call.name, call.arguments) for call in parsed.calls] == [
        (call["function"]["name"], call["function"]["arguments"]) for call in calls
    ]
    assert not parsed.unparsed


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_calls_parse_as_transformers_parser_reads_them(families, family):
    """TRL's response schemas for these templates, through transformers' parse_response: the same calls."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    tokenizer = add_response_schema(AutoTokenizer.from_pretrained(families[family]))
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if family == "llama3_1":
        replies = ['{"name": "lookup", "parameters": {"key": "k1"}}', "The digit is 7."]
        end = "<|eot_id|>"
    else:
        replies = [
            'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            "The digit is 7.",
        ]
        end = "<|im_end|>"
    tool_format = _tool_template(families[family], family).format
    for reply in replies:
        theirs = tokenizer.parse_response(reply + end, prefix=prefix)
        ours = tool_format.parse(reply)
        expected = [(call["function"]["name"], call["function"]["arguments"]) for call in theirs.get("tool_calls", [])]
        assert [(call.name, call.arguments) for call in ours.calls] == expected
        assert ours.content.strip() == (theirs.get("content") or "").strip()


@pytest.mark.parametrize(
    ("tool_format", "text", "problem"),
    [
        (HermesFormat(), '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}', "without its </tool_call>"),
        (HermesFormat(), '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call>', "not JSON"),
        (HermesFormat(), '<tool_call>\n{"arguments": {}}\n</tool_call>', 'a JSON object with a "name"'),
        (HermesFormat(), '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "are not a JSON object"),
        (Llama3JsonFormat(), '{"name": "lookup", "parameters": {"key": ', "not JSON"),
        (MistralFormat(), '[TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "k1"}', "not JSON"),
        (MistralFormat(), "[TOOL_CALLS]lookup{}", "a call without [ARGS]"),
    ],
)
def test_a_call_that_does_not_parse_says_why(tool_format, text, problem):
    parsed = tool_format.parse(text)
    assert not parsed.calls and len(parsed.unparsed) == 1 and parsed.calls_tools
    assert isinstance(parsed.unparsed[0], UnparsedCall) and problem in parsed.unparsed[0].problem


def test_text_without_a_call_is_an_answer_in_every_format():
    for tool_format in FORMATS:
        parsed = tool_format.parse("The digit is 7. {not a call}")
        assert not parsed.calls_tools and parsed.content == "The digit is 7. {not a call}"
    assert Llama3JsonFormat().parse('{"answer": 7}').content == '{"answer": 7}'
    mistral = MistralFormat().parse('[TOOL_CALLS]lookup[ARGS]{"key": "k1"}[TOOL_CALLS]add[ARGS]{"a": 1}')
    assert [(call.name, call.arguments) for call in mistral.calls] == [("lookup", {"key": "k1"}), ("add", {"a": 1})]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1", "llama3_2"])
def test_the_reply_after_a_call_is_the_text_trls_tool_loop_appends(families, family):
    """TRL's GRPO tool loop tokenizes what follows a tool call the same way (its _get_tool_suffix_ids, called on a
    stand-in trainer): ours is that text, from the turn's end-of-turn token to the next generation prompt."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(families[family])
    results = [{"role": "tool", "name": "lookup", "tool_call_id": "call00001", "content": "7"}]
    stand_in = types.SimpleNamespace(
        processing_class=tokenizer, _is_vlm=False, chat_template=None, chat_template_kwargs={}, _tokenizer=tokenizer
    )
    theirs = GRPOTrainer._get_tool_suffix_ids(stand_in, results)
    ours = _tool_template(families[family], family).reply(CALLS[:1], results, [json_schema(lookup)])
    assert HFTokenizer(families[family]).ids([ours])[0] == theirs
    assert "7" in ours


REPLIES = {
    # Qwen3's template renders the last assistant turn with an empty think block and an earlier one without it (TRL's
    # loop refuses the shipped template for that): the reply is read where the turn is not the last.
    "qwen3": "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    # Hermes 3 renders the tools whatever is passed, Mistral wants 9-character ids: TRL's stand-in call cannot render.
    "hermes3": "\n<|im_start|>tool\n<tool_response>\n7\n</tool_response><|im_end|><|im_start|>assistant\n",
    "mistral_v03": '[TOOL_RESULTS] {"content": 7, "call_id": "call00001"}[/TOOL_RESULTS]',
}


@pytest.mark.parametrize("family", list(REPLIES))
def test_the_reply_after_a_call_is_what_the_template_renders_after_its_end_of_turn(families, family):
    results = [{"role": "tool", "name": "lookup", "tool_call_id": "call00001", "content": "7"}]
    reply = _tool_template(families[family], family).reply(CALLS[:1], results, [json_schema(lookup)])
    assert reply == REPLIES[family]


def test_a_template_that_renders_no_tools_is_refused_saying_which_formats_are_read(tmp_path):
    from hf_folders import make_chat_tokenizer

    folder = make_chat_tokenizer(tmp_path / "chatml", TEXTS)
    with pytest.raises(ToolFormatError, match=r"does not show the tools to the model.*hermes, llama3_json, mistral"):
        template_tool_format(ChatTemplate.of_folder(folder), ("<|im_end|>",))


def test_a_template_that_writes_calls_in_no_known_format_is_refused(tmp_path):
    source = (
        "{% for tool in tools or [] %}{{ tool.function.description }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    template = ChatTemplate(source, {}, "custom")
    with pytest.raises(ToolFormatError, match=r'writes a tool call as \'CALL probe_lookup\(\{"key": "k7"\}\)\''):
        template_tool_format(template, ("<|im_end|>",))


# --- Tool-use SFT data --------------------------------------------------------------------------------------------

SUPERVISED = {
    "qwen2_5": [
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call><|im_end|>',
        "The digit is 7.<|im_end|>",
    ],
    "hermes3": [
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call><|im_end|>',
        "The digit is 7.<|im_end|>",
    ],
    "llama3_1": ['{"name": "lookup", "parameters": {"key": "k1"}}<|eot_id|>', "The digit is 7.<|eot_id|>"],
    "mistral_v03": [
        '[TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "k1"}, "id": "call00001"}]</s>',
        " The digit is 7.</s>",
    ],
}
"""What the model writes in the record below's two assistant turns, as each template renders them (the generation
prompt before a turn, and the newline after its end-of-turn, are not the model's to write)."""


def _tool_record(stringly: bool = False) -> dict:
    tools = [json_schema(lookup)]
    return {
        "messages": [
            {"role": "user", "content": "What digit does k1 hide?"},
            {"role": "assistant", "tool_calls": CALLS[:1]},
            {"role": "tool", "name": "lookup", "tool_call_id": "call00001", "content": "7"},
            {"role": "assistant", "content": "The digit is 7."},
        ],
        "tools": json.dumps(tools) if stringly else tools,
    }


@pytest.mark.parametrize("family", list(SUPERVISED))
def test_tool_use_sft_records_render_as_transformers_and_supervise_the_assistants_turns_only(
    tmp_path, families, family
):
    """TRL's tool-calling records (tools, assistant tool_calls, tool messages): the ids are transformers'
    apply_chat_template(messages, tools=...), and the supervised tokens are exactly the assistant's two turns (its
    tool call and its answer) through their end-of-turn tokens, token by token."""
    from transformers import AutoTokenizer

    from astrai.common.data_folder import TokenData

    record = _tool_record(stringly=family == "hermes3")
    (tmp_path / "tools.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    tokenizer = HFTokenizer(families[family])
    prepare(tmp_path / "sft", [tmp_path / "tools.jsonl"], tokenizer=tokenizer, kind="sft")
    data = TokenData.open(tmp_path / "sft")
    ids = np.fromfile(data.shard_files[0], dtype=data.dtype).tolist()
    mask = list(data.mask_file(0).read_bytes())
    reference = AutoTokenizer.from_pretrained(families[family])
    tools = _tool_record()["tools"]
    expected_ids = reference.apply_chat_template(record["messages"], tools=tools, tokenize=True, return_dict=True)
    assert ids == expected_ids["input_ids"]
    # The tokens of the written text (found in the rendered text, here in the test only), and no other, supervised.
    rendered = reference.apply_chat_template(record["messages"], tools=tools, tokenize=False)
    offsets = reference(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans, position = [], 0
    for written in SUPERVISED[family]:
        position = rendered.index(written, position)
        spans.append((position, position + len(written)))
        position += len(written)
    expected = [int(any(begin < end and finish > start for start, end in spans)) for begin, finish in offsets]
    assert mask == expected, [reference.decode([token]) for token, bit in zip(ids, mask, strict=True) if bit]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]},
            "messages[1].tool_calls must be a non-empty list",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
            'messages[1].tool_calls[0] must be {"type": "function"',
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": CALLS}]},
            "messages[0]: only an assistant message calls tools, not a user message",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "[oops"},
            "field 'tools' is text that is not JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": [1]},
            "field 'tools' must be a list of tool schemas",
        ),
    ],
)
def test_tool_use_records_that_cannot_be_rendered_are_refused_naming_the_line(tmp_path, families, record, message):
    from astrai.common.data_folder import DataError

    (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="bad.jsonl:1: " + message.replace("[", r"\[").replace("]", r"\]")):
        prepare(tmp_path / "out", [tmp_path / "bad.jsonl"], tokenizer=HFTokenizer(families["qwen2_5"]), kind="sft")
    assert not (tmp_path / "out").exists()
