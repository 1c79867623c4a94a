"""Small Hugging Face model folders and tokenizers, made on the spot with transformers and tokenizers (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
"""transformers' config and model classes of each model_type."""
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
    max_positions: int = 256,
    **extra,
) -> Path:
    """A randomly initialised model of ``model_type`` saved by transformers; returns the folder.

    Weights are drawn wider than transformers' init (std 0.02) and norm weights are not all ones (nor, for Gemma's
    norms that scale by 1 + weight, all zeros), so that a wrong rotation, head grouping or norm shows up in the
    logits. ``rope`` is the RoPE of every layer (Gemma 3: of its global layers; ``extra`` may give the rest).
    """
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[model_type])
    rope_parameters = {"rope_type": "default", **(rope or {}), "rope_theta": rope_theta}
    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": extra.pop("rope_local_base_freq", 10000.0)}
        rope_parameters = {"full_attention": rope_parameters, "sliding_attention": local}
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        rope_parameters=rope_parameters,
        # Phi-3's defaults (32000) lie outside these small vocabularies.
        **{"pad_token_id": None, **({"bos_token_id": 1, "eos_token_id": 2} if model_type == "phi3" else {}), **extra},
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(param))
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


# Tiny random models of each family the trainer computes beyond Llama, with every feature the family has turned
# on: a local window shorter than the longer test sequences, soft-capping, multipliers, partial rotary, and the
# RoPE scalings spread over them (longrope where Phi-3 has it, yarn and dynamic NTK where others use them).
FAMILY_CASES = {
    "gemma2": dict(
        model_type="gemma2",
        tie=True,
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=24,
        sliding_window=8,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        rope={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        tie=True,
        layers=4,
        heads=4,
        kv_heads=1,
        head_dim=24,
        sliding_window=8,
        query_pre_attn_scalar=20,
        final_logit_softcapping=6.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope={"rope_type": "linear", "factor": 4.0},
        rope_theta=1e6,
        rope_local_base_freq=1e4,
    ),
    "phi3": dict(
        model_type="phi3",
        heads=4,
        kv_heads=2,
        sliding_window=100,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=32,
        rope={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
        },
    ),
    "olmo2": dict(
        model_type="olmo2",
        heads=4,
        kv_heads=2,
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
    ),
    "granite": dict(
        model_type="granite",
        heads=4,
        kv_heads=2,
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        residual_multiplier=0.6,
        logits_scaling=2.5,
        rope={"rope_type": "dynamic", "factor": 2.0},
        max_positions=32,
    ),
}


# Tiny mixtures of experts with every feature on: more experts than each token uses, Qwen3-MoE's normalised top-k
# and a dense layer among the sparse ones (mlp_only_layers), Mixtral's sliding window and a RoPE scaling; a
# load-balancing loss weighted enough to change the training.
MOE_CASES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        router_aux_loss_coef=0.05,
        rope={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
    ),
    "mixtral": dict(
        model_type="mixtral",
        layers=2,
        heads=4,
        kv_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=48,
        sliding_window=200,
        router_aux_loss_coef=0.05,
        rope={"rope_type": "linear", "factor": 2.0},
    ),
}


def save_peft_adapter(folder: Path, base: Path, adapters: dict[str, torch.Tensor], settings) -> None:
    """Our adapters (by our names) written by PEFT itself as an adapter folder of the model folder ``base``: an
    adapter as a user brings one."""
    import peft
    import transformers

    from astrai.common.model_folder import PEFT_EXPERT_PARAMETERS, peft_expert_adapter, peft_modules_of
    from astrai.trainer.models.lora import peft_name

    tensors = {peft_name(name): value for name, value in adapters.items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    experts = any(peft_expert_adapter(name) for name in tensors)  # a mixture of experts' stacked experts
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(peft_modules_of(tensors)),  # a fused layer (Phi-3's qkv_proj) by its own name
        **({"target_parameters": list(PEFT_EXPERT_PARAMETERS)} if experts else {}),
    )
    model = peft.get_peft_model(model, config)
    result = peft.set_peft_model_state_dict(model, tensors)
    assert not [key for key in result.unexpected_keys if "lora" in key], result.unexpected_keys
    model.save_pretrained(folder)


# Families only transformers trains here, each tiny and random, with what it does at the edges of the transformers
# path: logits shaped in its ForCausalLM.forward (Falcon-H1's lm_head_multiplier, Cohere's logit_scale), a config
# transformers saves with tagged floats (Falcon-H1's and Bamba's time_step_limit: {"__float__": "Infinity"}), layers
# that subclass nn.Linear (Falcon's FalconLinear; Phi-MoE's router, which is not a linear map), a mixture of experts
# (OLMoE asks for its router's loss in config.json, gpt-oss and Phi-MoE do not), no sdpa (gpt-oss's attention sinks),
# a decoder whose output is narrower than hidden_size (OPT's project_out).
MIXTURE = dict(num_key_value_heads=2, num_experts_per_tok=2, router_aux_loss_coef=0.3)
LIBRARY_CASES = {
    "gpt_neox": dict(rotary_pct=0.5),
    "falcon": dict(new_decoder_architecture=False),
    "falcon_h1": dict(
        num_key_value_heads=2,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_chunk_size=16,
        lm_head_multiplier=0.37,
    ),
    "bamba": dict(
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=16,
        attn_layer_indices=[1],
    ),
    "cohere": dict(num_key_value_heads=2, logit_scale=0.3),
    "opt": dict(word_embed_proj_dim=16, ffn_dim=48),  # the decoder projects its output to the head's width
    "stablelm": dict(num_key_value_heads=2),
    "starcoder2": dict(num_key_value_heads=2),
    "olmoe": dict(MIXTURE, num_experts=4, output_router_logits=True),
    "gpt_oss": dict(MIXTURE, num_local_experts=4, head_dim=8, sliding_window=4),
    "phimoe": dict(MIXTURE, num_local_experts=4),
}


def make_library_model(folder: Path, model_type: str, *, vocab_size: int = 300, seed: int = 0, **extra) -> Path:
    """A randomly initialised model of a family the trainer does not compute, saved by transformers (weights drawn
    wider than transformers' init, norms not all ones, as make_hf_model draws them); returns the folder."""
    import transformers

    sizes = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab_size, max_position_embeddings=128, **sizes, **ids, **extra
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(folder)
    return Path(folder)
