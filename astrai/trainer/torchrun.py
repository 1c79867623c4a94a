"""torchrun that ends without a long last collection: ``python -m astrai.trainer.torchrun ARGS`` is ``torchrun ARGS``.

When a Python process exits, the interpreter runs one last garbage collection over every object still alive. In a
process that imported torch that takes a second or more on an idle CPU, and several under load, all of it inside
the stop timeout that an emergency checkpoint also needs. The memory goes back to the system at exit anyway, so
both torchrun's agent (here) and the trainer (astrai/train.py) move what is left out of the collector's reach
(``gc.freeze``) once their work is done.
"""

from __future__ import annotations

import gc

from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    finally:
        gc.freeze()
