"""``python -m astrai.model generate``: a completion of a prompt from a model folder or a checkpoint, with the
generation engine the trainer's rollouts use (:mod:`astrai.trainer.generation.engines`): the native engine for a
family the trainer computes (on a GPU in bfloat16 with its decode steps captured, on a CPU in float32), the
transformers engine for one trained through transformers (``--backend``: chosen from the folder's model_type as
training chooses it). And :func:`stop_tokens`, the ids a model's completions end at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from astrai.common.backends import BACKEND_AUTO, BACKENDS, folder_model_type, resolve_backend
from astrai.common.contract import GENERATION_CONFIG_FILE, TOKENIZER_FILE
from astrai.common.errors import AstraiError
from astrai.common.fit import SetupError
from astrai.common.model_folder import ModelConfig
from astrai.common.plan import compute_dtype
from astrai.common.settings import Sampling, SettingError
from astrai.trainer.generation.decoding import Draws
from astrai.trainer.generation.engines import generation_engine
from astrai.trainer.models.backend import Backend, backend_named

# --- python -m astrai.model generate -------------------------------------------------------------------


def add_command(commands) -> None:
    """``generate`` among ``python -m astrai.model``'s subcommands."""
    command = commands.add_parser("generate", help="sample a completion from a model folder or checkpoint")
    command.add_argument("dir", help="a model folder or a full checkpoint, holding its tokenizer.json")
    command.add_argument("--prompt", required=True, help="the text to complete (with --chat: the user's message)")
    command.add_argument("--chat", action="store_true", help="wrap the prompt in the folder's chat template")
    defaults = Sampling()
    command.add_argument(
        "--max_new_tokens",
        type=int,
        default=defaults.max_new_tokens,
        help=f"at most this many new tokens (default {defaults.max_new_tokens})",
    )
    command.add_argument("--temperature", type=float, default=defaults.temperature, help="0 (the default) is greedy")
    command.add_argument(
        "--top_k", type=int, default=defaults.top_k, help="draw among the k most likely tokens (0: all)"
    )
    command.add_argument(
        "--top_p", type=float, default=defaults.top_p, help="draw among the top tokens reaching p (1: all)"
    )
    command.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    command.add_argument(
        "--tokenizer",
        help="the tokenizer when DIR has none: a tokenizer.json or a folder holding one, or bytes (data prepared "
        "without --tokenizer)",
    )
    command.add_argument("--eos", help="the tokenizer's end-of-text token, when it has none or several")
    command.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (the default): a GPU when there is one (in bfloat16), else the CPU (in float32)",
    )
    add_backend_argument(command)


def add_backend_argument(command) -> None:
    """``--backend``, as ``model.backend`` takes it."""
    command.add_argument(
        "--backend",
        choices=BACKENDS,
        default=BACKEND_AUTO,
        help="which code computes the model: auto (the default) as training decides from the folder's model_type "
        "(native for the families the trainer computes, else transformers), native, or transformers",
    )


def folder_backend(folder: Path, requested: str) -> tuple[str, str | None]:
    """(native or transformers, the folder's model_type) for ``--backend``; BackendRefused for native with a family
    the trainer does not compute."""
    model_type = folder_model_type(folder)
    try:
        return resolve_backend(requested, model_type), model_type
    except ValueError:
        raise BackendRefused(
            f"--backend native, but model_type {model_type!r} has no native implementation; use --backend "
            "transformers (or auto, the default)"
        ) from None


class BackendRefused(AstraiError):
    """``--backend`` names code that cannot compute the folder's model."""

    exit_code = 2


def run_command(args) -> int:
    """Print the completion of ``args.prompt``; 2 for a setting out of range, 1 for what the folder cannot do."""
    from astrai.common.data_folder import DataError
    from astrai.common.model_folder import ModelLoadError
    from astrai.data.chat import RecordError

    try:
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    except SettingError as error:
        print(f"error: {error.under('--')}", file=sys.stderr)
        return 2
    if not 0 <= args.seed < 2**63:
        print(f"error: --seed must be from 0 to 2**63 - 1, got {args.seed}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no GPU is visible to torch here; use --device cpu", file=sys.stderr)
        return 2
    folder = Path(args.dir)
    try:
        _check_model_folder(folder)
        backend = backend_named(folder_backend(folder, args.backend)[0])
        tokenizer, ids = _prompt_ids(args, folder)
        model = backend.pretrained(folder)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise DataError(
                f"the tokenizer has {tokenizer.vocab_size:,} tokens and the model {model.config.vocab_size:,}: it is "
                "not this model's tokenizer"
            )
        stop = stop_tokens(model.config, folder, tokenizer)
        completion = _complete(backend, model, ids, sampling, stop, args)
    except _EmptyPrompt:
        print("error: --prompt gives no token to start from", file=sys.stderr)
        return 2
    except BackendRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except (DataError, ModelLoadError, RecordError, ValueError, SetupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(tokenizer.decode(completion))
    return 0


def _complete(backend: Backend, model, ids: list[int], sampling: Sampling, stop: set[int], args) -> list[int]:
    """The completion, on the device asked for: a GPU in bfloat16 with captured decode steps, or the CPU."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    model = model.to(device, getattr(torch, compute_dtype(device.type)))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    engine = generation_engine(backend.name, model)
    return engine.generate([ids], sampling, stop, [Draws(1, generator)])[0]


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
    tokenizer = HFTokenizer(source, args.eos, ends="a completion")
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
