"""The trainer: what the container runs, and what runs the same on a laptop CPU.

One process (CPU, or one GPU)::

    python -m astrai.train --config train.yaml
    python -m astrai.train --config train.yaml --max_steps 300 --ckpt_dir ./checkpoints/try --dry-run

Several processes on one machine (gloo on CPU, NCCL on GPUs)::

    torchrun --standalone --nproc-per-node 2 -m astrai.train --config train.yaml --parallel_mode ddp
    torchrun --standalone --nproc-per-node 2 -m astrai.train --config train.yaml --parallel_mode fsdp

It reads the model/data/parallel/training/ckpt/log sections of the YAML
(``runtime`` is the host's), and ``--KEY VALUE`` overrides any key. It resumes
from the newest checkpoint in ckpt_dir that loads, else starts from the base
model in param_path. SIGTERM or SIGINT finishes the current optimizer step,
writes an emergency checkpoint and exits 0. A loss or gradient norm that turns
non-finite, or a checkpoint that cannot be written (a full disk), stops it with
exit code 1; no checkpoint of non-finite state is ever written.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Run as the trainer process: before the slow imports below, a stop signal becomes a
    # recorded request instead of a kill (astrai/trainer/launch/signals.py).
    from astrai.trainer.launch import signals

    signals.catch()

import gc
import sys

from astrai.trainer.run.loop import main

if __name__ == "__main__":
    code = main()
    # Done: what is left is freed by the exit, without a last collection over torch's objects that would take
    # seconds of the stop timeout (astrai/trainer/launch/torchrun.py says more).
    gc.freeze()
    sys.exit(code)
