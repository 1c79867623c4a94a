"""torchrun, ending quickly and without a traceback: ``python -m astrai.trainer.launch.torchrun ARGS`` is
``torchrun ARGS``.

- When a Python process exits, the interpreter runs one last garbage collection over every object still alive. In
  a process that imported torch that takes a second or more on an idle CPU, and several under load, all of it
  inside the stop timeout that an emergency checkpoint also needs. The memory goes back to the system at exit
  anyway, so both torchrun's agent (here) and the trainer (astrai/train.py) move what is left out of the
  collector's reach (``gc.freeze``) once their work is done.
- When a rank fails, it has printed its own error; torchrun's traceback after it would only bury that. It becomes
  one line per failed rank, and the exit code stays torchrun's (1).
"""

from __future__ import annotations

import gc
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def run() -> int:
    try:
        main()
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"torchrun: rank {rank} of {error.name} ended with {how}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = run()
    finally:
        gc.freeze()
    sys.exit(code)
