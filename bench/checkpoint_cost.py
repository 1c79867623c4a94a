"""Checkpoint cost, against raw writes and against torch.distributed.checkpoint (DCP), on `small` and `base`.

`small` has 26M parameters (~300 MB of state with AdamW), `base` 124M (~1.5 GB);
keys without a prefix are `small`'s, `base_...` keys the same measure on `base`.
Every save below writes the same state (model, AdamW moments, scheduler, RNG),
each way in turn within one repetition (the order rotates), and every ratio is
the median of the per-repetition ratios:

- ``ckpt_save_vs_dcp``: a synchronous trainer checkpoint (staging folder, every
  file, fsync, rename) over ``torch.distributed.checkpoint.save`` of the same
  state with its defaults (which fsync its files too).
- ``ckpt_save_vs_raw_fsync``: the same over ``safetensors.save_file`` of the model
  plus ``torch.save`` of the optimizer and scheduler state, each file fsynced;
  ``ckpt_save_vs_raw`` over those raw writes without the fsync, which stop at the
  page cache (``ckpt_raw_fsync_vs_raw`` is what the flush alone adds).
- ``ckpt_stall_vs_dcp_async``: how long a periodic checkpoint pauses the training
  loop (the state is copied, a background thread writes it) over how long
  ``torch.distributed.checkpoint.async_save`` takes to return; ``ckpt_stall_vs_sync``
  the same pause over one synchronous save.
- ``resume_vs_dcp``: loading a checkpoint into a live model, optimizer and
  scheduler the way the trainer resumes (pick the newest, read and check every
  file, load) over ``torch.distributed.checkpoint.load`` into the same objects;
  each load starts with the checkpoint's files dropped from the page cache.
- ``ckpt_peak_host_mem_vs_state``: a fresh trainer process's peak resident memory
  during its first periodic save, above what it used just before, over the bytes of
  state saved (model and optimizer tensors); ``ckpt_sync_peak_host_mem_vs_state``
  the same for a final save.
- ``ckpt_contention_vs_sync`` (`small`): the extra wall time per periodic save of
  a run with saves over the same run without, over one synchronous save, with as
  many torch threads as cores. On a CPU host every core trains, so the background
  writer's work still costs time.
- ``resume_s`` (`small`): building a trainer that resumes from a checkpoint.
- ``ckpt_write_vs_disk``: the checkpoint's write time over the time the disk takes to write the same number
  of bytes durably at its best sequential rate, measured in the same repetition: one plain stream from
  memory with a final fsync, and the same with ``O_DIRECT`` where the file system allows it (the faster of
  the two is the limit). ``disk_write_mb_per_s`` is that limit, for context.

Every timed save starts after ``os.sync()``, so no writer inherits another's
dirty pages. torch uses ``bench.common.TORCH_THREADS`` threads unless said otherwise.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from astrai.common.checkpoints import fsync_path, list_complete_checkpoints
from astrai.trainer.checkpoint.manager import load_latest
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import Trainer, open_trainer
from bench.common import REPO, Figures, drop_from_page_cache, fix_threads, status_kib
from bench.trainer_speed import make_assets, trainer_config

# preset: (window_size, batch_per_device). The state is made by one training step, then saved over and
# over: what a save costs does not depend on the values in it, and a `base` step takes longer on this
# machine than all the saves of a repetition.
SETUPS = {"small": (128, 4), "base": (32, 1)}
# preset: (repetitions with --quick, without)
REPEATS = {"small": (5, 9), "base": (None, 4)}


def _clear(job_dir: Path) -> None:
    for checkpoint in list_complete_checkpoints(job_dir):
        shutil.rmtree(checkpoint.path)


def _raw_save(trainer: Trainer, target: Path, durable: bool) -> None:
    target.mkdir()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, target / "model.safetensors")
    torch.save([part.state_dict() for part in trainer.optimizer.parts], target / "optimizer.pt")
    torch.save(trainer.schedule.state_dict(trainer.progress.step), target / "scheduler.pt")
    if durable:
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
            fsync_path(target / name)


STREAM_CHUNK = 64 << 20
"""Bytes of one write of the disk-limit stream: large enough that the system call costs nothing."""


def stream_to_disk(target: Path, size: int, direct: bool) -> bool:
    """Write ``size`` bytes from memory into ``target`` in one sequential stream and fsync it; False when the
    file system refuses O_DIRECT (tmpfs, some overlays). The buffer is page-aligned, as O_DIRECT needs."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    try:
        handle = os.open(target, flags, 0o600)
    except OSError:
        return False
    buffer = mmap.mmap(-1, STREAM_CHUNK)
    buffer.write(os.urandom(1 << 20) * (STREAM_CHUNK >> 20))
    try:
        left = size
        while left > 0:
            # O_DIRECT writes whole blocks: the last one is rounded up to 4 KiB.
            count = min(STREAM_CHUNK, left if not direct else -(-left // 4096) * 4096)
            try:
                os.write(handle, memoryview(buffer)[:count])
            except OSError:
                return False
            left -= count
        os.fsync(handle)
    finally:
        os.close(handle)
        buffer.close()
        target.unlink(missing_ok=True)
    return True


def _dcp_state(trainer: Trainer) -> dict:
    """The trainer's state as DCP takes it: model and optimizer state dicts keyed by parameter name."""
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer.parts)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": trainer.schedule.state_dict(trainer.progress.step),
        "rng": torch.get_rng_state(),
    }


def _dcp_save(trainer: Trainer, target: Path) -> None:
    dcp.save(_dcp_state(trainer), checkpoint_id=target, no_dist=True)


def _dcp_async_save(trainer: Trainer, target: Path):
    return dcp.async_save(_dcp_state(trainer), checkpoint_id=target, no_dist=True)


def _dcp_load(trainer: Trainer, source: Path) -> None:
    state = _dcp_state(trainer)
    dcp.load(state, checkpoint_id=source, no_dist=True)
    set_state_dict(
        trainer.model, trainer.optimizer.parts, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    torch.set_rng_state(state["rng"])


def _our_load(trainer: Trainer) -> None:
    loaded = load_latest(trainer.job_dir, trainer.env, trainer.log)
    trainer.model.load_state_dict(loaded.model_state)
    trainer.checkpointer.restore(loaded)


def _save_times(trainer: Trainer, folder: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each way to save, per repetition; the order of the ways rotates from one repetition to the next."""
    pending = []

    def periodic():
        trainer.save_checkpoint("periodic")

    def dcp_async():
        pending.append(_dcp_async_save(trainer, folder / "dcp"))

    trainer.save_checkpoint("final")
    size = sum(path.stat().st_size for path in list_complete_checkpoints(trainer.job_dir)[-1].path.iterdir())
    _clear(trainer.job_dir)
    direct = stream_to_disk(folder / "stream", 1 << 20, direct=True)

    ways = {
        "save": lambda: trainer.save_checkpoint("final"),
        "disk": lambda: stream_to_disk(folder / "stream", size, direct=False),
        **({"disk_direct": lambda: stream_to_disk(folder / "stream", size, direct=True)} if direct else {}),
        "raw": lambda: _raw_save(trainer, folder / "raw", durable=False),
        "durable": lambda: _raw_save(trainer, folder / "raw", durable=True),
        "dcp": lambda: _dcp_save(trainer, folder / "dcp"),
        "pause": periodic,
        "dcp_pause": dcp_async,
    }
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in ways}
    # Repetition -1 warms every way up (first-use allocations, DCP's planner caches, the periodic save's
    # reusable buffers) and is not counted: its times were up to 3x the next ones' on both sides.
    for repeat in range(-1, repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            os.sync()
            start = time.perf_counter()
            ways[name]()
            if repeat >= 0:
                times[name].append(time.perf_counter() - start)
            trainer.checkpointer.wait()
            while pending:
                pending.pop().result()
            _clear(trainer.job_dir)
            shutil.rmtree(folder / "raw", ignore_errors=True)
            shutil.rmtree(folder / "dcp", ignore_errors=True)
    times["bytes"] = [size]
    return times


def _load_times(trainer: Trainer, folder: Path, repeats: int) -> dict[str, list[float]]:
    trainer.save_checkpoint("final")
    _dcp_save(trainer, folder / "dcp-resume")
    ours, theirs = [], []
    for repeat in range(-1, repeats):  # -1: an uncounted warm-up, as for the saves
        for name in ("ours", "dcp") if repeat % 2 == 0 else ("dcp", "ours"):
            drop_from_page_cache(trainer.job_dir)
            drop_from_page_cache(folder / "dcp-resume")
            start = time.perf_counter()
            if name == "ours":
                _our_load(trainer)
            else:
                _dcp_load(trainer, folder / "dcp-resume")
            if repeat >= 0:
                (ours if name == "ours" else theirs).append(time.perf_counter() - start)
    shutil.rmtree(folder / "dcp-resume")
    return {"ours": ours, "dcp": theirs}


def _loop_seconds(trainer: Trainer, steps: int) -> float:
    start = time.perf_counter()
    trainer.train(steps=steps)
    trainer.checkpointer.wait()
    return time.perf_counter() - start


def _contention(folder: Path, params: Path, data: Path, env, plain: Trainer, repeats: int) -> list[float]:
    interval, saves = 2, 2
    window, batch = SETUPS["small"]
    periodic = open_trainer(
        trainer_config(params, data, folder / "periodic", window, batch, 10**6, ckpt_interval=interval), env
    )
    torch.set_num_threads(os.cpu_count())  # every core trains, as in a real CPU run
    try:
        plain.train(steps=2)
        periodic.train(steps=interval - 1)  # then every measured run holds `saves` saves
        periodic.checkpointer.wait()
        extra = []
        for _ in range(repeats):
            without = _loop_seconds(plain, interval * saves)
            with_saves = _loop_seconds(periodic, interval * saves)
            extra.append((with_saves - without) / saves)
            _clear(periodic.job_dir)
    finally:
        fix_threads()
        periodic.close()
    return extra


def _memory_child(params: str, data: str, job_dir: str, preset: str) -> None:
    """In a fresh process: train one step, then save once synchronously and once periodically.

    Prints, for each, the peak resident bytes above those in use just before, and the bytes of state.
    Freed memory is handed back to the system before each save, so that the peak counts new memory only.
    """
    fix_threads()
    window, batch = SETUPS[preset]
    trainer = open_trainer(
        trainer_config(Path(params), Path(data), Path(job_dir), window, batch, 10**6), init_distributed("none", "cpu")
    )
    trainer.train(steps=1)
    libc = ctypes.CDLL(None)
    extra = {}
    for reason in ("final", "periodic"):
        gc.collect()
        libc.malloc_trim(0)
        before = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # resets the peak (VmHWM) to the current resident size
        trainer.save_checkpoint(reason)
        trainer.checkpointer.wait()
        extra[reason] = (status_kib("VmHWM") - before) * 1024
        _clear(trainer.job_dir)
    _, optimizer_state = get_state_dict(trainer.model, trainer.optimizer.parts)
    tensors = [
        *trainer.model.state_dict().values(),
        *(t for state in optimizer_state["state"].values() for t in state.values() if isinstance(t, torch.Tensor)),
    ]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    trainer.close()
    print(json.dumps({"extra_bytes": extra, "state_bytes": state_bytes}))


def _peak_memory(folder: Path, params: Path, data: Path, preset: str) -> dict:
    """Peak extra host memory of a final and of a periodic save, and the state's size (fresh process)."""
    job_dir = folder / f"memory-{preset}"
    os.sync()  # no writeback of earlier saves left to slow this process's saves down
    code = "import sys; from bench.checkpoint_cost import _memory_child; _memory_child(*sys.argv[1:])"
    result = subprocess.run(
        [sys.executable, "-c", code, str(params), str(data), str(job_dir), preset],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    shutil.rmtree(job_dir)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _measure(preset: str, folder: Path, env, quick: bool, figures: Figures) -> None:
    window, batch = SETUPS[preset]
    repeats = REPEATS[preset][0 if quick else 1]
    params, data = make_assets(folder, preset)
    figures.prefix = "" if preset == "small" else f"{preset}_"
    trainer = open_trainer(trainer_config(params, data, folder / f"job-{preset}", window, batch, 10**6), env)
    try:
        trainer.train(steps=1)  # the optimizer state exists from the first step on
        times = _save_times(trainer, folder, repeats)
        loads = _load_times(trainer, folder, repeats)
        if preset == "small":
            extra = _contention(folder, params, data, env, trainer, 2 if quick else 3)
            figures.fraction(
                "ckpt_contention_vs_sync",
                max(statistics.median(extra), 0.0),
                statistics.median(times["save"]),
                {"extra_seconds_per_save": extra, "save_seconds": times["save"]},
            )
            _clear(trainer.job_dir)
            trainer.save_checkpoint("final")
            resume = []
            for _ in range(repeats // 2):
                start = time.perf_counter()
                resumed = open_trainer(trainer_config(params, data, trainer.job_dir, window, batch, 10**6), env)
                resume.append(time.perf_counter() - start)
                resumed.close()
            figures.median("resume_s", resume)
    finally:
        trainer.close()
    for key, way in (
        ("ckpt_save_s", "save"),
        ("ckpt_dcp_save_s", "dcp"),
        ("ckpt_raw_save_s", "raw"),
        ("ckpt_stall_s", "pause"),
        ("ckpt_dcp_async_stall_s", "dcp_pause"),
    ):
        figures.median(key, times[way])
    figures.median("resume_load_s", loads["ours"])
    figures.median("resume_dcp_load_s", loads["dcp"])
    pairs = {
        "ckpt_save_vs_dcp": ("save", "dcp"),
        "ckpt_save_vs_raw_fsync": ("save", "durable"),
        "ckpt_save_vs_raw": ("save", "raw"),
        "ckpt_raw_fsync_vs_raw": ("durable", "raw"),
        "ckpt_stall_vs_dcp_async": ("pause", "dcp_pause"),
        "ckpt_stall_vs_sync": ("pause", "save"),
    }
    for key, (ours, theirs) in pairs.items():
        figures.ratio(key, times[ours], times[theirs])
    # The disk's limit in each repetition: its faster durable stream of the checkpoint's bytes.
    disk = [min(pair) for pair in zip(times["disk"], times.get("disk_direct", times["disk"]), strict=True)]
    figures.ratio("ckpt_write_vs_disk", times["save"], disk)
    figures.median("disk_write_mb_per_s", [times["bytes"][0] / seconds / 1e6 for seconds in disk])
    figures.ratio("resume_vs_dcp", loads["ours"], loads["dcp"])
    memory = _peak_memory(folder, params, data, preset)
    state = memory["state_bytes"]
    figures.fraction("ckpt_peak_host_mem_vs_state", memory["extra_bytes"]["periodic"], state)
    figures.fraction("ckpt_sync_peak_host_mem_vs_state", memory["extra_bytes"]["final"], state)
    figures.prefix = ""


def run(quick: bool) -> dict:
    fix_threads()
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-ckpt-") as work:
        env = init_distributed("none", "cpu")
        # --quick leaves `base` out: its 1.5 GB saves take more than half of the section.
        for preset in ("small",) if quick else SETUPS:
            _measure(preset, Path(work), env, quick, figures)
    return figures
