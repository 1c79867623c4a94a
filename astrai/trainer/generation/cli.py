"""Make a base model, sample from a model folder and say how the trainer builds one: ``python -m astrai.model``
(``init``, ``generate``, ``check``), the one place that command is defined."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from astrai.common.contract import MODEL_CONFIG_FILE, WEIGHTS_FILE
from astrai.common.model_config import FAMILY_FIELDS
from astrai.common.model_folder import ModelConfig
from astrai.common.paths import PathError, output_folder
from astrai.common.values import boolean_word
from astrai.trainer.generation import generate
from astrai.trainer.models.backend import backend_named
from astrai.trainer.models.weights import PRESETS, write_base_model


def _parse_bool(text: str) -> bool:
    value = boolean_word(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


# Fields a preset can be overridden with on the command line (RoPE scaling and token ids come from HF configs).
# eos_token_id may be a list in a Hugging Face config; on this command line it is one id.
_CLI_FIELDS = [
    f
    for f in dataclasses.fields(ModelConfig)
    if f.type in ("int", "float", "bool", "int | None", "int | tuple[int, ...] | None") and f.name not in FAMILY_FIELDS
]


def main(argv: list[str] | None = None) -> int:
    """``python -m astrai.model``: ``init`` a base model, ``generate`` from a model folder or a checkpoint, or
    ``check`` one."""
    parser = argparse.ArgumentParser(prog="python -m astrai.model", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    subcommands = {
        "generate": (generate.add_command, generate.run_command),
        "check": (_add_check, _run_check),
        "init": (_add_init, _run_init),
    }
    for add, _ in subcommands.values():
        add(commands)
    args = parser.parse_args(argv)
    return subcommands[args.command][1](args)


def _add_init(commands) -> None:
    init = commands.add_parser("init", help="write a freshly initialised base model (config.json, model.safetensors)")
    init.add_argument("dir", help="model folder to write")
    init.add_argument("--preset", choices=sorted(PRESETS), required=True, help="architecture to start from")
    init.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default 0)")
    init.add_argument("--force", action="store_true", help="overwrite a model that already exists in DIR")
    for field in _CLI_FIELDS:
        kind = _parse_bool if field.type == "bool" else float if field.type == "float" else int
        init.add_argument(f"--{field.name}", type=kind, help=f"override the preset's {field.name}")


def _run_init(args) -> int:
    overrides = {f.name: getattr(args, f.name) for f in _CLI_FIELDS if getattr(args, f.name) is not None}
    try:
        config = dataclasses.replace(PRESETS[args.preset], **overrides)
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(config, name)
            if value is not None and not 0 <= value < config.vocab_size:
                raise ValueError(
                    f"--{name} {value}: expected a token id from 0 to {config.vocab_size - 1} (vocab_size)"
                )
        folder = output_folder(args.dir, "DIR")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except PathError as error:
        print(error.show(), file=sys.stderr)
        return error.exit_code
    if not args.force and ((folder / WEIGHTS_FILE).exists() or (folder / MODEL_CONFIG_FILE).exists()):
        print(f"error: {folder} already holds a model; pass --force to overwrite it", file=sys.stderr)
        return 1
    try:
        count = write_base_model(folder, config, seed=args.seed)
    except OSError as error:
        print(f"error: cannot write the model into {folder}: {error.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} model ({count / 1e6:.2f}M parameters) to {folder}")
    return 0


def _add_check(commands) -> None:
    command = commands.add_parser(
        "check",
        help="say how the trainer builds a model folder (without reading its weights), or why it refuses it",
    )
    command.add_argument("dir", help="a model folder or a full checkpoint")
    generate.add_backend_argument(command)
    command.add_argument("--lora", action="store_true", help="also check the layers LoRA's adapters would go on")
    command.add_argument("--json", action="store_true", help="print what was found as one JSON object")


def _run_check(args) -> int:
    """0 and what the trainer builds; 2 and why, for a folder it refuses (the refusals of its start, made alike)."""
    from astrai.common.errors import AstraiError

    folder = Path(args.dir)
    try:
        backend, model_type = generate.folder_backend(folder, args.backend)
        found = {"backend": backend, "model_type": model_type, **backend_named(backend).inspect(folder, args.lora)}
    except AstraiError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(found, sort_keys=True) if args.json else f"{folder}: {found['model']}")
    return 0
