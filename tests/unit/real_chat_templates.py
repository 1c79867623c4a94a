"""Chat templates as real model folders ship them, tokenizers of their kinds, and the same templates marked for
transformers' ``return_assistant_tokens_mask``.

``SHIPPED`` holds each template as it appears in the named model's ``tokenizer_config.json`` (or its
``chat_template.jinja``): the test data a user brings. ``MARKED`` is the same template with ``{% generation %}``
around what the model writes in an assistant turn (the markers render nothing, and the tests check that the
two render the same text), so that transformers computes the reference supervision mask.

The tokenizers are trained in the test, each of the kind its family ships: SentencePiece-style BPE with byte
fallback and a prepended ``▁`` (Llama 2, Mistral and OpenChat), byte-level BPE with Llama 3's split pattern,
and byte-level BPE as GPT-2 and Qwen have it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA2_CHAT = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_INSTRUCT = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
OPENCHAT = (  # openchat/openchat-3.5-0106
    "{{ bos_token }}{% for message in messages %}{{ 'GPT4 Correct ' + message['role'].title() + ': ' + "
    "message['content'] + '<|end_of_turn|>'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'GPT4 Correct Assistant:' }}{% endif %}"
)
CHATML = (  # teknium/OpenHermes-2.5-Mistral-7B
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEEPSEEK_R1 = (  # deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (its tool branches left in, unused here)
    "{% if not add_generation_prompt is defined -%}\n  {%- set add_generation_prompt = false -%}\n{%- endif -%}\n"
    "{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}\n"
    "{%- for message in messages -%}\n  {%- if message['role'] == 'system' -%}\n"
    "    {%- set ns.system_prompt = message['content'] -%}\n  {%- endif -%}\n{%- endfor -%}"
    "{{bos_token}}{{ns.system_prompt}}\n{%- for message in messages -%}\n  {%- if message['role'] == 'user' -%}\n"
    "    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}\n  {%- endif -%}\n"
    "  {%- if message['role'] == 'assistant' and message['content'] is not none -%}\n"
    "    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}\n"
    "      {%- set ns.is_tool = false -%}\n    {%- else -%}\n      {%- set content = message['content'] -%}\n"
    "      {%- if '</think>' in content -%}\n        {%- set content = content.split('</think>')[-1] -%}\n"
    "      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}\n    {%- endif -%}\n  {%- endif -%}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\\n'}}\n{%- endif %}"
)
PHI3 = (  # microsoft/Phi-3-mini-4k-instruct: closes a conversation without a generation prompt with eos_token
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Written for these tests, in the shape of OLMo 3's template: a turn followed by more ends with <|im_end|>, the
# conversation's last one with eos_token instead.
LAST_TURN_EOS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SHIPPED = {
    "llama2": LLAMA2_CHAT,
    "llama3": LLAMA3_INSTRUCT,
    "openchat": OPENCHAT,
    "chatml": CHATML,
    "deepseek_r1": DEEPSEEK_R1,
    "phi3": PHI3,
    "last_turn_eos": LAST_TURN_EOS,
}
MARKED = {
    "llama2": LLAMA2_CHAT.replace(
        "{{ ' '  + content.strip() + ' ' + eos_token }}",
        "{% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}",
    ),
    "llama3": (
        "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "openchat": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ 'GPT4 Correct Assistant:' }}{% generation %}{{ ' ' + message['content'] + '<|end_of_turn|>' }}"
        "{% endgeneration %}{% else %}{{ 'GPT4 Correct ' + message['role'].title() + ': ' + message['content'] + "
        "'<|end_of_turn|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'GPT4 Correct Assistant:' }}"
        "{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "phi3": PHI3.replace(
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
        "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}",
    ),
    "last_turn_eos": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
        "{% if loop.last %}{{ eos_token }}{% else %}{{ '<|im_end|>' }}{% endif %}{% endgeneration %}"
        "{% if not loop.last %}{{ '\n' }}{% endif %}"
        "{% else %}{{ message['content'] }}{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}"
        "{% else %}{{ '<|im_end|>\n' }}{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "deepseek_r1": DEEPSEEK_R1.replace(
        "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}",
        "{{'<｜Assistant｜>'}}{% generation %}{{ content + '<｜end▁of▁sentence｜>' }}{% endgeneration %}",
    ),
}


@dataclass(frozen=True)
class Family:
    kind: str
    """sentencepiece, llama3 or bytelevel: the tokenizer's kind."""
    specials: tuple[str, ...]
    config: dict
    """tokenizer_config.json's special tokens, as the family's folder has them."""


FAMILIES = {
    "llama2": Family("sentencepiece", ("<unk>", "<s>", "</s>"), {"bos_token": "<s>", "eos_token": "</s>"}),
    "llama3": Family(
        "llama3",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "openchat": Family(
        "sentencepiece",
        ("<unk>", "<s>", "</s>", "<|end_of_turn|>"),
        {"bos_token": "<s>", "eos_token": "<|end_of_turn|>"},
    ),
    "chatml": Family("bytelevel", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), {"eos_token": "<|im_end|>"}),
    "phi3": Family(
        "sentencepiece",
        ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    ),
    "last_turn_eos": Family(
        "bytelevel", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), {"eos_token": "<|endoftext|>"}
    ),
    "deepseek_r1": Family(
        "bytelevel",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    ),
}

# Llama 3's pre-tokenizer pattern (tiktoken's cl100k shape), as its tokenizer.json holds it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def train_tokenizer(kind: str, texts: list[str], specials: tuple[str, ...], vocab_size: int = 600):
    """A ``tokenizers.Tokenizer`` of ``kind`` trained on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "sentencepiece":
        # Trained on words marked by ▁, then saved as Llama 2's tokenizer.json has it: no pre-tokenizer, a
        # normalizer that prepends ▁ and turns spaces into ▁, byte fallback for what the vocabulary lacks.
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=[*specials, *byte_tokens])
        tokenizer.train_from_iterator(texts, trainer)
        tokenizer.pre_tokenizer = None
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        # The byte tokens are the vocabulary's own, as in Llama 2's file, not added tokens.
        saved = json.loads(tokenizer.to_str())
        saved["added_tokens"] = [token for token in saved["added_tokens"] if token["content"] not in byte_tokens]
        return Tokenizer.from_str(json.dumps(saved))
    tokenizer = Tokenizer(models.BPE())
    if kind == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def make_family_folder(folder: Path, family: str, texts: list[str], *, marked: bool = False) -> Path:
    """A tokenizer folder of ``family``'s kind with its shipped (or marked) chat template."""
    spec = FAMILIES[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(spec.kind, texts, spec.specials).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        **spec.config,
        "chat_template": (MARKED if marked else SHIPPED)[family],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder
