"""``python -m astrai.common.finished JOB_DIR``: exit 0 when the run in JOB_DIR is finished, 1 when not.

Finished means the newest checkpoint is the run's final one (written at max_steps).
A Slurm job asks this after a stop for its time limit, to decide whether to requeue;
it runs on the host or inside the trainer image alike (standard library only).
"""

from __future__ import annotations

import sys
from pathlib import Path

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.contract import REASON_FINAL


def is_finished(job_dir: Path) -> bool:
    newest = latest_complete_checkpoint(job_dir)
    return newest is not None and newest.meta.reason == REASON_FINAL


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m astrai.common.finished JOB_DIR", file=sys.stderr)
        return 2
    done = is_finished(Path(args[0]))
    print(f"{args[0]}: {'finished' if done else 'not finished'}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
