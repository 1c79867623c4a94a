"""Small Hugging Face model folders and tokenizers, made on the spot with transformers and tokenizers (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def make_hf_model(
    folder: Path,
    *,
    model_type: str = "llama",
    vocab_size: int = 300,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 4,
    head_dim: int | None = None,
    intermediate_size: int = 160,
    tie: bool = False,
    rope: dict | None = None,
    rope_theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    shard_size: str | None = None,
    seed: int = 0,
    **extra,
) -> Path:
    """A randomly initialised LlamaForCausalLM (or Mistral) saved by transformers; returns the folder.

    Weights are drawn wider than transformers' init (std 0.02) and norm weights are not all ones, so
    that a wrong rotation, head grouping or norm shows up in the logits.
    """
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // heads,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": rope_theta},
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return Path(folder)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' own implementation, loaded from ``folder`` in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def to_transformers_4_config(folder: Path, kind_key: str = "rope_type") -> dict:
    """Rewrite ``config.json`` the way transformers 4.x wrote it (rope_theta + rope_scaling); returns it."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {kind_key: kind, **rope}
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(config, indent=2))
    return config


def make_tokenizer(
    folder: Path,
    texts: list[str],
    vocab_size: int = 400,
    special=("<|endoftext|>", "<pad>"),
    eos_in_config: str | None = None,
) -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved as ``folder/tokenizer.json``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if eos_in_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_in_config}))
    return folder


# Two chat templates of different shapes, written for these tests: ChatML-style turns closed by
# <|im_end|>, and header-style turns after a begin-of-text token, closed by <|eot_id|>, with a default
# system prompt and a role check.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HEADER_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou are concise.<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHAT_SPECIALS = {
    "chatml": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "header": ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


def make_chat_tokenizer(folder: Path, texts: list[str], style: str = "chatml", in_config: bool = True) -> Path:
    """A tokenizer folder with a chat template that AutoTokenizer loads: in tokenizer_config.json, or as
    chat_template.jinja when ``in_config`` is False."""
    folder = make_tokenizer(folder, texts, special=CHAT_SPECIALS[style])
    template = CHATML_TEMPLATE if style == "chatml" else HEADER_TEMPLATE
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if style == "chatml":
        config.update(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    else:
        config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    if in_config:
        config["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def save_peft_adapter(folder: Path, base: Path, adapters: dict[str, torch.Tensor], settings) -> None:
    """Our adapters (by our names) written by PEFT itself as an adapter folder of the model folder ``base``: an
    adapter as a user brings one."""
    import peft
    import transformers

    from astrai.trainer.lora import peft_name

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
    )
    model = peft.get_peft_model(model, config)
    result = peft.set_peft_model_state_dict(model, {peft_name(name): value for name, value in adapters.items()})
    assert not [key for key in result.unexpected_keys if "lora" in key], result.unexpected_keys
    model.save_pretrained(folder)
