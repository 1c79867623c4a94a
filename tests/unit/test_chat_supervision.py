"""What an assistant turn supervises, on chat templates as real model folders ship them, against transformers.

The rule: a turn supervises exactly what the model must generate after the generation prompt, through its
end-of-turn token, found from character offsets of the rendered text mapped onto tokens. The reference is
transformers' ``return_assistant_tokens_mask`` on the same template marked with ``{% generation %}``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from real_chat_templates import FAMILIES, MARKED, MISTRAL_NEMO_MARKED, make_family_folder

from astrai.data.chat import ChatTemplate, RecordEncoder, RecordError
from astrai.data.tokenizing import HFTokenizer

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = [
    # A one-letter reply, and a reply that is the role's own name: found inside the header by a text search.
    [SYSTEM, {"role": "user", "content": "Say a letter."}, {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "assistant"}],
    # The template's space merges into the reply's first word (▁I'm, ĠI).
    [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "I'm fine, thanks."}],
    # The reply repeats the user's words; spaces around a reply the template may strip.
    [{"role": "user", "content": "Repeat: the cat sat"}, {"role": "assistant", "content": "the cat sat"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "  Hi there, friend.  "}],
    # Several turns: each assistant turn supervised, nothing the user or system says.
    [
        SYSTEM,
        {"role": "user", "content": "What is two and two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three and three?"},
        {"role": "assistant", "content": "Six, I think."},
    ],
]
THINKING = [
    {"role": "user", "content": "What is two and two?"},
    {"role": "assistant", "content": "<think>Two pairs make four.</think>The answer is 4."},
    {"role": "user", "content": "Sure?"},
    {"role": "assistant", "content": "<think>Yes.</think>Yes, 4."},
]


def _texts() -> list[str]:
    words = []
    for conversation in [*CONVERSATIONS, THINKING]:
        words += [message["content"] for message in conversation]
    return words * 30 + ["user assistant system GPT4 Correct User Assistant INST SYS"] * 30


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, shipped folder, marked folder): one trained tokenizer, the two templates."""
    root = tmp_path_factory.mktemp(request.param)
    shipped = make_family_folder(root / "shipped", request.param, _texts())
    marked = root / "marked"
    shutil.copytree(shipped, marked)
    config = json.loads((marked / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = MARKED[request.param]
    (marked / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return request.param, shipped, marked


def _conversations(name: str) -> list[list[dict]]:
    if name == "gemma2":  # its template refuses a system message
        return [[message for message in messages if message["role"] != "system"] for messages in CONVERSATIONS]
    return [*CONVERSATIONS, THINKING] if name == "deepseek_r1" else CONVERSATIONS


def _reference(marked, messages) -> tuple[list[int], list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(marked)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_the_marked_template_renders_what_the_shipped_one_renders(family):
    name, shipped, marked = family
    ours = transformers.AutoTokenizer.from_pretrained(shipped)
    reference = transformers.AutoTokenizer.from_pretrained(marked)
    for messages in _conversations(name):
        for prompt in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == (
                reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            )


def test_every_assistant_turn_supervises_what_transformers_marks_as_generated(family):
    """The shipped template by the token-position rule; the marked one by its {% generation %} marks, as
    transformers follows them: both give transformers' assistant mask."""
    name, shipped, marked = family
    for folder in (shipped, marked):
        encoder = RecordEncoder(HFTokenizer(folder), ChatTemplate.of_folder(folder), "sft")
        assert encoder.template.marks_generation == (folder == marked)
        for messages in _conversations(name):
            ((ids, mask),) = encoder.encode({"messages": messages})
            reference_ids, reference_mask = _reference(marked, messages)
            assert ids == reference_ids
            assert mask == reference_mask, (name, folder.name, messages)


def test_chosen_and_rejected_spans_follow_the_same_rule(family):
    name, shipped, marked = family
    for folder in (shipped, marked):
        encoder = RecordEncoder(HFTokenizer(folder), ChatTemplate.of_folder(folder), "dpo")
        prompt = [{"role": "user", "content": "Name a colour."}]
        record = {"prompt": prompt, "chosen": "Blue.", "rejected": "assistant"}
        chosen, rejected = encoder.encode(record)
        for (ids, mask), answer in ((chosen, "Blue."), (rejected, "assistant")):
            assert (ids, mask) == _reference(marked, [*prompt, {"role": "assistant", "content": answer}])
        # A prompt that holds an earlier reply: only the chosen and rejected turns are supervised.
        history = [*prompt, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another."}]
        chosen, _ = encoder.encode({"prompt": history, "chosen": "Blue.", "rejected": "assistant"})
        _, reference = _reference(marked, [*history, {"role": "assistant", "content": "Blue."}])
        # The reference marks both replies; chosen's is its last run of marked tokens.
        start = max(i for i, bit in enumerate(reference) if bit)
        while reference[start - 1]:
            start -= 1
        assert chosen[1] == [0] * start + reference[start:], (name, folder.name)


def test_the_facts_the_rule_exists_for(family):
    name, shipped, _ = family
    tokenizer = HFTokenizer(shipped)
    encoder = RecordEncoder(tokenizer, ChatTemplate.of_folder(shipped), "sft")
    reference = transformers.AutoTokenizer.from_pretrained(shipped)
    end_of_turn = FAMILIES[name].end_of_turn or FAMILIES[name].config["eos_token"]
    for messages in _conversations(name)[:3]:
        ((ids, mask),) = encoder.encode({"messages": messages})
        supervised = [token for token, bit in zip(ids, mask, strict=True) if bit]
        text = reference.decode(supervised)
        reply = messages[-1]["content"]
        # The whole reply (its first word too, whatever space the tokenizer merged into it) ...
        assert reply in text, (name, text)
        # ... through the end-of-turn token, so the model learns to stop ...
        assert supervised[-1] == tokenizer.tokenizer.token_to_id(end_of_turn)
        # ... and never the role header.
        header = reference.decode(ids[: mask.index(1)])
        assert "assistant" not in text.replace(reply, "") and header.strip()


def test_an_empty_assistant_message_is_refused_with_what_to_do(family):
    _, shipped, _ = family
    encoder = RecordEncoder(HFTokenizer(shipped), ChatTemplate.of_folder(shipped), "sft")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]
    with pytest.raises(RecordError, match="assistant message 1 is empty: there is no reply to learn"):
        encoder.encode({"messages": messages})


def test_a_template_that_hides_which_tokens_are_generated_is_refused_with_the_remedy_which_works(tmp_path, capsys):
    """Mistral Nemo's template puts the system message into the last user turn, so the turns before a reply render
    otherwise when more follow: refused, naming what to do. Marked with {% generation %} and given to
    `prepare --chat_template FILE`, it is followed as transformers follows it, and goes into the data folder."""
    from astrai.data import pipeline

    tokenizer = make_family_folder(tmp_path / "tokenizer", "mistral_nemo", _texts())
    messages = CONVERSATIONS[-1]
    encoder = RecordEncoder(HFTokenizer(tokenizer), ChatTemplate.of_folder(tokenizer), "sft")
    with pytest.raises(RecordError, match="before assistant message 2 differently .* --chat_template FILE"):
        encoder.encode({"messages": messages})
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    prepare = ["prepare", "--kind", "sft", "--tokenizer", str(tokenizer), "--workers", "1", str(records)]
    assert pipeline.main([*prepare, "--out", str(tmp_path / "refused")]) != 0
    assert "{% generation %} ... {% endgeneration %}" in capsys.readouterr().err

    marked = tmp_path / "marked.jinja"
    marked.write_text(MISTRAL_NEMO_MARKED, encoding="utf-8")
    data = tmp_path / "data"
    assert pipeline.main([*prepare, "--chat_template", str(marked), "--out", str(data)]) == 0
    assert (data / "chat_template.jinja").read_text(encoding="utf-8") == MISTRAL_NEMO_MARKED
    ((ids, mask),) = RecordEncoder(HFTokenizer(data), ChatTemplate.of_folder(data), "sft").encode(
        {"messages": messages}
    )
    assert (ids, mask) == _reference(data, messages) and any(mask)
    assert pipeline.main(["prepare", "--chat_template", str(marked), "--out", str(tmp_path / "x"), str(records)]) != 0
    assert "--chat_template needs --tokenizer" in capsys.readouterr().err
