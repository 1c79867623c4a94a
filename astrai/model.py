"""The model as users reach it: ``python -m astrai.model init DIR --preset tiny``, :func:`load_pretrained`,
``python -m astrai.model generate DIR --prompt TEXT [--chat] [--max_new_tokens N] [--temperature T] [--backend B]``
and ``python -m astrai.model check DIR [--backend B] [--lora]``.

    from astrai.model import load_pretrained
    model = load_pretrained("checkpoints/my-job/epoch_0_step_1000")   # fp32, eval mode
    logits = model(tokens)                                            # [batch, seq, vocab]

The architecture and its folder I/O live in :mod:`astrai.trainer.model`; a family trained through transformers in
:mod:`astrai.trainer.hf_model`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from astrai.trainer import generate
from astrai.trainer.model import load_pretrained
from astrai.trainer.model import main as _main

__all__ = ["load_pretrained", "main"]


def main(argv: list[str] | None = None) -> int:
    """``init`` a base model, ``generate`` from a model folder or checkpoint, or ``check`` one."""
    return _main(
        argv,
        {
            "generate": (generate.add_command, generate.run_command),
            "check": (_add_check, _run_check),
        },
    )


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
        found = {"backend": backend, "model_type": model_type, **_built(folder, backend, args.lora)}
    except AstraiError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(found, sort_keys=True) if args.json else f"{folder}: {found['model']}")
    return 0


def _built(folder: Path, backend: str, lora: bool) -> dict:
    """What the trainer builds of ``folder``, by name: its description, and on the transformers path what the
    library chose (its attention, its router's loss)."""
    if backend == "native":
        from astrai.common.fit import lora_modules
        from astrai.common.model_folder import ModelConfig, describe, inspect_weights
        from astrai.common.settings import LoRASettings

        config = ModelConfig.load(folder)
        if lora:
            lora_modules(config, LoRASettings(rank=8, alpha=16.0))
        return {"model": describe(folder, config, inspect_weights(folder, config))}
    from astrai.trainer.hf_model import inspect_folder

    library = inspect_folder(folder, lora)
    return {
        "model": f"{library.model_type} via transformers; {library.describe()}",
        "attention": library.attention,
        "router_aux_loss_coef": library.router_aux_loss_coef,
    }


if __name__ == "__main__":
    sys.exit(main())
