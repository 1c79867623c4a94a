"""Sampling from the trainer's own model, with a key/value cache: what online RL and users' spot checks need.

Prompts of different lengths go in one batch, padded on the left so that every row's next token is in the
last column. Each row's positions count its own tokens only, and no query sees a padding key, so a row
samples what it would sample alone. Settings follow ``transformers``' ``generate``: ``temperature`` 0 is
greedy (on the same prompt tokens its output equals ``generate(do_sample=False)``), otherwise the logits are divided
by the temperature, cut to the ``top_k`` most likely tokens and to the smallest set whose probability
reaches ``top_p``, and a token is drawn. A row ends at any of the ``stop`` tokens (which it keeps), or at
``max_new_tokens``.

Randomness comes only from the ``torch.Generator`` given, so a run that seeds it from its seed and step
samples the same completions after a resume.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from astrai.common.contract import GENERATION_CONFIG_FILE, TOKENIZER_FILE
from astrai.common.model_folder import ModelConfig
from astrai.common.settings import Sampling
from astrai.trainer.model import KVCache, load_pretrained


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row (B,) from its logits (B, vocab)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probabilities = ordered.softmax(dim=-1)
        # Drop a token once the more likely ones before it already reach top_p (the most likely always stays).
        before = probabilities.cumsum(dim=-1) - probabilities
        ordered = ordered.masked_fill(before >= sampling.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    sampling: Sampling,
    stop: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    together=None,
) -> list[list[int]]:
    """The completion of each prompt (token ids, ending with its stop token when it met one).

    ``together``: a process group whose ranks generate in step (FSDP gathers the weights in every forward pass,
    so no rank may stop before the others): the batch ends when every rank's rows have ended.
    """
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    inner = getattr(model, "module", model)  # under DDP, the model it wraps
    config: ModelConfig = inner.config
    longest = max(len(prompt) for prompt in prompts)
    capacity = longest + sampling.max_new_tokens - 1  # the last new token is never fed back
    limit = min(config.max_seq_len, config.sliding_window or config.max_seq_len)
    if capacity > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) and max_new_tokens ({sampling.max_new_tokens}) need {capacity} "
            f"positions; the model takes at most {limit}"
        )
    device = inner.norm.weight.device
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        real[row, longest - len(prompt) :] = True
    cache = KVCache(config, len(prompts), capacity, device, inner.norm.weight.dtype)
    stops = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    completions = []
    logits = model(tokens, cache=cache, real=real)
    for made in range(1, sampling.max_new_tokens + 1):
        chosen = pick(logits, sampling, generator).masked_fill(done, 0)
        completions.append(chosen)
        done = done | torch.isin(chosen, stops)
        if made == sampling.max_new_tokens or _all_done(done, together):
            break
        logits = model(chosen.unsqueeze(1), cache=cache, real=torch.ones_like(real[:, :1]))
    columns = torch.stack(completions, dim=1).tolist()
    return [_until_stop(row, stop) for row in columns]


def _all_done(done: torch.Tensor, together) -> bool:
    finished = done.all()
    if together is not None:
        finished = finished.to("cpu", torch.int32)  # the group is gloo's (astrai.trainer.distributed.DistEnv)
        torch.distributed.all_reduce(finished, op=torch.distributed.ReduceOp.MIN, group=together)
    return bool(finished)


def _until_stop(row: list[int], stop) -> list[int]:
    for index, token in enumerate(row):
        if token in stop:
            return row[: index + 1]
    return row


# --- python -m astrai.model generate -------------------------------------------------------------------


def add_command(commands) -> None:
    """``generate`` among ``python -m astrai.model``'s subcommands."""
    command = commands.add_parser("generate", help="sample a completion from a model folder or checkpoint")
    command.add_argument("dir", help="a model folder or a full checkpoint, holding its tokenizer.json")
    command.add_argument("--prompt", required=True, help="the text to complete (with --chat: the user's message)")
    command.add_argument("--chat", action="store_true", help="wrap the prompt in the folder's chat template")
    command.add_argument("--max_new_tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    command.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    command.add_argument("--top_k", type=int, default=0, help="draw among the k most likely tokens (0: all)")
    command.add_argument("--top_p", type=float, default=1.0, help="draw among the top tokens reaching p (1: all)")
    command.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    command.add_argument(
        "--tokenizer",
        help="the tokenizer when DIR has none: a tokenizer.json or a folder holding one, or bytes (data prepared "
        "without --tokenizer)",
    )
    command.add_argument("--eos", help="the tokenizer's end-of-text token, when it has none or several")


def run_command(args) -> int:
    """Print the completion of ``args.prompt``; 2 for a setting out of range, 1 for what the folder cannot do."""
    from astrai.common.data_folder import DataError
    from astrai.common.model_folder import ModelLoadError
    from astrai.data.chat import RecordError

    try:
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"seed must be from 0 to 2**63 - 1, got {args.seed}")
    except ValueError as error:
        print(f"error: --{error}", file=sys.stderr)
        return 2
    folder = Path(args.dir)
    try:
        _check_model_folder(folder)
        tokenizer, ids = _prompt_ids(args, folder)
        model = load_pretrained(folder)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise DataError(
                f"the tokenizer has {tokenizer.vocab_size:,} tokens and the model {model.config.vocab_size:,}: it is "
                "not this model's tokenizer"
            )
        stop = stop_tokens(model.config, folder, tokenizer)
        completion = generate(model, [ids], sampling, stop, torch.Generator().manual_seed(args.seed))[0]
    except _EmptyPrompt:
        print("error: --prompt gives no token to start from", file=sys.stderr)
        return 2
    except (DataError, ModelLoadError, RecordError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(tokenizer.decode(completion))
    return 0


class _EmptyPrompt(Exception):
    """The prompt encodes to no token at all."""


def _check_model_folder(folder: Path) -> None:
    """A DataError saying what ``folder`` is when it is not a model folder or a checkpoint."""
    from astrai.common.contract import ADAPTER_CONFIG_FILE, MODEL_CONFIG_FILE
    from astrai.common.data_folder import DataError

    if not folder.is_dir():
        raise DataError(f"DIR {folder}: not a folder; give a model folder or a checkpoint")
    if (folder / MODEL_CONFIG_FILE).is_file():
        return
    if (folder / ADAPTER_CONFIG_FILE).is_file():
        raise DataError(f"{folder} is a PEFT adapter folder, not a model: merge it into its base first")
    if any(path.name.startswith("epoch_") for path in folder.iterdir()):
        raise DataError(f"{folder} holds checkpoints: give one of them (`invoke latest` prints the newest)")
    raise DataError(f"{folder} holds no {MODEL_CONFIG_FILE}: give a model folder or a checkpoint")


def _prompt_ids(args, folder: Path) -> tuple[object, list[int]]:
    """The tokenizer (the folder's, ``--tokenizer``'s, or the byte-level one) and the prompt's token ids."""
    tokenizer, ids = _tokenize(args, folder)
    if not ids:
        raise _EmptyPrompt
    return tokenizer, ids


def _tokenize(args, folder: Path) -> tuple[object, list[int]]:
    from astrai.common.data_folder import DataError
    from astrai.data.chat import ChatTemplate
    from astrai.data.tokenizing import ByteTokenizer, HFTokenizer

    if args.tokenizer == "bytes":  # what `prepare` without --tokenizer encodes with: no template, no special tokens
        if args.chat or args.eos:
            raise DataError(
                f"--{'chat' if args.chat else 'eos'}: the byte-level tokenizer has no chat template, and "
                "its end of text is fixed"
            )
        return ByteTokenizer(), ByteTokenizer().ids([args.prompt])[0]
    source = Path(args.tokenizer) if args.tokenizer else folder
    if source.is_dir() and not (source / TOKENIZER_FILE).is_file():
        raise DataError(
            f"{source} holds no {TOKENIZER_FILE}: name the model's tokenizer with --tokenizer PATH (a tokenizer.json "
            "or a folder holding one), or --tokenizer bytes for data prepared without one"
        )
    tokenizer = HFTokenizer(source, args.eos)
    if not args.chat:  # as transformers' tokenizer(prompt): with the special tokens the tokenizer adds (a BOS, say)
        return tokenizer, tokenizer.tokenizer.encode(args.prompt, add_special_tokens=True).ids
    template = ChatTemplate.of_folder(source if source.is_dir() else source.parent)
    if template is None:
        raise DataError(f"--chat: {source} has no chat template (tokenizer_config.json or chat_template.jinja)")
    # The template writes every special token itself (transformers' apply_chat_template adds none).
    text = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    return tokenizer, tokenizer.ids([text])[0]


def stop_tokens(config: ModelConfig, folder: Path, tokenizer) -> set[int]:
    """The model's end-of-sequence ids (config.json, generation_config.json) and the tokenizer's end of text."""
    stop = set()
    found = [config.eos_token_id]
    generation = folder / GENERATION_CONFIG_FILE
    if generation.is_file():
        try:
            found.append(json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, AttributeError):
            pass  # an unreadable generation config adds no stop token; config.json's still count
    for value in found:
        stop.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    if tokenizer.end_of_text is not None:
        stop.add(tokenizer.end_of_text)
    return {token for token in stop if isinstance(token, int)}
