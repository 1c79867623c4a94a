"""Sharded checkpoints against today's gathered ones: FSDP over 4 CPU processes (gloo) on `base` (124M parameters).

One torchrun job of 4 processes trains one step, then, in each repetition, saves and loads the same
state in both formats (``ckpt.format: full`` and ``sharded``, the order alternating), every rank
timing and measuring itself; rank 0 keeps the slowest rank's time (a save ends when the last rank is
done) and the largest rank's memory:

- ``sharded_save_vs_full``: a synchronous save (final) in the sharded format over the full format;
- ``sharded_load_vs_full``: a resume load of that checkpoint into the live, sharded model and optimizer
  (the full format: rank 0 reads and every rank receives the whole state; the sharded format: each rank
  reads its own rows), the checkpoint's files dropped from the page cache before each;
- ``sharded_peak_mem_vs_share``: the largest peak resident memory of any rank during a save (periodic
  or final), above what it used just before (counting the host copy a periodic save keeps for the next),
  over that rank's share of the state (its shard of the weights and both AdamW moments);
  ``full_peak_mem_vs_share`` the same in the full format; ``sharded_load_peak_mem_vs_share`` and
  ``full_load_peak_mem_vs_share`` the same during a resume load;
- ``sharded_stall_vs_full``: how long a periodic save pauses the loop, sharded over full.

``python -m bench.sharded_checkpoints PRESET WINDOW BATCH REPEATS PARAMS DATA JOB_DIR`` is the worker the
torchrun job runs (the tests run it too, on a smaller model); it prints one JSON line on rank 0.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Figures, drop_from_page_cache, status_kib

PRESET, WINDOW, BATCH, PROCESSES = "base", 32, 1, 4
# repetitions with --quick, without
REPEATS = (2, 4)


def worker(preset: str, window: str, batch: str, repeats: str, params: str, data: str, job_dir: str) -> None:
    """One rank of the measuring job (under torchrun)."""
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict

    from astrai.common.checkpoints import list_complete_checkpoints
    from astrai.common.contract import CKPT_FORMATS
    from astrai.trainer.checkpoint.formats import FORMATS
    from astrai.trainer.checkpoint.manager import load_latest
    from astrai.trainer.launch.distributed import init_distributed, shutdown_distributed
    from astrai.trainer.run.loop import open_trainer
    from bench.trainer_speed import trainer_config

    torch.set_num_threads(1)
    env = init_distributed("fsdp", "cpu")
    config = trainer_config(Path(params), Path(data), Path(job_dir), int(window), int(batch), 10**6)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, parallel_mode="fsdp"))
    trainer = open_trainer(config, env)
    trainer.train(steps=1)
    libc = ctypes.CDLL(None)
    model_state, optimizer_state = get_state_dict(
        trainer.model, trainer.optimizer.parts, options=StateDictOptions(full_state_dict=False)
    )
    # This rank's share of the state: its shard of every weight and moment.
    share_bytes = sum(
        (value.to_local() if hasattr(value, "to_local") else value).numel() * value.element_size()
        for value in [*model_state.values(), *(v for s in optimizer_state["state"].values() for v in s.values())]
        if isinstance(value, torch.Tensor) and value.dim() >= 1
    )
    del model_state, optimizer_state

    def clear() -> None:
        dist.barrier()
        if env.master_process:
            for checkpoint in list_complete_checkpoints(trainer.job_dir):
                shutil.rmtree(checkpoint.path)
        dist.barrier()

    def measured(work, save: bool = True) -> tuple[float, int]:
        """(seconds, peak extra bytes) of ``work()`` on this rank, every rank starting together.

        The extra bytes are the peak resident memory above what was in use just before, plus the host
        copy a periodic save keeps for the next one (allocated once, so it would not show as new), for saves.
        """
        gc.collect()
        libc.malloc_trim(0)
        before = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # resets the peak (VmHWM) to the current resident size
        if env.master_process:
            os.sync()
        dist.barrier()
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
        # Under FSDP only the sharded format copies the state to host buffers; the full one gathers fresh tensors.
        sharded = trainer.checkpointer.format.name == "sharded"
        kept = trainer.checkpointer.host_copy_bytes() if save and sharded else 0
        return seconds, (status_kib("VmHWM") - before) * 1024 + kept

    def load(format: str) -> None:
        loaded = load_latest(trainer.job_dir, env, trainer.log, whole=format == "full")
        if loaded.model_state is not None:
            set_model_state_dict(trainer.model, loaded.model_state, options=StateDictOptions(full_state_dict=True))
        trainer.checkpointer.restore(loaded)

    samples: dict[str, dict[str, list]] = {name: {} for name in CKPT_FORMATS}
    for repeat in range(-1, int(repeats)):  # -1: an uncounted warm-up (first-use buffers, page faults)
        for format in CKPT_FORMATS if repeat % 2 == 0 else CKPT_FORMATS[::-1]:
            trainer.checkpointer.format = FORMATS[format]
            figures = {}
            figures["save"] = measured(lambda: trainer.save_checkpoint("final"))
            dist.barrier()
            if env.master_process:
                drop_from_page_cache(trainer.job_dir)
            figures["load"] = measured(lambda format=format: load(format), save=False)
            clear()
            figures["stall"] = measured(lambda: trainer.save_checkpoint("periodic"))
            _, waited = measured(trainer.checkpointer.wait)
            figures["periodic_mem"] = (0.0, max(figures["stall"][1], waited))
            clear()
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, figures)
            if repeat >= 0:
                for name in figures:
                    samples[format].setdefault(name, []).append(
                        [max(rank[name][0] for rank in gathered), max(rank[name][1] for rank in gathered)]
                    )
    shares = [None] * env.world_size
    dist.all_gather_object(shares, share_bytes)
    trainer.close()
    if env.master_process:
        print(json.dumps({"samples": samples, "share_bytes": max(shares), "world_size": env.world_size}), flush=True)
    # The process groups go while the interpreter is whole (a group torn down at exit can abort the process).
    shutdown_distributed(env)


def measure(preset: str, window: int, batch: int, processes: int, repeats: int, work: Path) -> dict:
    """Run the worker under torchrun; its samples (``{format: {what: [[seconds, bytes], ...]}}``) and shares."""
    from astrai.common.contract import TORCHRUN_MODULE
    from bench.trainer_speed import make_assets

    params, data = make_assets(work, preset)
    command = [
        sys.executable,
        "-m",
        TORCHRUN_MODULE,
        "--standalone",
        "--nproc-per-node",
        str(processes),
        "-m",
        "bench.sharded_checkpoints",
        preset,
        str(window),
        str(batch),
        str(repeats),
        str(params),
        str(data),
        str(work / "job"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"the sharded checkpoint bench failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def peak_bytes(samples: dict) -> int:
    """One format's largest extra resident bytes of any rank over every save measured (final and periodic)."""
    return max(bytes_ for what in ("save", "periodic_mem") for _, bytes_ in samples[what])


def run(quick: bool) -> dict:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-sharded-") as work:
        measured = measure(PRESET, WINDOW, BATCH, PROCESSES, REPEATS[0 if quick else 1], Path(work))
    full, sharded = measured["samples"]["full"], measured["samples"]["sharded"]
    for key, what in (
        ("sharded_save_vs_full", "save"),
        ("sharded_load_vs_full", "load"),
        ("sharded_stall_vs_full", "stall"),
    ):
        figures.ratio(key, [s for s, _ in sharded[what]], [s for s, _ in full[what]])
        figures.median(f"sharded_{what}_s", [s for s, _ in sharded[what]])
        figures.median(f"full_{what}_s", [s for s, _ in full[what]])
    share = measured["share_bytes"]
    for format, samples in (("sharded", sharded), ("full", full)):
        figures.fraction(f"{format}_peak_mem_vs_share", peak_bytes(samples), share)
        figures.fraction(f"{format}_load_peak_mem_vs_share", max(bytes_ for _, bytes_ in samples["load"]), share)
    return figures


if __name__ == "__main__":
    worker(*sys.argv[1:])
