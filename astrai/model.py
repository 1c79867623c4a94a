"""The model as users reach it: ``python -m astrai.model init DIR --preset tiny`` and :func:`load_pretrained`.

    from astrai.model import load_pretrained
    model = load_pretrained("checkpoints/my-job/epoch_0_step_1000")   # fp32, eval mode
    logits = model(tokens)                                            # [batch, seq, vocab]

The architecture and its folder I/O live in :mod:`astrai.trainer.model`.
"""

from __future__ import annotations

import sys

from astrai.trainer.model import load_pretrained, main

__all__ = ["load_pretrained", "main"]

if __name__ == "__main__":
    sys.exit(main())
