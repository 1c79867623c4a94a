"""The training loop: resume or start a run, take optimizer steps, report, validate, checkpoint, stop.

`python -m astrai.train` (astrai/train.py) runs :func:`main`, which decides from the
job dir whether there is anything to do, builds a :class:`Trainer` and trains it to
the end. Each concern has its own owner, which the loop only calls:

- :func:`astrai.trainer.checkpoint.manager.load_latest` and :class:`CheckpointManager`: resume and save;
- :mod:`astrai.trainer.models.optim`: the optimizer and the learning rate of every step;
- :class:`astrai.trainer.run.health.DivergenceRecord`: non-finite losses and gradient norms;
- :class:`astrai.trainer.run.report.ProgressReporter`: progress lines, metrics.jsonl, event files, ETA;
- :class:`astrai.trainer.run.validation.Validator`: the held-out loss.

In-process use (benchmarks, tests)::

    trainer = open_trainer(load_trainer_config(path, [("max_steps", "1000")]), init_distributed("none", "cpu"))
    stats = trainer.train(steps=50)               # stats.tokens_per_s
    trainer.save_checkpoint(REASON_EMERGENCY)     # waits; "periodic" returns once the state is copied
    trainer.close()
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from astrai.common.backends import LibraryModel
from astrai.common.checkpoints import checkpoint_name, latest_complete_checkpoint
from astrai.common.config import TrainerConfig, describe, ignored_keys_note, parse_args
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    ENV_STOPPED_EXIT_CODE,
    REASON_EMERGENCY,
    REASON_FINAL,
    REASON_PERIODIC,
    TRACKER_TENSORBOARD,
)
from astrai.common.errors import AstraiError
from astrai.common.plan import RunPlan, resolve_plan
from astrai.trainer.checkpoint.files import SCHEDULE, LoadedCheckpoint, NonFiniteWeights, Progress
from astrai.trainer.checkpoint.formats import FORMATS
from astrai.trainer.checkpoint.manager import CheckpointManager, RunFacts, load_latest
from astrai.trainer.checkpoint.state import run_state
from astrai.trainer.launch.determinism import make_deterministic
from astrai.trainer.launch.distributed import (
    DistEnv,
    GracefulStop,
    check_parallel_mode,
    init_distributed,
    resolve_device,
    shutdown_distributed,
    world_from_environment,
)
from astrai.trainer.models.backend import backend_named
from astrai.trainer.models.compiling import failed_in_compiler
from astrai.trainer.models.lora import parameter_counts
from astrai.trainer.models.optim import Schedule, apply_settings, build_optimizer, describe_changes, set_lr
from astrai.trainer.models.parallel import set_gradient_sync
from astrai.trainer.objectives.rewards import StepAbandoned
from astrai.trainer.run import build
from astrai.trainer.run.evaluation import open_evaluation
from astrai.trainer.run.health import Diverged, DivergenceRecord
from astrai.trainer.run.report import (
    ProgressReporter,
    ReportError,
    StepReport,
    flops_per_token,
    peak_tflops,
    print_line,
)
from astrai.trainer.run.trackers import Trackers, flat_params
from astrai.trainer.run.validation import Validator


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


def open_trainer(
    config: TrainerConfig,
    env: DistEnv,
    stop: GracefulStop | None = None,
    objective: build.ObjectiveBuilder = build.build_objective,
) -> Trainer | None:
    """A Trainer resuming the newest checkpoint that loads (or starting fresh), or None when the run is done.

    Whether the run is already at max_steps is decided here, from the checkpoint alone: nothing is built
    for a run that has nothing left to do. ``objective`` builds the run's objective from its parts (by default the
    one ``training.train_type`` names).
    """
    # Resolved before anything is loaded: a world size that does not fit the global batch fails at once.
    plan = resolve_plan(config, env.device.type, env.world_size, env.parallel_mode, inspect=inspect_library_model)
    if plan.deterministic:
        make_deterministic()  # a no-op when main() did it; in-process use (tests, benchmarks) needs it here
    # Rank 0 reads the whole checkpoint and every rank receives it, or (sharded under FSDP) each rank reads its own
    # rows of the weights and moments once the model is built and sharded.
    format = FORMATS[plan.ckpt_format]
    loaded = load_latest(Path(config.ckpt.ckpt_dir), env, _logger(env), format.reads_whole(env), plan.backend)
    max_steps = config.training.max_steps
    if loaded is not None and loaded.progress.step >= max_steps:
        _logger(env)(
            f"already at max_steps ({max_steps}): {loaded.checkpoint.path} "
            f"is at step {loaded.progress.step}; nothing to do"
        )
        return None
    return Trainer(config, env, stop, loaded, plan, objective)


class Trainer:
    """One run, built from its config and the checkpoint it resumes (None: from the base model).

    ``train()`` runs the loop; ``close()`` finishes a save in progress and stops the workers.
    """

    def __init__(
        self,
        config: TrainerConfig,
        env: DistEnv,
        stop: GracefulStop | None,
        loaded: LoadedCheckpoint | None,
        plan: RunPlan,
        objective: build.ObjectiveBuilder = build.build_objective,
    ):
        self.config = config
        self.plan = plan
        self.env = env
        self.stop = stop or GracefulStop()
        self.log = _logger(env)
        training = config.training
        self.max_steps, self.window_size = training.max_steps, config.data.window_size
        self.job_dir = Path(config.ckpt.ckpt_dir)
        self.train_type = training.train_type
        self.grad_accum, self.global_batch, self.tokens_per_step = (
            plan.grad_accum,
            plan.global_batch,
            plan.tokens_per_step,
        )
        data = build.open_run_data(config, env)
        notes = build.resume_notes(loaded, config, plan, data.digest)
        start = build.typed_start(config, build.read_start(config, plan, env, data, loaded))
        self.model_config = start.model_config
        records = build.post_training_records(config, plan, data, self.log, start.model_config)
        feed = build.build_feed(config, env, data, start, plan.batch, records)
        self.dataset, self.sampler, self.mixture, self.source_names = (
            feed.dataset,
            feed.sampler,
            feed.mixture,
            data.names,
        )
        self.model = build.build_model(config, plan, env, start)
        self.router_balance = backend_named(plan.backend).router_balance(self.model)
        """A mixture of experts' load-balancing loss and metrics; None for a dense model."""
        start = dataclasses.replace(start, weights=None, adapters=None)  # in the model now: not held twice
        release_freed_memory()
        trainable = build.describe_trainable(self.model, plan)
        if trainable is not None:
            self.log(trainable)
        self.optimizer = build_optimizer(self.model, training, env.device, env.parallel_mode)
        self.schedule = Schedule.of(training)
        self.progress = Progress()
        # Everything a checkpoint holds besides the model and the optimizer; a new part is one more entry here.
        self.autocast = build.autocast_for(plan)
        parts = build.RunParts(config, plan, env, self.log, start, records, feed, self.model, loaded, self.stop)
        built = objective(parts)
        self.objective = built.objective
        self.evaluation = open_evaluation(parts, data.first)
        """Generative evaluation in the loop (log.eval_prompts); None without."""
        own = {**self.objective.parts(), **(self.evaluation.parts() if self.evaluation is not None else {})}
        self.parts = run_state(self.progress, self.schedule, env, training.random_seed, self.log, **own)
        facts = build.run_facts(config, plan, data, built, start)
        self.checkpointer = self._checkpointer(facts, data, start)
        if env.watch is not None and env.master_process:
            # A node lost while a periodic save is being written: publish it before this process exits (the full
            # format's; a sharded save needs every rank's part, so it stays an unpublished staging folder).
            env.watch.before_exit = self.checkpointer.finish_pending
        self._resume_or_start(loaded, notes, start.source)
        if self.mixture is not None:
            self._note_mixture(feed.splits)
        self.loader = build.make_loader(config, env, feed)
        self._batches = None
        if self.sampler.num_windows - self.progress.samples_in_epoch < self.global_batch:
            # The global batch grew, or the data shrank, since the checkpoint: the rest of that epoch
            # no longer fills a step.
            self.progress.epoch, self.progress.samples_in_epoch = self.progress.epoch + 1, 0
        self._start_epoch()
        self.health = DivergenceRecord(config.log.log_interval, env, self.grad_accum, self.job_dir, self.progress.step)
        self.validator = self._validator(feed)
        self.reporter = self._reporter(loaded)
        self._last_checkpoint: Path | None = loaded.checkpoint.path if loaded is not None else None
        self._loss_sum = torch.zeros((), device=env.device)
        self._step_loss = torch.zeros((), device=env.device)
        self._warmed_up = False
        self._fresh = True

    def _validator(self, feed: build.Feed) -> Validator:
        batch, interval = self.config.training.batch_per_device, self.config.log.eval_interval
        return Validator(self.dataset, self.objective, feed.eval_windows, batch, self.env, self.autocast, interval)

    def _checkpointer(self, facts: RunFacts, data: build.RunData, start: build.Start) -> CheckpointManager:
        config = self.config
        return CheckpointManager(
            self.job_dir,
            self.env,
            self.log,
            model=self.model,
            optimizer=self.optimizer,
            parts=self.parts,
            model_config=self.model_config,
            facts=facts,
            interval=config.ckpt.ckpt_interval,
            keep_last=config.ckpt.keep_last,
            # A checkpoint is a complete model folder: the data's tokenizer goes into each one, and the model's
            # generation settings (its stop tokens) stay with it.
            extra_files=build.carried_files(data.first, start.source),
            format=FORMATS[self.plan.ckpt_format],
        )

    def _resume_or_start(self, loaded: LoadedCheckpoint | None, notes: list[str], source: Path) -> None:
        """Restore the optimizer and every part from the checkpoint, or seed a fresh start (before the loader runs)."""
        if loaded is not None:
            self.checkpointer.restore(loaded)
            # The checkpoint brought the optimizer's moments; its settings are this run's config.
            apply_settings(self.optimizer, self.config.training)
            self._note_resume(loaded, notes)
            return
        torch.manual_seed(self.config.training.random_seed + self.env.rank)
        if self.env.master_process:  # rank 0 read the base model
            plan = self.plan
            what = backend_named(plan.backend).describe(source, plan)
            self.log(
                f"starting from base model {self.config.ckpt.param_path}: {what} "
                f"(world size {self.env.world_size}, device {self.env.device})"
            )

    def _reporter(self, loaded: LoadedCheckpoint | None) -> ProgressReporter:
        env = self.env
        device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
        return ProgressReporter(
            self.job_dir,
            master=env.master_process,
            max_steps=self.max_steps,
            tokens_per_step=self.tokens_per_step,
            world_size=env.world_size,
            flops_per_token_=flops_per_token(self.model_config, self.window_size),
            peak=peak_tflops(device_name, self.config.log.peak_tflops),
            resumed_step=self.progress.step,
            log=self.log,
            tag=build.trainable_tag(self.model, self.plan),
            tensorboard=TRACKER_TENSORBOARD in self.config.log.report_to,
            trackers=self._trackers(loaded),
        )

    def _trackers(self, loaded: LoadedCheckpoint | None) -> Trackers | None:
        """MLflow and W&B runs (log.report_to) on global rank 0: resumed runs continue the checkpoint's."""
        if not self.env.master_process or not self.config.log.trackers:
            return None
        trainable, frozen = parameter_counts(self.model)
        params = {
            **flat_params(self.config.to_dict()),
            "config_hash": self.config.config_hash(),
            "world_size": str(self.env.world_size),
            "parallel_mode": self.env.parallel_mode,
            "global_batch": str(self.global_batch),
            "parameters_total": str(trainable + frozen),
            "parameters_trainable": str(trainable),
        }
        return Trackers(
            self.config.log,
            self.job_dir,
            resumed_step=loaded.progress.step if loaded is not None else None,
            saved=loaded.meta.trackers if loaded is not None else None,
            params=params,
            log=self.log,
        )

    def _note_mixture(self, splits) -> None:
        """Each source's share, its size, and how often this run goes over it."""
        quotas, total = self.mixture.quotas, sum(self.mixture.quotas)
        samples = self.max_steps * self.global_batch
        parts = [
            f"{name}: {quota / total:.1%} of the windows, {split.num_train:,} windows, "
            f"{samples * quota / total / split.num_train:.2f} epochs over this run"
            for name, quota, split in zip(self.source_names, quotas, splits, strict=True)
        ]
        self.log(f"mixture of {len(parts)} sources: " + "; ".join(parts))

    def tokens_per_source(self) -> dict[str, int] | None:
        """Tokens trained from each source so far (None without a mixture): a function of the data position."""
        if self.mixture is None:
            return None
        counts = self.mixture.drawn(self.progress.samples_in_epoch)
        return {name: count * self.window_size for name, count in zip(self.source_names, counts, strict=True)}

    def _note_resume(self, loaded: LoadedCheckpoint, notes: list[str]) -> None:
        p, meta = loaded.progress, loaded.meta
        self.log(
            f"resumed from {loaded.checkpoint.path} (epoch {p.epoch}, step {p.step}, reason {meta.reason}; "
            f"world size {self.env.world_size}, device {self.env.device})"
        )
        changes = describe_changes(
            self.parts.parts[SCHEDULE].saved,
            loaded.optimizer_state.get("param_groups", []),
            self.schedule,
            self.config.training,
            p.step,
        )
        for note in [changes, *notes]:
            if note is not None:
                self.log(f"note: {note}")
        if meta.global_batch is not None and meta.global_batch != self.global_batch:
            self.log(
                f"note: the global batch changed since that checkpoint ({meta.global_batch} -> {self.global_batch} "
                f"sequences per step, world size {meta.world_size} -> {self.env.world_size}); set "
                "training.global_batch_size to keep it across world sizes"
            )

    def _start_epoch(self) -> None:
        self.sampler.set_position(self.progress.epoch, self.progress.samples_in_epoch)
        self._batches = iter(self.loader)

    # Training

    def train_step(self) -> tuple[float, torch.Tensor | None]:
        """One optimizer step over ``grad_accum`` micro-batches: (its learning rate, its gradient norm or None).

        Leaves the step's summed micro-batch loss in the divergence record and in the report's running sum;
        nothing here waits for the device.
        """
        accum = self.grad_accum
        lr = self.schedule.lr(self.progress.step)
        set_lr(self.optimizer, lr)
        # A step that trains again on the completions of an earlier one (num_iterations) takes no new data.
        self._fresh = self.objective.takes_batch(self.progress.step)
        batches = [next(self._batches) for _ in range(accum)] if self._fresh else [None] * accum
        prepared = self.objective.prepare_step(batches, self.model, self.progress.step)
        for micro, (batch, extra) in enumerate(zip(batches, prepared, strict=True)):
            set_gradient_sync(self.model, self.env, micro == accum - 1)
            with self.autocast:
                loss, reported = self.objective.micro(self.model, batch, extra, accum)
                balance = self.router_balance.loss(accum) if self.router_balance is not None else None
                if balance is not None:
                    loss = loss + balance
            loss.backward()
            self._step_loss += reported
        grad_norm = None
        max_norm = self.config.training.max_grad_norm
        if max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # Under FSDP the local part is enough: a non-finite part makes the whole norm non-finite.
        local_norm = grad_norm.to_local() if isinstance(grad_norm, DTensor) else grad_norm
        self.health.record(self.progress.step, self._step_loss, local_norm)
        self._loss_sum += self._step_loss
        self._step_loss.zero_()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, grad_norm

    def train(self, steps: int | None = None) -> TrainStats:
        """Train until max_steps, a stop signal, or ``steps`` more optimizer steps; checkpoints as configured."""
        end = self.max_steps if steps is None else min(self.max_steps, self.progress.step + steps)
        first_step, first_tokens = self.progress.step, self.progress.tokens_seen
        tokens_per_step = self.tokens_per_step
        self.model.train()
        # Progress reports average over the steps of this call.
        started = time.perf_counter()
        self.reporter.clock.restart(started)
        self._report_step, self._report_tokens = first_step, first_tokens
        self._loss_sum.zero_()
        stopping = self._pending_evaluation()
        while self.progress.step < end and not stopping:
            try:
                lr, grad_norm = self._compiled(self.train_step)
            except StepAbandoned:
                self._abandoned_step()
                stopping = True
                break
            if not self._warmed_up:
                # The first step allocates, picks kernels and compiles (model.compile): a pause, not the pace.
                self._synchronize()
                self.reporter.clock.pause(time.perf_counter() - started, steps=1)
                self._warmed_up = True
            # The reward types' steps hold as many tokens as their prompts and completions.
            self._advance(self.objective.step_tokens(tokens_per_step))
            # A failed background save stops the run now, on every rank at the same step, not at the next save.
            stopping, save_failed = self.stop.agree(self.env, self.checkpointer.failed)
            if save_failed:
                self.checkpointer.raise_failure()
            if stopping:
                who = self.stop.signal_name or "on another rank"
                self.log(f"stop requested ({who}): stopping after step {self.progress.step}")
            step = self.progress.step
            val_loss = validated = evaluated = None
            if self.validator.due(step):
                (val_loss, validated), self.validator.last_seconds = self._paused(self._validate)
            if self.evaluation is not None and self.evaluation.due(step):
                if stopping:  # a stop does not wait for it: the resumed run evaluates this step first
                    self.evaluation.pending.step = step
                else:
                    evaluated = self._paused(self._evaluate)[0]
                    stopping = evaluated is None
            reported = val_loss is not None or evaluated is not None
            if step % self.config.log.log_interval == 0 or step == self.max_steps or stopping or reported:
                self._report(lr, grad_norm, val_loss, evaluated, validated)
            reason = self.checkpointer.reason_for(step, stopping)
            if reason is not None:
                self._paused(functools.partial(self.save_checkpoint, reason))
        self._synchronize()
        steps_done = self.progress.step - first_step
        tokens = self.progress.tokens_seen - first_tokens
        return TrainStats(steps_done, tokens, time.perf_counter() - started, stopped=stopping)

    def _abandoned_step(self) -> None:
        """A stop came while the step's rewards were computed (every rank gave the step up): the weights, the
        optimizer and the data position are still the last completed step's, which the emergency checkpoint keeps
        (unless a checkpoint of that step is there already)."""
        self.optimizer.zero_grad(set_to_none=True)
        who = self.stop.signal_name or "on another rank"
        self.log(
            f"stop requested ({who}) while the rewards of step {self.progress.step + 1} were computed: that step is "
            f"given up, the run stops after step {self.progress.step}"
        )
        saved = self._last_checkpoint is not None and self._last_checkpoint.name == checkpoint_name(
            self.progress.epoch, self.progress.step
        )
        if not saved and self.progress.step > 0:
            self._paused(functools.partial(self.save_checkpoint, REASON_EMERGENCY))

    def _compiled(self, step):
        """Run ``step``; a failure of torch.compile in it (model.compile) is a CompileError naming the setting."""
        try:
            return step()
        except Exception as error:
            if not self.plan.compile or not failed_in_compiler(error):
                raise
            raise CompileError(
                f"model.compile: compiling the model failed ({type(error).__name__}: {str(error).strip()[:400]}); "
                "set model.compile: false (or -- --compile false) to train without compiling"
            ) from error

    def _advance(self, tokens_per_step: int) -> None:
        """Count the step just taken; move to the next epoch when the rest of this one cannot fill a step."""
        progress = self.progress
        progress.step += 1
        progress.tokens_seen += tokens_per_step
        if not self._fresh:
            return
        progress.samples_in_epoch += self.global_batch
        if self.sampler.num_windows - progress.samples_in_epoch < self.global_batch:
            progress.epoch, progress.samples_in_epoch = progress.epoch + 1, 0
            self._start_epoch()

    def _validate(self) -> tuple[float, dict[str, float]]:
        return self.validator.run(self.model)

    def _evaluate(self) -> dict | None:
        """The evaluation of the model at this step, or None when a stop came during it (on every rank): it is then
        still due, and the resumed run evaluates this step first."""
        step = self.progress.step
        try:
            return self.evaluation.run(self.model, step)
        except StepAbandoned:
            who = self.stop.signal_name or "on another rank"
            self.log(
                f"stop requested ({who}) during the evaluation of step {step}: it is given up, the run stops after "
                f"step {step} and evaluates it first when it resumes"
            )
            return None

    def _pending_evaluation(self) -> bool:
        """Evaluate the step the run stands at when its evaluation is due (the start's, log.eval_at_start, or one a
        stop cut short) and report it; whether a stop came during it."""
        if self.evaluation is None or self.evaluation.pending.step != self.progress.step:
            return False
        evaluated = self._paused(self._evaluate)[0]
        if evaluated is None:
            return True
        self.reporter.report_evaluation(self.progress.step, self.progress.epoch, self.progress.tokens_seen, evaluated)
        return False

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
        self.reporter.clock.pause(seconds)
        return result, seconds

    def _extra_metrics(self) -> dict | None:
        """The objective's own metrics, and the routers' of a mixture of experts."""
        extra = self.objective.metrics()
        if self.router_balance is None:
            return extra
        return {**(extra or {}), **self.router_balance.report()}

    def _report(
        self,
        lr: float,
        grad_norm: torch.Tensor | None,
        val_loss: float | None,
        evaluated: dict | None = None,
        validated: dict | None = None,
    ) -> None:
        """A progress report: the divergence check first, so a diverged step never reaches metrics.jsonl."""
        steps = self.progress.step - self._report_step
        loss = self.health.check(self.progress.step, self._loss_sum / (steps * self.grad_accum))
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self._loss_sum.zero_()
        # The mean tokens of the steps reported (a constant but for the online train types).
        self.reporter.tokens_per_step = (self.progress.tokens_seen - self._report_tokens) / steps
        self._report_step, self._report_tokens = self.progress.step, self.progress.tokens_seen
        memory = torch.cuda.max_memory_allocated(self.env.device) / 2**30 if self.env.device.type == "cuda" else None
        report = StepReport(
            step=self.progress.step,
            epoch=self.progress.epoch,
            loss=loss,
            lr=lr,
            tokens_seen=self.progress.tokens_seen,
            grad_norm=grad_norm.item() if grad_norm is not None else None,
            val_loss=val_loss,
            max_allocated_gib=memory,
            tokens_per_source=self.tokens_per_source(),
            extra=self._extra_metrics(),
            evaluation=evaluated,
            validation=validated or None,
        )
        step = self.progress.step
        pauses = [(self.validator.left(step, self.max_steps), self.validator.last_seconds)]
        if self.evaluation is not None:
            pauses.append((self.evaluation.left(step, self.max_steps), self.evaluation.last_seconds))
        try:
            self.reporter.report(report, steps, pauses)
        except ReportError as error:
            # On a full disk the checkpoint being written has usually failed too, and its error says more.
            self.checkpointer.wait()
            raise error

    def save_checkpoint(self, reason: str) -> Path:
        """Checkpoint now (all ranks call this). Periodic saves finish in the background; the others wait.

        Refuses (Diverged) when the run diverged since the last check: no checkpoint, emergency ones
        included, ever holds non-finite state, so retention never pushes out the last good one.
        """
        self.health.check(self.progress.step)
        trackers = self.reporter.trackers
        if trackers is not None:  # the tracker runs opened so far, so that a resume continues them
            self.checkpointer.facts = dataclasses.replace(self.checkpointer.facts, trackers=trackers.ids() or None)
        try:
            path = self.checkpointer.save(reason, wait=reason != REASON_PERIODIC)
        except NonFiniteWeights as error:
            raise Diverged(
                self.health.message(f"the weights after step {self.progress.step} are not finite ({error})")
            ) from None
        self.reporter.checkpoint(self.progress.step, path.name, reason)
        self._last_checkpoint = path
        if reason == REASON_FINAL:
            self.log(f"final checkpoint {path}")
        elif reason == REASON_EMERGENCY:
            self.log(f"emergency checkpoint {path} (step {self.progress.step}/{self.max_steps})")
        return path

    def close(self, state: str = "stopped") -> None:
        """Finish a save in progress, stop the DataLoader workers and end the tracker runs with ``state`` (finished,
        stopped, diverged or failed). Call it when done with a Trainer."""
        # Dropping the iterator and the loader (which keeps persistent workers' iterator) shuts the workers
        # down now, through their queues; left to interpreter exit, they would be sent SIGTERM, which they ignore.
        self._batches = None
        self.loader = None
        try:
            self.checkpointer.wait()
        finally:
            self.reporter.close(state, self._last_checkpoint)


class CompileError(AstraiError):
    """torch.compile failed on the model (model.compile)."""


def release_freed_memory() -> None:
    """Hand the memory of the base weights just read (now in the model) back to the system.

    glibc keeps freed blocks below its mmap threshold for reuse, so without this the copy read from disk would stay
    resident for the whole run whenever nothing else reuses it (LoRA, whose optimizer state is small).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _logger(env: DistEnv):
    """Print from rank 0 only."""
    return print_line if env.master_process else _silent


def _silent(message: str) -> None:
    pass


def dry_run(config: TrainerConfig) -> int:
    """Print the resolved config, the run plan and the resume decision; train nothing, change nothing."""
    rank, local_rank, world_size = world_from_environment()
    check_parallel_mode(config.parallel.parallel_mode, world_size)
    device = resolve_device(config.training.device, local_rank)
    plan = resolve_plan(config, device.type, world_size, inspect=inspect_library_model)
    if rank != 0:
        return 0
    print(describe(config))
    print(f"--- run plan (device {device}) ---")
    for line in plan.lines():
        print(line)
    note = ignored_keys_note(config.training, config.log)
    if note is not None:
        print(f"note: {note}")
    print(f"resume decision: {_resume_decision(config)}")
    return 2 if _start_checks(config, plan) is not None else 0


def inspect_library_model(folder: Path, lora: bool) -> LibraryModel:
    """What transformers builds for ``folder`` (the run plan's, on the transformers path): made on the meta device,
    every refusal of the folder itself made before anything starts (astrai.trainer.models.hf_model.inspect_folder)."""
    from astrai.trainer.models.hf_model import inspect_folder

    return inspect_folder(folder, lora)


def _start_checks(config: TrainerConfig, plan: RunPlan) -> str | None:
    """The refusals the trainer would make at its start from the config, the data and the model folders (the same
    function as preflight's); printed as a line, the refusal returned."""
    from astrai.common.backends import load_model_config
    from astrai.common.data_folder import DataError, TokenData
    from astrai.common.fit import SetupError, eval_prompt_units, open_eval_prompts, start_checks
    from astrai.common.model_folder import ModelLoadError

    latest = latest_complete_checkpoint(Path(config.ckpt.ckpt_dir))
    source = latest.path if latest is not None and latest.meta.lora is None else Path(config.ckpt.param_path)
    root, sources = Path(config.data.data_root_path), config.data.sources
    try:
        model = load_model_config(source, plan.backend)
        datas = [TokenData.open(root / s.path) for s in sources] if sources else [TokenData.open(root)]
    except (ModelLoadError, DataError) as error:
        if not source.exists() or not root.exists():  # a container's paths, read elsewhere: nothing to check here
            print(f"start checks: not made ({error})")
            return None
        print(f"start checks: refused: {error}")
        return str(error)
    try:
        for data in datas:
            data.check_kind(config.training.kind.data_kind, config.training.train_type)
        start_checks(config, plan.batch, datas, model, source)
        if plan.evaluation is not None:
            evaluated = open_eval_prompts(config.eval_prompts_folder())
            eval_prompt_units(plan.evaluation, evaluated, datas[0], model, config.data.overlong, source)
    except (SetupError, DataError) as error:
        print(f"start checks: refused: {error}")
        return str(error)
    print(f"start checks: passed (model {source}, data {root})")
    return None


def _resume_decision(config: TrainerConfig) -> str:
    job_dir = Path(config.ckpt.ckpt_dir)
    latest = latest_complete_checkpoint(job_dir)
    if latest is None:
        return f"start from base model {config.ckpt.param_path} (no checkpoint in {job_dir})"
    if latest.meta.step >= config.training.max_steps:
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
        if config.training.deterministic:
            make_deterministic()  # before CUDA starts (init_distributed may start it)
        env = init_distributed(config.parallel.parallel_mode, config.training.device)
    except ConfigError as error:
        for message in error.messages:  # every problem at once, a line each
            print(f"error: {message}", file=sys.stderr)
        return error.exit_code
    except AstraiError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    try:
        finished = _train(config, env, stop)
    except AstraiError as error:
        print(f"error: {error}", file=sys.stderr)
        if env.watch is not None:
            env.watch.finish()
        # No destroy_process_group: another rank may be waiting in a collective, and it would hang this one.
        # Exiting lets torchrun end the job.
        return error.exit_code
    except RuntimeError:
        if env.watch is not None:
            # A collective failed: when a node was lost, the watch names it and ends this process.
            env.watch.explain()
        raise
    stop.finish()
    shutdown_distributed(env)
    # A scheduler that retries what failed (a Kubernetes Job) must not take a stop short of the end for success.
    return 0 if finished else int(os.environ.get(ENV_STOPPED_EXIT_CODE, "0"))


def _train(config: TrainerConfig, env: DistEnv, stop: GracefulStop) -> bool:
    """Run a trainer to its end (True) or to a stop (False); once this returns, nothing refers to its model or
    optimizer any more."""
    trainer = open_trainer(config, env, stop)
    if trainer is None:
        return True
    state = "failed"
    try:
        trainer.train()
        finished = trainer.progress.step >= trainer.max_steps
        state = "finished" if finished else "stopped"
        return finished
    except Diverged:
        state = "diverged"
        raise
    finally:
        trainer.close(state)
