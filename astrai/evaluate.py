"""lm-evaluation-harness on a checkpoint: what ``invoke eval`` runs in the job's image
(:mod:`astrai.trainer.run.harness`).

    python -m astrai.evaluate --checkpoint /checkpoints/job/epoch_0_step_1000 --tasks /data/tasks/facts.yaml \\
        --out /checkpoints/job/eval/epoch_0_step_1000.json [--limit 100] [--num_fewshot 5] [--config train.yaml]

It runs on a host too, with lm-eval installed (``pip install 'astrai-train[train,eval]'``). With ``--config`` (the
job's YAML) the results go to the tracker runs of ``log.report_to`` that made the checkpoint, at its step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from astrai.common.checkpoints import CheckpointMeta, DamagedCheckpoint
from astrai.common.errors import AstraiError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m astrai.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="a checkpoint or a Hugging Face model folder")
    parser.add_argument("--tasks", required=True, help="comma-separated: task YAMLs, folders of them, or task names")
    parser.add_argument("--out", required=True, type=Path, help="the results file to write")
    parser.add_argument("--limit", type=int, help="at most this many examples of each task")
    parser.add_argument("--num_fewshot", type=int, help="examples shown before each question (default: the task's)")
    parser.add_argument("--include", action="append", default=[], type=Path, help="a folder of task YAMLs")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward pass (default 8)")
    parser.add_argument("--config", type=Path, help="the job's YAML: the results also go to its trackers")
    return parser


def main(argv: list[str] | None = None) -> int:
    from astrai.trainer.run import harness

    args = _parser().parse_args(argv)
    try:
        for name, value in (("limit", args.limit), ("num_fewshot", args.num_fewshot), ("batch_size", args.batch_size)):
            if value is not None and value < (1 if name != "num_fewshot" else 0):
                raise harness.HarnessError(f"--{name} must be an integer >= {1 if name != 'num_fewshot' else 0}", 2)
        harness.check_checkpoint(args.checkpoint)
        tasks = harness.resolve_tasks([task for task in args.tasks.split(",") if task], args.include)
        device = _device(args.device)
        print(f"evaluating {args.checkpoint} on {', '.join(tasks.names)} ({device})", flush=True)
        found = harness.run_harness(args.checkpoint, tasks, device, args.limit, args.num_fewshot, args.batch_size)
        document = harness.results_document(args.checkpoint, tasks, args.limit, args.num_fewshot, found)
        harness.write_results(args.out, document)
        for line in harness.summary_lines(document):
            print(line)
        print(f"results written to {args.out}", flush=True)
        if args.config is not None:
            _to_trackers(args.config, args.checkpoint, document)
    except AstraiError as error:
        print(error.show(), file=sys.stderr)
        return error.exit_code
    return 0


def _device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _to_trackers(config_path: Path, checkpoint: Path, document: dict) -> None:
    """The results into the tracker runs that made the checkpoint, at its step (its meta.json names them)."""
    from astrai.common.config import load_trainer_config
    from astrai.trainer.run.harness import flat_results
    from astrai.trainer.run.trackers import report_results

    log = load_trainer_config(config_path).log
    if not log.trackers or document.get("step") is None:
        return
    try:
        run_ids = CheckpointMeta.read(checkpoint).trackers or {}
    except DamagedCheckpoint:
        return
    sent = report_results(log, checkpoint.parent, run_ids, document["step"], flat_results(document["results"]), print)
    for name, run_id in sent.items():
        print(f"results sent to {name} run {run_id} at step {document['step']}")


if __name__ == "__main__":
    sys.exit(main())
