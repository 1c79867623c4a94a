"""The model as users reach it: ``python -m astrai.model init DIR --preset tiny``, :func:`load_pretrained`, and
``python -m astrai.model generate DIR --prompt TEXT [--chat] [--max_new_tokens N] [--temperature T]``.

    from astrai.model import load_pretrained
    model = load_pretrained("checkpoints/my-job/epoch_0_step_1000")   # fp32, eval mode
    logits = model(tokens)                                            # [batch, seq, vocab]

The architecture and its folder I/O live in :mod:`astrai.trainer.model`.
"""

from __future__ import annotations

import sys

from astrai.trainer import generate
from astrai.trainer.model import load_pretrained
from astrai.trainer.model import main as _main

__all__ = ["load_pretrained", "main"]


def main(argv: list[str] | None = None) -> int:
    """``init`` a base model, or ``generate`` from a model folder or checkpoint."""
    return _main(argv, {"generate": (generate.add_command, generate.run_command)})


if __name__ == "__main__":
    sys.exit(main())
