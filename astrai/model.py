"""The model as users reach it: ``python -m astrai.model init DIR --preset tiny``, :func:`load_pretrained`,
``python -m astrai.model generate DIR --prompt TEXT [--chat] [--max_new_tokens N] [--temperature T] [--backend B]``
and ``python -m astrai.model check DIR [--backend B] [--lora]`` (:mod:`astrai.trainer.generation.cli`).

    from astrai.model import load_pretrained
    model = load_pretrained("checkpoints/my-job/epoch_0_step_1000")   # fp32, eval mode
    logits = model(tokens)                                            # [batch, seq, vocab]

The architecture lives in :mod:`astrai.trainer.models.native`, its folder I/O in :mod:`astrai.trainer.models.weights`;
a family trained through transformers in :mod:`astrai.trainer.models.hf_model`.
"""

from __future__ import annotations

import sys

from astrai.trainer.generation.cli import main
from astrai.trainer.models.weights import load_pretrained

__all__ = ["load_pretrained", "main"]

if __name__ == "__main__":
    sys.exit(main())
