"""Slurm, inside the allocation: one node's task under the docker launcher.

``python -m astrai.host.slurm_node --config FILE [-- TRAINER ARGS]`` (what the script's ``srun`` runs on every
node) starts the node's container as ``invoke start --node N --foreground`` does, with the node rank from
``SLURM_NODEID`` and the rendezvous the batch shell derived, and stops it gracefully on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from astrai.common.contract import (
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
)
from astrai.common.errors import AstraiError
from astrai.host.jobs import EXIT_INTERRUPTED, start_job
from astrai.host.runtime import Runtime, load_job_config, split_endpoint
from astrai.host.slurm_script import SlurmError

# --- the task on each node (launcher docker) -------------------------------------------------------------


def allocation_runtime(runtime: Runtime, env) -> Runtime:
    """The job as this node of the allocation sees it: its rank, the rendezvous and GPUs Slurm gave."""
    endpoint = env.get(ENV_RDZV_ENDPOINT)
    if not endpoint:
        raise SlurmError(f"{ENV_RDZV_ENDPOINT} is not set: run this through the script `invoke submit` writes")
    split_endpoint(endpoint)
    changes = {
        "rendezvous": endpoint,
        "rdzv_id": env.get(ENV_RDZV_ID) or f"slurm-{env.get('SLURM_JOB_ID', '0')}",
        "supervisor_pid": os.getpid(),
        # Slurm's rank order is the node order: node 0 hosts the rendezvous, reads and writes checkpoints.
        "rdzv_backend": "static",
    }
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    if runtime.uses_gpu and gpus:
        indices = tuple(int(index) for index in gpus.split(",") if index.strip().isdigit())
        changes.update(devices=indices, processes=len(indices), cuda_visible_devices=",".join(map(str, indices)))
    return dataclasses.replace(runtime, **changes)


def run_node(config: str, trainer_args: list[str]) -> int:
    """One node's task: start its container as `invoke start --node N --foreground`; SIGTERM stops it."""
    env = os.environ
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    node = int(env.get("SLURM_NODEID", "0"))
    _, runtime = load_job_config(config, node)
    if nodes != runtime.node_count:
        raise SlurmError(f"the allocation has {nodes} node(s) but runtime.nodes.count is {runtime.node_count}")
    runtime = allocation_runtime(runtime, env)

    def stop(signum, _frame):
        for name in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(name, signal.SIG_IGN)  # one graceful stop; further signals wait for it
        raise KeyboardInterrupt

    for name in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(name, stop)
    print(f"astrai: node {node} of {nodes} on {os.uname().nodename}, rendezvous {runtime.rendezvous}", flush=True)
    code = start_job(runtime, trainer_args, foreground=True)
    if code == EXIT_INTERRUPTED:
        # Stopped before the trainer ran: nothing to save, and the allocation may still be requeued.
        return 0
    return code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--config":
        print("usage: python -m astrai.host.slurm_node --config FILE [-- TRAINER ARGS]", file=sys.stderr)
        return 2
    rest = args[2:]
    trainer_args = rest[1:] if rest[:1] == ["--"] else rest
    try:
        return run_node(args[1], trainer_args)
    except AstraiError as error:
        print(error.show(), file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
