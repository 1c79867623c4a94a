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

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from astrai.common.checkpoints import latest_complete_checkpoint, read_meta
from astrai.common.config import TrainerConfig, describe, parse_args, resolve_grad_accum_steps
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    METRIC_ETA_S,
    METRIC_GRAD_NORM,
    METRIC_LOSS,
    METRIC_LR,
    METRIC_MAX_ALLOCATED_GIB,
    METRIC_MAX_STEPS,
    METRIC_MFU,
    METRIC_STEP,
    METRIC_TIME,
    METRIC_TOKENS_PER_S,
    METRIC_VAL_LOSS,
    METRICS_FILE,
    MODEL_CONFIG_FILE,
    REASON_EMERGENCY,
    REASON_FINAL,
    REASON_PERIODIC,
    TAG_MAX_ALLOCATED_GIB,
    TAG_MFU,
    TAG_TOKENS_PER_S,
    TAG_TRAIN_GRAD_NORM,
    TAG_TRAIN_LOSS,
    TAG_TRAIN_LR,
    TAG_VAL_LOSS,
    TENSORBOARD_DIR,
)
from astrai.common.data_folder import DataError, TokenData, WindowSplit
from astrai.common.metrics import EventWriter, StepClock, eta_seconds, flops_per_token, mfu, peak_tflops
from astrai.trainer.checkpoint import CheckpointError, CheckpointManager, LoadedCheckpoint, NonFiniteWeights, Progress
from astrai.trainer.distributed import (
    DistEnv,
    GracefulStop,
    broadcast_from_master,
    check_parallel_mode,
    gather_objects,
    init_distributed,
    parallelize,
    resolve_device,
    set_gradient_sync,
    shutdown_distributed,
    world_from_environment,
)
from astrai.trainer.model import ModelLoadError, Transformer, check_window, describe_folder, load_base_model
from astrai.trainer.windows import WindowBatchSampler, WindowDataset, ignore_stop_signals


def open_same_data(root: Path, env: DistEnv) -> TokenData:
    """The data folder, checked to be the same on every rank (each node reads its own copy).

    Every rank reports what it found, so a missing or different folder on one node is the same clear
    error on all of them, instead of one rank failing while the others wait.
    """
    try:
        data = TokenData.open(root)
        mine = data.fingerprint()
    except DataError as error:
        data, mine = None, f"error: {error}"
    everyone = gather_objects(env, mine)
    if all(report == everyone[0] for report in everyone) and data is not None:
        return data
    lines = [f"node {env.node_of(rank)} rank {rank}: {report}" for rank, report in enumerate(everyone)]
    raise DataError(
        f"every node needs the same data in {root}, but the ranks found different data "
        f"(manifest digests):\n  " + "\n  ".join(lines)
    )


class SetupError(Exception):
    """Inputs that do not fit together (data vs model vs batch); the message shows the numbers."""


class TrainingError(Exception):
    """Training cannot go on: it diverged, or the job dir cannot be written."""


@dataclass(frozen=True)
class TrainStats:
    """What one ``Trainer.train`` call did."""

    steps: int
    tokens: int
    seconds: float
    stopped: bool
    """True when a stop signal ended the call early."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def lr_multiplier(step: int, max_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min((step - warmup_steps) / max(max_steps - warmup_steps, 1), 1.0)
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """Builds everything from a config, resumes, trains, checkpoints. ``train()`` runs; ``close()`` cleans up.

    In-process use (benchmarks, tests)::

        trainer = Trainer(load_trainer_config(path, [("max_steps", "1000")]), init_distributed("none", "cpu"))
        stats = trainer.train(steps=50)          # stats.tokens_per_s
        trainer.save_checkpoint(REASON_EMERGENCY)     # waits; "periodic" returns once the state is copied
        trainer.close()
    """

    def __init__(self, config: TrainerConfig, env: DistEnv, stop: GracefulStop | None = None):
        self.config = config
        self.env = env
        self.stop = stop or GracefulStop()
        self.done = False
        training = config.training
        self.max_steps = training.max_steps
        self.window_size = config.data.window_size
        self.job_dir = Path(config.ckpt.ckpt_dir)
        # Checked before anything is loaded: a world size that does not fit the global batch fails at once.
        self.grad_accum = resolve_grad_accum_steps(training, env.world_size)
        self.checkpointer = CheckpointManager(
            self.job_dir, config.ckpt.ckpt_interval, config.ckpt.keep_last, env, self.log
        )
        if env.watch is not None and env.master_process:
            # A node lost while a periodic save is being written: publish it before this process exits.
            env.watch.before_exit = self.checkpointer.finish_pending
        self._batches = None
        self.events: EventWriter | None = None

        if env.master_process:
            self.job_dir.mkdir(parents=True, exist_ok=True)
            self.checkpointer.remove_leftovers()
        loaded = self.checkpointer.load_latest()
        if loaded is not None and loaded.progress.step >= self.max_steps:
            self.log(
                f"already at max_steps ({self.max_steps}): {loaded.checkpoint.path} "
                f"is at step {loaded.progress.step}; nothing to do"
            )
            self.done = True
            return

        data = open_same_data(Path(config.data.data_root_path), env)
        if loaded is not None:
            self.model_config, weights = loaded.model_config, loaded.model_state
            model_source = loaded.checkpoint.path
        else:
            model_source = Path(config.ckpt.param_path)
            # Only node 0 needs the base model: rank 0 reads it, the others receive it.
            self.model_config, weights = broadcast_from_master(
                env, lambda: load_base_model(model_source), errors=(ModelLoadError,)
            )
        self.global_batch = training.batch_per_device * self.grad_accum * env.world_size
        self.split = WindowSplit.from_fraction(data.num_windows(self.window_size), config.data.val_fraction)
        self._check_fit(data, model_source)
        # A checkpoint is a complete model folder: the data's tokenizer goes into each one.
        self.checkpointer.extra_files = tuple(data.root / name for name in data.tokenizer_files)

        model = Transformer(self.model_config, activation_checkpointing=config.model.activation_checkpointing)
        model.load_state_dict(weights)
        del weights
        model.to(env.device)
        if config.model.compile:
            for layer in model.layers:
                layer.compile()
        self.model = parallelize(model, env)
        self.optimizer = self._build_optimizer()
        warmup_steps = int(training.warmup_ratio * self.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, self.max_steps, warmup_steps, training.min_lr_ratio),
        )
        if loaded is not None:
            self.checkpointer.restore(loaded, self.model, self.optimizer, self.scheduler, training.random_seed)
            self.progress = loaded.progress
            self._note_resume(loaded)
        else:
            torch.manual_seed(training.random_seed + env.rank)
            self.progress = Progress()
            if env.master_process:
                self.log(
                    f"starting from base model {config.ckpt.param_path}: {describe_folder(model_source)} "
                    f"(world size {env.world_size}, device {env.device})"
                )

        self.sampler = WindowBatchSampler(
            self.split.num_train,
            training.batch_per_device,
            self.grad_accum,
            env.rank,
            env.world_size,
            training.random_seed,
        )
        workers = config.data.num_workers
        self.dataset = WindowDataset(data, self.window_size, self.split)
        self.eval_windows = self.split.eval_windows(config.log.eval_max_windows)
        self.loader = DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            num_workers=workers,
            pin_memory=env.device.type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
        )
        if self.sampler.num_windows - self.progress.samples_in_epoch < self.global_batch:
            # The global batch grew, or the data shrank, since the checkpoint: the rest of that epoch
            # no longer fills a step.
            self.progress.epoch, self.progress.samples_in_epoch = self.progress.epoch + 1, 0
        self._start_epoch()
        # bf16 autocast on CUDA; CPU trains in fp32, where autocast would only slow it down.
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda" else contextlib.nullcontext()
        )
        self._loss_sum = torch.zeros((), device=env.device)
        self.flops_per_token = flops_per_token(self.model_config, self.window_size)
        device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
        self.peak_tflops = peak_tflops(device_name, config.log.peak_tflops)
        self._warmed_up = False
        self._eval_seconds = 0.0
        if env.master_process:
            self.events = EventWriter(self.job_dir / TENSORBOARD_DIR, self.progress.step, self.log)
        # Health record: each step's summed micro-batch losses and gradient norm, left on the device and read
        # only at points that wait for the device anyway (logged steps, saves), so no step waits for it.
        self._step_loss = torch.zeros((), device=env.device)
        self._recent = torch.zeros((config.log.log_interval, 2), device=env.device)
        self._checked_step = self.progress.step
        self._last_finite: tuple[int, float] | None = None

    # Setup helpers

    def log(self, message: str) -> None:
        """Print from rank 0, as one write, so lines from the checkpoint thread never interleave."""
        if self.env.master_process:
            sys.stdout.write(message + "\n")
            sys.stdout.flush()

    def _check_fit(self, data: TokenData, model_source: Path) -> None:
        cfg, model = self.config, self.model_config
        if data.vocab_size > model.vocab_size:
            fix = (
                f"prepare the data with this model's own tokenizer (--tokenizer {model_source})"
                if data.tokenizer_sha256 is not None
                else f"init a model with --vocab_size {data.vocab_size} or more"
            )
            raise SetupError(
                f"data vocabulary {data.vocab_size} ({data.tokenizer_description}, {data.root}) does not fit "
                f"the model's vocab_size {model.vocab_size} ({model_source}); {fix}"
            )
        if self.window_size > model.max_seq_len:
            raise SetupError(f"data.window_size {self.window_size} exceeds the model's max_seq_len {model.max_seq_len}")
        check_window(model, self.window_size, model_source / MODEL_CONFIG_FILE)
        windows = self.split.num_train
        held_out = f" ({self.split.num_val} held out for validation)" if self.split.num_val else ""
        if cfg.data.val_fraction > 0 and not self.split.num_val:
            raise SetupError(
                f"data.val_fraction {cfg.data.val_fraction} holds out no window: {data.root} has only "
                f"{self.split.num_windows} windows of {self.window_size}+1 (lower window_size or add data)"
            )
        if windows < self.global_batch:
            raise SetupError(
                f"{data.root} holds {data.num_tokens} tokens = {windows} training windows of {self.window_size}+1"
                f"{held_out}, fewer than one "
                f"global batch of batch_per_device({cfg.training.batch_per_device}) * grad_accum_steps"
                f"({self.grad_accum}) * world_size({self.env.world_size}) = {self.global_batch}"
            )

    def _build_optimizer(self) -> torch.optim.AdamW:
        training = self.config.training
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Matrices and embeddings decay; norm weights (1-D) do not.
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": training.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            groups,
            lr=training.max_lr,
            betas=(training.adam_beta1, training.adam_beta2),
            eps=training.adam_eps,
            fused=self.env.device.type == "cuda",
        )

    def _note_resume(self, loaded: LoadedCheckpoint) -> None:
        p, meta = loaded.progress, loaded.meta
        self.log(
            f"resumed from {loaded.checkpoint.path} (epoch {p.epoch}, step {p.step}, reason {meta.get('reason')}; "
            f"world size {self.env.world_size}, device {self.env.device})"
        )
        saved_batch = meta.get("global_batch")
        if isinstance(saved_batch, int) and saved_batch != self.global_batch:
            self.log(
                f"note: the global batch changed since that checkpoint ({saved_batch} -> {self.global_batch} "
                f"sequences per step, world size {meta.get('world_size')} -> {self.env.world_size}); set "
                "training.global_batch_size to keep it across world sizes"
            )
        if meta.get("config_hash") != self.config.config_hash():
            self.log(
                f"note: the training config changed since that checkpoint "
                f"(config_hash {meta.get('config_hash')} -> {self.config.config_hash()})"
            )

    def _start_epoch(self) -> None:
        self.sampler.set_position(self.progress.epoch, self.progress.samples_in_epoch)
        self._batches = iter(self.loader)

    # Training

    def train(self, steps: int | None = None) -> TrainStats:
        """Train until max_steps, a stop signal, or ``steps`` more optimizer steps; checkpoints as configured."""
        if self.done:
            return TrainStats(0, 0, 0.0, stopped=False)
        training = self.config.training
        accum = self.grad_accum
        vocab_size = self.model_config.vocab_size
        tokens_per_step = self.global_batch * self.window_size
        end = self.max_steps if steps is None else min(self.max_steps, self.progress.step + steps)
        first_step = self.progress.step
        self.model.train()
        # Progress reports average over the steps of this call.
        started = time.perf_counter()
        self.clock = StepClock(started)
        self._log_step = first_step
        self._loss_sum.zero_()
        stopping = False
        while self.progress.step < end and not stopping:
            lr = self.optimizer.param_groups[0]["lr"]
            for micro in range(accum):
                batch = next(self._batches).to(self.env.device, non_blocking=True)
                inputs, targets = batch[:, :-1], batch[:, 1:]
                set_gradient_sync(self.model, self.env, micro == accum - 1)
                with self.autocast:
                    logits = self.model(inputs)
                loss = F.cross_entropy(logits.float().view(-1, vocab_size), targets.reshape(-1))
                (loss / accum).backward()
                self._step_loss += loss.detach()
            self._loss_sum += self._step_loss
            row = self._recent[self.progress.step - self._checked_step]
            row[0].copy_(self._step_loss)
            self._step_loss.zero_()
            grad_norm = None
            if training.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), training.max_grad_norm)
                # Under FSDP the local part is enough: a non-finite part makes the whole norm non-finite.
                row[1].copy_(grad_norm.to_local() if isinstance(grad_norm, DTensor) else grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

            if not self._warmed_up:
                # The first step allocates, picks kernels and compiles (model.compile): a pause, not the pace.
                self._synchronize()
                self.clock.pause(time.perf_counter() - started, steps=1)
                self._warmed_up = True

            progress = self.progress
            progress.step += 1
            progress.tokens_seen += tokens_per_step
            progress.samples_in_epoch += self.global_batch
            if self.sampler.num_windows - progress.samples_in_epoch < self.global_batch:
                progress.epoch, progress.samples_in_epoch = progress.epoch + 1, 0
                self._start_epoch()
            stopping = self.stop.agree(self.env)
            if stopping:
                who = self.stop.signal_name or "on another rank"
                self.log(f"stop requested ({who}): stopping after step {progress.step}")
            # A failed background save stops the run now, not at the next save (no device sync: a Python flag).
            self.checkpointer.raise_if_failed()
            val_loss = None
            if self.eval_windows and progress.step % self.config.log.eval_interval == 0:
                val_loss, self._eval_seconds = self._paused(self.validate)
            logged = progress.step % self.config.log.log_interval == 0 or progress.step == self.max_steps
            if logged or stopping or val_loss is not None:
                self._report(lr, grad_norm, val_loss)
            reason = self.checkpointer.reason_for(progress.step, self.max_steps, stopping)
            if reason is not None:
                self._paused(functools.partial(self.save_checkpoint, reason))
        self._synchronize()
        steps_done = self.progress.step - first_step
        return TrainStats(steps_done, steps_done * tokens_per_step, time.perf_counter() - started, stopped=stopping)

    def _check_finite(self, loss: torch.Tensor | None = None) -> float | None:
        """Raise TrainingError when a loss or gradient norm since the last check was not finite.

        Reads the health record of the steps since the last check, with ``loss`` (the report's) in the same
        all-reduce: one small copy at a point where the loop waits for the device anyway. Returns the loss.
        """
        count = self.progress.step - self._checked_step
        if count == 0 and loss is None:
            return None
        head = loss.view(1) if loss is not None else self._recent.new_zeros(1)
        packed = torch.cat([head, self._recent[:count].view(-1)])
        if self.env.distributed:
            dist.all_reduce(packed)
            packed /= self.env.world_size
        values = packed.tolist()
        first = self._checked_step + 1
        self._checked_step = self.progress.step
        for offset in range(count):
            step, loss_sum, grad_norm = first + offset, values[1 + 2 * offset], values[2 + 2 * offset]
            step_loss = loss_sum / self.grad_accum
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                self._last_finite = (step, step_loss)
                continue
            what = f"the loss is {step_loss}" if not math.isfinite(step_loss) else f"the gradient norm is {grad_norm}"
            raise TrainingError(self._diverged(f"{what} at step {step}"))
        return values[0]

    def _diverged(self, what: str) -> str:
        last = (
            f"last finite loss {self._last_finite[1]:.4f} at step {self._last_finite[0]}"
            if self._last_finite
            else "no finite loss seen in this run"
        )
        return (
            f"training diverged: {what} ({last}). Nothing of this state was saved: every checkpoint in "
            f"{self.job_dir} is from before it. Lower training.max_lr or set training.max_grad_norm, then start "
            "again to resume from there."
        )

    def _synchronize(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def _paused(self, work) -> tuple[object, float]:
        """Run ``work`` (a save, a validation) as a pause the step timing leaves out: (its result, seconds)."""
        # Training kernels still queued belong to the steps, not to the pause.
        self._synchronize()
        began = time.perf_counter()
        result = work()
        self._synchronize()
        seconds = time.perf_counter() - began
        self.clock.pause(seconds)
        return result, seconds

    def validate(self) -> float:
        """Mean loss per token over the fixed held-out windows; ranks share them, and all get the result."""
        windows, ranks = self.eval_windows, self.env.world_size
        mine = windows[self.env.rank :: ranks]
        batch = self.config.training.batch_per_device
        batches = math.ceil(math.ceil(len(windows) / ranks) / batch)
        vocab_size = self.model_config.vocab_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        self.model.eval()
        with torch.no_grad():
            for index in range(batches):
                chunk = mine[index * batch : (index + 1) * batch]
                # Every rank runs the same number of forward passes (FSDP gathers weights in each one);
                # a rank out of windows computes one stand-in window and does not count it.
                tokens = torch.stack([self.dataset.window(w) for w in chunk or windows[:1]]).to(self.env.device)
                with self.autocast:
                    logits = self.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, vocab_size), tokens[:, 1:].reshape(-1), reduction="sum")
                if chunk:
                    totals[0] += loss.double()
                    totals[1] += tokens[:, 1:].numel()
        self.model.train()
        if self.env.distributed:
            dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    def _evals_left(self) -> int:
        if not self.eval_windows:
            return 0
        interval = self.config.log.eval_interval
        return self.max_steps // interval - self.progress.step // interval

    def _report(self, lr: float, grad_norm: torch.Tensor | None, val_loss: float | None) -> None:
        """Progress line, metrics.jsonl record and event files (with _check_finite, the only place the loop waits
        for the device)."""
        steps = self.progress.step - self._log_step
        # Checked before anything is printed or written: a diverged step never reaches metrics.jsonl.
        loss_value = self._check_finite(self._loss_sum / (steps * self.grad_accum))
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        seconds, counted = self.clock.lap(time.perf_counter(), steps)
        self._loss_sum.zero_()
        self._log_step = self.progress.step
        if not self.env.master_process:
            return
        tokens_per_s = counted * self.global_batch * self.window_size / seconds if seconds > 0 else 0.0
        utilization = mfu(tokens_per_s / self.env.world_size, self.flops_per_token, self.peak_tflops)
        pace = self.clock.seconds_per_step()
        eta_s = eta_seconds(self.max_steps - self.progress.step, pace, self._evals_left(), self._eval_seconds)
        memory_gib = (
            torch.cuda.max_memory_allocated(self.env.device) / 2**30 if self.env.device.type == "cuda" else None
        )
        grad_norm_value = grad_norm.item() if grad_norm is not None else None
        record = {
            METRIC_STEP: self.progress.step,
            METRIC_MAX_STEPS: self.max_steps,
            "epoch": self.progress.epoch,
            METRIC_LOSS: loss_value,
            METRIC_LR: lr,
            METRIC_TOKENS_PER_S: tokens_per_s,
            "tokens_seen": self.progress.tokens_seen,
            METRIC_TIME: time.time(),
        }
        optional = {
            METRIC_GRAD_NORM: grad_norm_value,
            METRIC_VAL_LOSS: val_loss,
            METRIC_MFU: utilization,
            METRIC_MAX_ALLOCATED_GIB: memory_gib,
            METRIC_ETA_S: eta_s if pace is not None else None,
        }
        record.update({key: value for key, value in optional.items() if value is not None})
        line = (
            f"step {self.progress.step}/{self.max_steps} | epoch {self.progress.epoch} "
            f"| loss {loss_value:.4f} | lr {lr:.3e}"
        )
        if grad_norm_value is not None:
            line += f" | grad_norm {grad_norm_value:.3f}"
        if val_loss is not None:
            line += f" | val_loss {val_loss:.4f}"
        line += f" | {tokens_per_s:,.0f} tokens/s | mfu {'n/a' if utilization is None else f'{utilization:.1%}'}"
        if memory_gib is not None:
            line += f" | mem {memory_gib:.2f} GiB"
        line += f" | eta {_duration(eta_s) if pace is not None else 'n/a'}"
        self.log(line)
        try:
            with open(self.job_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as error:
            # On a full disk the checkpoint being written has usually failed too, and its error says more.
            self.checkpointer.wait()
            raise TrainingError(f"cannot append to {self.job_dir / METRICS_FILE}: {error.strerror}") from None
        self.events.scalars(
            self.progress.step,
            {
                TAG_TRAIN_LOSS: loss_value,
                TAG_TRAIN_LR: lr,
                TAG_TRAIN_GRAD_NORM: grad_norm_value,
                TAG_VAL_LOSS: val_loss,
                TAG_TOKENS_PER_S: tokens_per_s,
                TAG_MFU: utilization,
                TAG_MAX_ALLOCATED_GIB: memory_gib,
            },
        )

    def save_checkpoint(self, reason: str) -> Path:
        """Checkpoint now (all ranks call this). Periodic saves finish in the background; the others wait.

        Refuses (TrainingError) when the run diverged since the last check: no checkpoint, emergency ones
        included, ever holds non-finite state, so retention never pushes out the last good one.
        """
        self._check_finite()
        extra = {
            "config_hash": self.config.config_hash(),
            "max_steps": self.max_steps,
            "window_size": self.window_size,
            "global_batch": self.global_batch,
        }
        try:
            path = self.checkpointer.save(
                self.model,
                self.optimizer,
                self.scheduler,
                self.model_config,
                self.progress,
                reason,
                extra,
                wait=reason != REASON_PERIODIC,
            )
        except NonFiniteWeights as error:
            raise TrainingError(
                self._diverged(f"the weights after step {self.progress.step} are not finite ({error})")
            ) from None
        if self.events is not None:
            self.events.checkpoint(self.progress.step, path.name, reason)
        if reason == REASON_FINAL:
            self.log(f"final checkpoint {path}")
        elif reason == REASON_EMERGENCY:
            self.log(f"emergency checkpoint {path} (step {self.progress.step}/{self.max_steps})")
        return path

    def close(self) -> None:
        """Finish a save in progress and stop the DataLoader workers. Call it when done with a Trainer."""
        # Dropping the iterator and the loader (which keeps persistent workers' iterator) shuts the workers
        # down now, through their queues; left to interpreter exit, they would be sent SIGTERM, which they ignore.
        self._batches = None
        self.loader = None
        self.checkpointer.wait()
        if self.events is not None:
            # After an emergency stop too: the steps logged since the last flush reach the disk.
            self.events.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def dry_run(config: TrainerConfig) -> int:
    """Print the resolved config, world size, device and resume decision; train nothing, change nothing."""
    rank, local_rank, world_size = world_from_environment()
    check_parallel_mode(config.parallel.parallel_mode, world_size)
    device = resolve_device(config.training.device, local_rank)
    training = config.training
    grad_accum = resolve_grad_accum_steps(training, world_size)
    if rank != 0:
        return 0
    print(describe(config))
    print(f"world size: {world_size}")
    derived = " (derived from global_batch_size)" if training.global_batch_size is not None else ""
    print(
        f"global batch: batch_per_device({training.batch_per_device}) * grad_accum_steps({grad_accum}){derived}"
        f" * world_size({world_size}) = {training.batch_per_device * grad_accum * world_size} sequences per step"
    )
    print(f"device: {device}")
    print(f"resume decision: {_resume_decision(config)}")
    return 0


def _resume_decision(config: TrainerConfig) -> str:
    job_dir = Path(config.ckpt.ckpt_dir)
    latest = latest_complete_checkpoint(job_dir)
    if latest is None:
        return f"start from base model {config.ckpt.param_path} (no checkpoint in {job_dir})"
    try:
        step = read_meta(latest).get("step")
    except (OSError, ValueError) as error:
        return f"newest checkpoint {latest.path} has an unreadable meta.json ({error}); a run skips it for older ones"
    if isinstance(step, int) and step >= config.training.max_steps:
        return f"already at max_steps ({config.training.max_steps}): {latest.path}; a run exits at once"
    return f"resume from {latest.path} (epoch {latest.epoch}, step {latest.step}), or an older one if it fails to load"


def main(argv: list[str] | None = None) -> int:
    try:
        config, is_dry_run = parse_args(argv)
        if is_dry_run:
            return dry_run(config)
        stop = GracefulStop()
        # Installed before anything slow, so a stop during setup is honoured at the first step boundary.
        stop.install()
        env = init_distributed(config.parallel.parallel_mode, config.training.device)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        _train(config, env, stop)
    except (ConfigError, DataError, ModelLoadError, SetupError, CheckpointError, TrainingError) as error:
        print(f"error: {error}", file=sys.stderr)
        if env.watch is not None:
            env.watch.finish()
        # No destroy_process_group: another rank may be waiting in a collective, and it would hang this one.
        # Exiting lets torchrun end the job.
        return 2 if isinstance(error, ConfigError) else 1
    except RuntimeError:
        if env.watch is not None:
            # A collective failed: when a node was lost, the watch names it and ends this process.
            env.watch.explain()
        raise
    stop.finish()
    shutdown_distributed(env)
    return 0


def _train(config: TrainerConfig, env: DistEnv, stop: GracefulStop) -> None:
    """Run a trainer to its end; once this returns, nothing refers to its model or optimizer any more."""
    trainer = Trainer(config, env, stop)
    try:
        trainer.train()
    finally:
        trainer.close()
