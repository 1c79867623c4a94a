"""`invoke preflight`: every check that can fail before a job starts, as one checklist.

Each check says what it found; a failed one also says what to do. The schema
check comes first (``resolve_runtime`` raises before any of this runs); the
rest run even after a failure, so one pass shows every problem. Preflight only
looks: it creates, writes and deletes nothing (the job dir is made by `invoke
init` or `start`).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from astrai.common.backends import (
    BACKEND_AUTO,
    BACKEND_TRANSFORMERS,
    LibraryModel,
    TransformersConfig,
    describe_backend,
    folder_model_type,
    load_model_config,
    resolve_backend,
    through_transformers,
)
from astrai.common.checkpoints import estimate_checkpoint_bytes, folder_bytes, latest_complete_checkpoint
from astrai.common.config import TrainerConfig, ignored_keys_note
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    CKPT_FORMAT_LORA,
    CKPT_FORMAT_SHARDED,
    LABEL_CUDA_TAG,
    LABEL_TORCH,
    MODEL_CONFIG_FILE,
    TORCH_VERSION,
    WEIGHTS_INDEX_FILE,
    resolve_parallel_mode,
)
from astrai.common.data_folder import DataError, TokenData, data_digest, describe_units
from astrai.common.fit import (
    SetupError,
    check_model_tokenizer,
    check_resume,
    check_same_tokenizer,
    completion_room,
    prompt_room,
    start_checks,
    tokenizer_hint,
)
from astrai.common.memory import DEVICE_USABLE_SHARE, activation_bytes, training_state_bytes
from astrai.common.model_folder import (
    ModelConfig,
    ModelLoadError,
    describe,
    inspect_weights,
    num_adapter_parameters,
    num_parameters,
    other_base,
    weight_files,
)
from astrai.common.nf4 import MIN_CUDA_CAPABILITY, MIN_TORCH, NF4
from astrai.common.paths import folder_problem, length_problem, nearest_existing, read_only
from astrai.common.plan import RunPlan, resolve_plan
from astrai.common.settings import LoRASettings
from astrai.common.values import format_bytes
from astrai.host import compose, engine
from astrai.host.checklist import FAIL, PASS, SKIP, WARN, Check
from astrai.host.environment_checks import agent_checks, environment_checks
from astrai.host.eval_checks import evaluation_check
from astrai.host.harness import harness_check
from astrai.host.hostuser import host_user_ids
from astrai.host.reward_checks import reward_checks
from astrai.host.runtime import JOB_DIR_ROOM, Runtime, split_endpoint
from astrai.host.tracker_checks import tracker_checks
from astrai.host.trainer_config import fix_hint, host_path, read_trainer_config

NET_CLASS_DIR = Path("/sys/class/net")
CONNECT_TIMEOUT_SECONDS = 3
CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
READ, WRITE, EXECUTE = 4, 2, 1


TRAINER_CONFIG = "trainer config"
"""The check of the trainer's sections, whose failure makes preflight exit 2."""


def run_checks(runtime: Runtime, trainer_args: list[str] = (), *, this_host: bool = True) -> list[Check]:
    """Run every check for a validated runtime (and the trainer arguments after ``--``); changes nothing on disk.

    The trainer's config is read once, with the arguments, and that one object goes to every check that
    needs it (data, model, how they fit), so preflight judges what the container will run. ``this_host`` false
    (a Slurm login host) leaves out what only the job's own host answers: its Docker engine and its GPUs.
    """
    checks = [Check(PASS, "schema", f"{runtime.config_path}: runtime block is valid (job {runtime.job_name})")]
    config, check = _trainer_config_check(runtime, trainer_args)
    checks.append(check)
    if this_host:
        checks += _docker_checks()
    data, check = _data_check(runtime, config)
    checks.append(check)
    checks.append(_job_dir_check(runtime))
    model, check = _model_check(runtime, config)
    checks.append(check)
    if runtime.node == 0:
        units, check = _fit_check(runtime, config, data, model)
        checks.append(check)
        checks.append(_training_state_check(runtime, config, model, units))
        latest = _latest_checkpoint(runtime)
        if latest is not None and config is not None and data is not None:
            checks.append(_resume_check(runtime, latest, config, data))
        if config is not None and config.training.kind.reference:
            checks.append(_reference_check(runtime, config, model, data))
        if config is not None and (evaluation := evaluation_check(runtime, config, data, model)) is not None:
            checks.append(evaluation)
        if config is not None:
            checks += tracker_checks(runtime, config)
            if this_host:
                checks += reward_checks(runtime, config, _plan_or_none(runtime, config))
        if this_host:
            checks += agent_checks(runtime, config, trainer_args)
            checks += environment_checks(runtime, config)
    checks.append(_disk_space_check(runtime, config))
    if runtime.multi_node:
        checks += node_checks(runtime)
        if config is not None:
            checks.append(shared_checkpoints_check(runtime, config))
    if this_host:
        if runtime.uses_gpu:
            checks.append(_gpu_runtime_check())
            checks.append(_gpu_indices_check(runtime))
        checks.append(_compose_config_check(runtime))
        checks.append(_image_torch_check(runtime))
        checks += [check for check in (harness_check(runtime),) if check is not None]
    return checks


def config_refused(checks: list[Check]) -> bool:
    """Whether the trainer's config was refused (a command then exits 2, as for any rejected configuration)."""
    return any(check.failed and check.name == TRAINER_CONFIG for check in checks)


def format_checklist(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = []
    for check in checks:
        lines.append(f"{check.mark} {check.name.ljust(width)}  {check.detail}")
        if check.hint and check.mark in (FAIL, WARN):
            lines.append(f"  {' ' * width}  → {check.hint}")
    failed = sum(check.failed for check in checks)
    lines.append("preflight passed" if failed == 0 else f"preflight failed: {failed} check(s) need attention")
    return "\n".join(lines)


def _docker_checks() -> list[Check]:
    cli = shutil.which("docker")
    if cli is None:
        return [
            Check(FAIL, "docker CLI", "not found on PATH", "install Docker Engine (Debian: apt-get install docker.io)"),
            Check(SKIP, "docker daemon", "not checked without the CLI"),
            _compose_check(),
        ]
    checks = [Check(PASS, "docker CLI", cli)]
    try:
        version = engine.daemon_version()
        checks.append(Check(PASS, "docker daemon", f"reachable, engine {version}"))
    except engine.EngineError as error:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        checks.append(
            Check(
                FAIL,
                "docker daemon",
                f"{error} (DOCKER_HOST={where})",
                "start it (`sudo systemctl start docker`, or `sudo dockerd &`), or point DOCKER_HOST at a "
                "running engine; your user needs access to its socket (the docker group)",
            )
        )
    checks.append(_compose_check())
    return checks


def _compose_check() -> Check:
    try:
        program = compose.compose_program()
    except compose.ComposeError as error:
        return Check(FAIL, "compose v2", str(error))
    return Check(PASS, "compose v2", " ".join(program))


def _data_check(runtime: Runtime, config: TrainerConfig | None) -> tuple[list[TokenData] | None, Check]:
    """The data folder (or every source of a mixture) the trainer will read, opened the way the trainer opens it."""
    root = runtime.data_dir
    if config is not None:
        root = host_path(runtime, config.data.data_root_path) or root
    where = "runtime.paths.data" + ("" if root == runtime.data_dir else f" ({config.data.data_root_path})")
    sources = config.data.sources if config is not None else None
    names = [source.path for source in sources] if sources else [None]
    datas = []
    for name in names:
        folder = root / name if name else root
        place = f"{where}, data.sources {name}" if name else where
        problem = folder_problem(folder)
        if problem is not None:
            return None, Check(FAIL, "data", f"{place}: {problem}", f"fix runtime.paths.data in {runtime.config_path}")
        if not folder.is_dir():
            # `invoke init` creates runtime.paths.data itself; a mixture's source inside it only prepare makes.
            first = "" if name else "create it with `invoke init`, then "
            return None, Check(
                FAIL,
                "data",
                f"{place}: {folder} does not exist",
                f"{first}prepare data with `python -m astrai.data prepare --out {shlex.quote(str(folder))} FILE...`",
            )
        unreadable = _unreadable("data", [folder, *folder.iterdir()], folder)
        if unreadable is not None:
            return None, unreadable
        try:
            data = TokenData.open(folder)
            if config is not None:
                data.check_kind(
                    config.training.kind.data_kind, config.training.train_type, tokenizer_hint(runtime.model_dir)
                )
            datas.append(data)
        except DataError as error:
            return None, Check(
                FAIL, "data", f"{place}: {error}", "prepare the data with `python -m astrai.data prepare`"
            )
    if sources:
        try:
            check_same_tokenizer(datas, names)
        except SetupError as error:
            return None, Check(FAIL, "data", str(error))
        shares = ", ".join(f"{name} {data.num_tokens:,} tokens" for name, data in zip(names, datas, strict=True))
        return datas, Check(PASS, "data", f"{root}: mixture of {len(datas)} sources ({shares}); {_tokens_of(datas[0])}")
    data = datas[0]
    documents = f" in {data.documents:,} documents from {data.source_files} file(s)" if data.documents else ""
    return datas, Check(
        PASS,
        "data",
        f"{root}: {data.num_tokens:,} tokens{documents}, {len(data.shard_files)} shard(s); {_tokens_of(data)}",
    )


def _tokens_of(data: TokenData) -> str:
    return f"vocabulary {data.vocab_size} ({data.tokenizer_description})"


def _job_dir_check(runtime: Runtime) -> Check:
    """The job dir, or the folder it will be created in, is writable by the container's user."""
    path = runtime.job_dir
    existing = nearest_existing(path)
    fix = f"fix runtime.paths.checkpoints in {runtime.config_path}"
    if isinstance(existing, str):
        return Check(FAIL, "checkpoint dir", f"runtime.paths.checkpoints: {existing}", fix)
    too_long = length_problem(path, existing, JOB_DIR_ROOM)
    if too_long is not None:
        return Check(FAIL, "checkpoint dir", f"runtime.paths.checkpoints: {too_long}", fix)
    uid, gid = host_user_ids()
    where = path if existing == path else f"{existing} (where {path} will be created)"
    if read_only(existing):
        return Check(
            FAIL,
            "checkpoint dir",
            f"runtime.paths.checkpoints: {where} is on a read-only file system",
            f"remount it read-write, or {fix} to a folder on a writable disk",
        )
    if not os.access(existing, os.W_OK | os.X_OK) or not _container_may(existing, WRITE):
        return Check(
            FAIL,
            "checkpoint dir",
            f"runtime.paths.checkpoints: {where} is not writable by uid {uid}, which the container runs as",
            f"sudo chown {uid}:{gid} {existing}, or {fix}",
        )
    if existing != path:
        return Check(
            PASS,
            "checkpoint dir",
            f"{path} does not exist yet: `invoke init` or `start` creates it in {existing}, which uid {uid} may write",
        )
    return Check(PASS, "checkpoint dir", f"{path} is writable by uid {uid}")


def _model_check(runtime: Runtime, config: TrainerConfig | None) -> tuple[tuple[ModelConfig, Path] | None, Check]:
    """The model the job starts from: the newest checkpoint it resumes, else the base model (headers only)."""
    if runtime.node != 0:
        problem = folder_problem(runtime.model_dir) or (
            None if runtime.model_dir.is_dir() else f"{runtime.model_dir} does not exist"
        )
        if problem is not None:
            return None, Check(
                FAIL,
                "base model",
                f"runtime.paths.model: {problem}: every node mounts it (read-only), though only node 0 reads it",
                f"`{runtime.command('init')}` creates it empty, which is enough on node {runtime.node}",
            )
        return None, Check(
            SKIP,
            "base model",
            f"not needed on node {runtime.node}: node 0 reads the base model or the "
            "newest checkpoint and sends the state to every node",
        )
    latest = _latest_checkpoint(runtime)
    if latest is not None and latest.meta.lora is None:
        try:
            return (load_model_config(latest.path), latest.path), Check(
                PASS, "base model", f"not needed: the job resumes from {latest.path}"
            )
        except ModelLoadError as error:
            return None, Check(FAIL, "base model", f"the checkpoint to resume: {error}")
    folder = runtime.model_dir
    if config is not None:
        folder = host_path(runtime, config.ckpt.param_path) or folder
    problem = folder_problem(folder)
    if problem is not None:
        return None, Check(
            FAIL, "base model", f"runtime.paths.model: {problem}", f"fix runtime.paths.model in {runtime.config_path}"
        )
    init = (
        f"write one with `python -m astrai.model init {shlex.quote(str(folder))} --preset tiny`, or put a Hugging "
        "Face Llama-family model folder there (runtime.paths.model)"
    )
    try:
        backend = resolve_backend(
            config.model.backend if config is not None else BACKEND_AUTO, folder_model_type(folder)
        )
    except ValueError as error:
        return None, Check(FAIL, "base model", str(error))
    if backend == BACKEND_TRANSFORMERS:
        lora = config is not None and LoRASettings.of(config.training) is not None
        return _transformers_model_check(folder, init, lora)
    # The same reading and checks as the trainer's, from the file headers alone (no weights are read).
    try:
        model = ModelConfig.load(folder)
        weights = inspect_weights(folder, model)
    except ModelLoadError as error:
        return None, Check(FAIL, "base model", f"{error} and no checkpoint to resume", init)
    index = folder / WEIGHTS_INDEX_FILE
    files = [folder / MODEL_CONFIG_FILE, *weights.files, *([index] if len(weights.files) > 1 else [])]
    unreadable = _unreadable("base model", files, folder)
    if unreadable is not None:
        return None, unreadable
    found = f"{folder}: {describe(folder, model, weights)}"
    if latest is not None:  # a LoRA checkpoint: its adapters resume onto this base, which must be theirs
        problem = other_base(latest.path, latest.meta.lora, folder)
        if problem is not None:
            return None, Check(
                FAIL,
                "base model",
                problem,
                "set ckpt.param_path (or runtime.paths.model) back to the model the adapters were trained on",
            )
        found += f"; the LoRA adapters of {latest.path.name} resume onto it"
    return (model, folder), Check(PASS, "base model", found)


def _transformers_model_check(
    folder: Path, init: str, lora: bool
) -> tuple[tuple[TransformersConfig, Path] | None, Check]:
    """A base model trained through transformers: its config.json and weight files, and what the library builds of
    it, without its weights (:func:`library_model`): a folder the trainer would refuse at its start fails here."""
    try:
        model = TransformersConfig.load(folder)
        files = weight_files(folder)
    except ModelLoadError as error:
        return None, Check(FAIL, "base model", f"{error} and no checkpoint to resume", init)
    unreadable = _unreadable("base model", [folder / MODEL_CONFIG_FILE, *files], folder)
    if unreadable is not None:
        return None, unreadable
    built = library_model(folder, lora)
    if built.refused is not None:
        return None, Check(FAIL, "base model", built.refused)
    how = describe_backend(BACKEND_TRANSFORMERS, model.model_type, built.model)
    found = f"{folder}: model: {how}; {model.n_layers} layers, dim {model.dim}, vocab {model.vocab_size}"
    if built.unchecked is not None:
        found += f" (not built here: {built.unchecked}; the trainer builds it at its start, before anything else)"
    return (model, folder), Check(PASS, "base model", found)


LIBRARY_CHECK_SECONDS = 300
"""How long preflight waits for this host's Python to build a model folder through transformers (without weights)."""


class LibraryCheck(NamedTuple):
    """What :func:`library_model` found: what transformers builds, why the trainer refuses the folder, or why it
    could not be asked here (one of the three)."""

    model: LibraryModel | None = None
    refused: str | None = None
    unchecked: str | None = None


def library_model(folder: Path, lora: bool) -> LibraryCheck:
    """What transformers builds for ``folder`` on this host (:func:`astrai.trainer.models.hf_model.inspect_folder`, the
    trainer's own refusals), asked of ``python -m astrai.model check`` in a process of its own: the host never
    imports torch."""
    if importlib.util.find_spec("transformers") is None:
        return LibraryCheck(unchecked="transformers is not installed on this host")
    command = [sys.executable, "-m", "astrai.model", "check", str(folder), "--backend", BACKEND_TRANSFORMERS, "--json"]
    # The same astrai as this one, wherever the process starts.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run(
            [*command, *(["--lora"] if lora else [])],
            capture_output=True,
            text=True,
            env=env,
            timeout=LIBRARY_CHECK_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return LibraryCheck(unchecked=f"building it took over {LIBRARY_CHECK_SECONDS} s")
    said = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1].removeprefix("error: ")
    if result.returncode == 2:
        return LibraryCheck(refused=said)
    if result.returncode != 0:
        return LibraryCheck(unchecked=f"{' '.join(command[1:4])} failed ({said})")
    found = json.loads(result.stdout)
    return LibraryCheck(LibraryModel(found["model_type"], found["attention"], found["router_aux_loss_coef"]))


def _fit_check(
    runtime: Runtime,
    config: TrainerConfig | None,
    datas: list[TokenData] | None,
    model: tuple[ModelConfig, Path] | None,
) -> tuple[object, Check]:
    """Data, model and batch fit together: the trainer's own checks (vocabulary, window, one global batch); and the
    units the run trains on (None when not checked)."""
    if config is None or datas is None or model is None:
        return None, Check(SKIP, "data fits model", "not checked: see the lines above")
    training = config.training
    mixture = config.data.sources is not None
    try:
        plan = container_plan(runtime, config)
        world, batch = plan.batch.world_size, plan.batch
        window, kind = config.data.window_size, training.kind
        found = start_checks(config, batch, datas, *model)
        splits, units = found.splits, found.units
    except (SetupError, ModelLoadError, ConfigError, DataError) as error:
        return None, Check(FAIL, "data fits model", str(error))
    counted = "" if runtime.world_size is not None else " (world size from nvidia-smi)"
    windows = sum(split.num_train for split in splits)
    steps = "" if mixture else f", {windows // batch.global_batch:,} steps per epoch"
    what = kind.trains_on.format(window=window)
    detail = (
        ""
        if units is None or kind.learns_from_rewards
        else f" ({describe_units(units, sum(datas[0].record_counts), window, config.data.overlong)})"
    )
    if kind.online:
        left = units.truncated if config.data.overlong == "truncate" else units.dropped
        room = f"{left:,} longer than the room {completion_room(config.training)[1]} leaves: {config.data.overlong}"
        detail = f" ({room})" if left else ""
    return units, Check(
        PASS,
        "data fits model",
        f"{windows:,} training {what}{steps} at world size {world}{counted}{detail}",
    )


def _training_state_check(runtime: Runtime, config: TrainerConfig | None, model, units=None) -> Check:
    """What the training state takes per rank, for full fine-tuning and for LoRA with its base held in each of nf4,
    bfloat16 and float32: why LoRA (and a 4-bit base) fits where the rest does not; on GPUs, with a micro-batch's
    activations, whether the chosen one fits their memory (a warning when it does not); for the online types,
    generation's key/value caches beside it (``units``: the prompts the run samples). FAIL for an NF4 base on a GPU
    that cannot compute it."""
    if config is None or model is None:
        return Check(SKIP, "training state", "not estimated: see the lines above")
    model_config = model[0]
    if through_transformers(model_config):
        return Check(SKIP, "training state", "not estimated for a model trained through transformers")
    try:
        plan = container_plan(runtime, config, at_least_one=True)
    except ConfigError:
        return Check(SKIP, "training state", "not estimated: see the lines above")
    gpus = _gpus() if plan.device_type == "cuda" else []
    if plan.base_dtype == NF4:
        refused = _nf4_refusal(gpus)
        if refused is not None:
            return Check(FAIL, "training state", refused, "use training.lora_base_dtype bfloat16 on this host")
    sizes = _state_sizes(plan, config, model_config)
    found = sizes.line
    if plan.sampling is not None and units is not None and len(units):
        context, _ = prompt_room(model_config, plan.completion_room, model[1])
        cache = plan.generation_cache(model_config, context, max(units.takes))
        found += (
            f"; generation's key/value caches {format_bytes(cache.bytes)} ({cache.rows} rows of a round x "
            f"{cache.capacity} positions, split in parts where the device's memory calls for it)"
        )
    if not gpus:
        return Check(PASS, "training state", found)
    fits, verdict = _fits_gpus(plan, config, model_config, sizes, min(memory for _, memory, _ in gpus))
    return Check(PASS if fits else WARN, "training state", f"{found}; {verdict}")


@dataclass(frozen=True)
class _StateSizes:
    """The training state per rank of each choice (bytes), and the line that states them."""

    full: float
    lora: dict[str, float]
    """By the frozen base's dtype: nf4, bfloat16, float32."""
    chosen: str | None
    """The config's: None for full fine-tuning, else its base's dtype."""
    line: str


def _state_sizes(plan: RunPlan, config: TrainerConfig, model_config: ModelConfig) -> _StateSizes:
    world, training = plan.batch.world_size, config.training
    share = world if plan.parallel_mode == "fsdp" else 1
    total = num_parameters(model_config)
    rank = plan.lora.rank if plan.lora is not None else 16  # with LoRA off: what rank 16 would take
    adapters = num_adapter_parameters(model_config, rank, training.lora_targets)
    full = training_state_bytes(model_config, 0, None) / share
    lora = {dtype: training_state_bytes(model_config, adapters, dtype) / share for dtype in (NF4, *_WIDE_BASES)}
    chosen = plan.base_dtype if plan.lora is not None else None
    marked = {dtype: " (this config)" if dtype == chosen else "" for dtype in lora}
    per = f" per rank ({world} under FSDP)" if share > 1 else " per process"
    bases = ", ".join(f"{dtype} {format_bytes(size)}{marked[dtype]}" for dtype, size in lora.items())
    line = (
        f"{'LoRA' if chosen else 'full fine-tuning'} (this config){per}, weights + gradients + AdamW moments before "
        f"activations: full fine-tuning {format_bytes(full)} ({total:,} trainable); LoRA rank {rank} on "
        f"{len(training.lora_targets)} projections ({adapters:,} trainable, {adapters / (total + adapters):.2%}), the "
        f"{total:,} frozen held in {bases}"
    )
    return _StateSizes(full, lora, chosen, line)


_WIDE_BASES = ("bfloat16", "float32")


def _fits_gpus(
    plan: RunPlan, config: TrainerConfig, model_config: ModelConfig, sizes: _StateSizes, memory: int
) -> tuple[bool, str]:
    """Whether the config's choice, with a micro-batch's activations, fits a GPU of ``memory`` bytes (the usable
    share of it), and the sentence that says so with the figures."""
    checkpointing = config.model.activation_checkpointing
    tokens = plan.batch.batch_per_device * plan.window_size * plan.kind.rows_per_unit
    activations = activation_bytes(model_config, tokens, 2 if plan.autocast else 4, checkpointing)
    usable = memory * DEVICE_USABLE_SHARE
    state = sizes.full if sizes.chosen is None else sizes.lora[sizes.chosen]
    needed = state + activations
    how = "with activation checkpointing" if checkpointing else "without activation checkpointing"
    said = (
        f"with a micro-batch's activations (~{format_bytes(activations)}: {tokens:,} tokens, {how}) this config "
        f"needs ~{format_bytes(needed)} of each GPU's {format_bytes(memory)} ({DEVICE_USABLE_SHARE:.0%} usable): "
    )
    if needed <= usable:
        return True, said + "fits"
    better = [dtype for dtype, size in sizes.lora.items() if size + activations <= usable and dtype != sizes.chosen]
    hints = []
    if better:
        lora = "" if sizes.chosen else "lora_rank 16 with "
        hints.append(f"training.{lora}lora_base_dtype {better[0]}")
    if not checkpointing:
        hints.append("model.activation_checkpointing: true")
    hints.append("a smaller batch_per_device or window_size")
    return False, said + f"may not fit; try {', or '.join(hints)}"


def _nf4_refusal(gpus: list[tuple[str, int, tuple[int, int]]]) -> str | None:
    """Why an NF4 base cannot run in this job's container: a GPU without bfloat16 products, a torch older than
    torchao is built for; None when it can."""
    torch_found = tuple(int(part) for part in TORCH_VERSION.split(".")[:2])
    if torch_found < MIN_TORCH:
        return f"training.lora_base_dtype nf4 needs torch {'.'.join(map(str, MIN_TORCH))} or newer for torchao"
    for name, _, capability in gpus:
        if capability < MIN_CUDA_CAPABILITY:
            return (
                f"training.lora_base_dtype nf4: {name} (compute capability {capability[0]}.{capability[1]}) has no "
                f"bfloat16 matrix products, which the NF4 base computes in on a GPU (compute capability "
                f"{'.'.join(map(str, MIN_CUDA_CAPABILITY))} or newer)"
            )
    return None


def _gpus() -> list[tuple[str, int, tuple[int, int]]]:
    """The GPUs nvidia-smi lists: (name, total memory in bytes, compute capability); none without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = [smi, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
    result = subprocess.run(query, capture_output=True, text=True)
    gpus = []
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        name, memory, capability = (part.strip() for part in line.rsplit(",", 2))
        major, _, minor = capability.partition(".")
        if memory.isdigit() and major.isdigit() and minor.isdigit():
            gpus.append((name, int(memory) << 20, (int(major), int(minor))))
    return gpus


def _plan_or_none(runtime: Runtime, config: TrainerConfig) -> RunPlan | None:
    """The container's plan, or None where it cannot be resolved (the line that says why is elsewhere)."""
    try:
        return container_plan(runtime, config, at_least_one=True)
    except ConfigError:
        return None


def container_plan(runtime: Runtime, config: TrainerConfig, at_least_one: bool = False) -> RunPlan:
    """The run plan the trainer will resolve in the container: its device type and world size (counted with
    nvidia-smi when the runtime leaves them to the GPUs; ``at_least_one``: one when it counts none). ConfigError
    when the world size does not fit the global batch."""
    training = config.training
    device = training.device if training.device != "auto" else "cuda" if runtime.uses_gpu else "cpu"
    world = runtime.world_size if runtime.world_size is not None else _visible_gpus() * runtime.node_count
    world = max(1, world) if at_least_one else world
    mode = runtime.parallel_mode if runtime.parallel_mode != "auto" else resolve_parallel_mode("auto", max(1, world))
    folder = host_path(runtime, config.ckpt.param_path) or runtime.model_dir
    return resolve_plan(config, device, world, mode, folder)


def _resume_check(runtime: Runtime, latest, config: TrainerConfig, datas: list[TokenData]) -> Check:
    """What the resume carries over: the trainer's own rule (a changed optimizer refused, other data announced)."""
    try:
        held = container_plan(runtime, config, at_least_one=True).base_dtype
        notes = check_resume(latest.meta, latest.path, config.training, data_digest(datas), held)
    except (SetupError, ConfigError) as error:
        return Check(FAIL, "resume", str(error))
    if latest.meta.optimizer is None:  # written before meta.json recorded it: the trainer reads it from optimizer.pt
        notes.append("its optimizer is not recorded in meta.json: the trainer checks it against training.optimizer")
    return Check(PASS, "resume", "; ".join([f"from {latest.path} (step {latest.step})", *notes]))


def _reference_check(
    runtime: Runtime, config: TrainerConfig, model: tuple[ModelConfig, Path] | None, datas: list[TokenData] | None
) -> Check:
    """The frozen reference model a train type scores against (DPO's): readable, with the vocabulary of the model it
    trains and the data's tokenizer."""
    container = config.ckpt.reference_path or config.ckpt.param_path
    folder = host_path(runtime, container) or runtime.model_dir
    key = "ckpt.reference_path" if config.ckpt.reference_path else "ckpt.param_path (the reference by default)"
    name = f"{config.training.train_type} reference"
    try:
        reference = load_model_config(folder)
        if not through_transformers(reference):
            inspect_weights(folder, reference)
    except ModelLoadError as error:
        return Check(
            FAIL,
            name,
            f"{key}: {error}",
            "point it at a model folder (config.json + weights)",
        )
    if model is not None and reference.vocab_size != model[0].vocab_size:
        return Check(
            FAIL,
            name,
            f"{key}: {folder} has a vocabulary of {reference.vocab_size}, the trained model {model[0].vocab_size}: "
            "the reference must score the same tokens",
        )
    if datas is not None:
        try:
            check_model_tokenizer(datas[0], folder)
        except (SetupError, DataError) as error:
            return Check(FAIL, name, f"{key}: {error}")
    return Check(PASS, name, f"{folder}, frozen, beta {config.training.dpo_beta}")


def _visible_gpus() -> int:
    """GPUs nvidia-smi lists (at least 1: a guess for the checks when it lists none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 1
    result = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return max(1, len(re.findall(r"^GPU \d+:", result.stdout, flags=re.MULTILINE)))


def _unreadable(name: str, paths: list[Path], folder: Path) -> Check | None:
    """A failed check naming the first of ``paths`` the container's user cannot read, or None."""
    unreadable = next((path for path in paths if not _container_may(path, READ)), None)
    if unreadable is None:
        return None
    uid, gid = host_user_ids()
    return Check(
        FAIL,
        name,
        f"{unreadable} is not readable by uid {uid}, which the container runs as",
        f"sudo chown -R {uid}:{gid} {folder}  (or chmod -R a+rX {folder})",
    )


def _disk_space_check(runtime: Runtime, config: TrainerConfig | None = None) -> Check:
    """Room for two checkpoints: a save writes the new one in full before retention removes an old one."""
    if runtime.node != 0:
        return Check(SKIP, "checkpoint space", f"not needed on node {runtime.node}: only node 0 writes checkpoints")
    existing = nearest_existing(runtime.job_dir)
    if isinstance(existing, str):
        return Check(SKIP, "checkpoint space", "not checked: the checkpoint dir is broken (see above)")
    latest = _latest_checkpoint(runtime)
    try:
        size = (
            folder_bytes(latest.path)
            if latest
            else estimate_checkpoint_bytes(_saved_parameters(ModelConfig.load(runtime.model_dir), config))
        )
    except (OSError, ModelLoadError):
        return Check(SKIP, "checkpoint space", "not checked: no readable checkpoint or base model to size")
    free = shutil.disk_usage(existing).free
    found = f"{format_bytes(free)} free in {existing}, a checkpoint takes about {format_bytes(size)}"
    if free < 2 * size:
        return Check(
            WARN,
            "checkpoint space",
            f"{found}: room for fewer than two",
            "free space or point runtime.paths.checkpoints at a larger disk; a save that does not fit "
            "stops the trainer",
        )
    return Check(PASS, "checkpoint space", f"{found} (room for {free // size})")


def _saved_parameters(model: ModelConfig, config: TrainerConfig | None) -> int:
    """What a checkpoint holds the weights of: every one, or LoRA's adapters alone."""
    lora = LoRASettings.of(config.training) if config is not None else None
    if lora is not None:
        return num_adapter_parameters(model, lora.rank, lora.targets)
    return num_parameters(model)


def _latest_checkpoint(runtime: Runtime):
    """The job's newest complete checkpoint, or None (also when the job dir is missing or broken)."""
    return latest_complete_checkpoint(runtime.job_dir) if nearest_existing(runtime.job_dir) == runtime.job_dir else None


def node_checks(runtime: Runtime) -> list[Check]:
    """The rendezvous resolves, the interface exists; node 0 can listen on the port, the others can reach it."""
    if runtime.rendezvous is None and (runtime.slurm is not None or runtime.kubernetes is not None):
        return [Check(PASS, "rendezvous", "taken from the scheduler's allocation (`invoke submit` / Kubernetes)")]
    if runtime.rendezvous is None:
        return [
            Check(
                FAIL,
                "rendezvous",
                f"runtime.nodes.rendezvous is not set: job {runtime.job_name} spans {runtime.node_count} nodes and "
                "leaves the meeting point to its scheduler",
                "submit it with `invoke submit` (runtime.slurm), or set runtime.nodes.rendezvous to node 0's "
                "host:port to start each node by hand",
            )
        ]
    host, port = split_endpoint(runtime.rendezvous)
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        checks = [Check(PASS, "rendezvous", f"{runtime.rendezvous} resolves to {', '.join(addresses)}")]
    except OSError as error:
        return [
            Check(
                FAIL,
                "rendezvous",
                f"{host} does not resolve ({error})",
                "set runtime.nodes.rendezvous to node 0's address or a name every node resolves",
            )
        ]
    if runtime.network_interface is not None:
        checks.append(_interface_check(runtime.network_interface))
    checks.append(_port_free_check(port) if runtime.node == 0 else _reachable_check(host, port, runtime.rendezvous))
    return checks


# File systems one machine's disk or memory holds: a folder on them is never the same folder on two hosts.
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay", "vfat"})
MOUNTINFO = Path("/proc/self/mountinfo")


def shared_checkpoints_check(runtime: Runtime, config: TrainerConfig) -> Check:
    """Sharded checkpoints on several nodes: every node writes into the checkpoints folder, so it must be shared."""
    try:
        format = container_plan(runtime, config, at_least_one=True).ckpt_format
    except ConfigError as error:
        return Check(SKIP, "shared checkpoints", f"not checked: {error}")
    if format == CKPT_FORMAT_LORA:
        return Check(PASS, "shared checkpoints", "LoRA: only node 0 writes checkpoints (the adapters alone)")
    if format != CKPT_FORMAT_SHARDED:
        return Check(PASS, "shared checkpoints", f"ckpt.format {format}: only node 0 writes checkpoints")
    kind = file_system_type(runtime.job_dir)
    said = (
        f"ckpt.format sharded: every node writes its part of each checkpoint into runtime.paths.checkpoints "
        f"({runtime.checkpoints_dir}), so it must be one shared file system on all {runtime.node_count} nodes"
    )
    if kind is not None and (kind in LOCAL_FILE_SYSTEMS or kind.startswith("fuse")):
        what = (
            f"a local {kind} file system"
            if kind in LOCAL_FILE_SYSTEMS
            else f"a {kind} mount (object stores mounted through FUSE keep one writer's copy of a file)"
        )
        return Check(
            WARN,
            "shared checkpoints",
            f"{said}; here it is on {what}; the trainer refuses to start if a node's writes do not reach node 0",
            "mount a shared file system there on every node (NFS, Lustre, a parallel file system), or set "
            "ckpt.format: full, with which only node 0 writes checkpoints",
        )
    found = f" (here: {kind})" if kind is not None else ""
    return Check(PASS, "shared checkpoints", f"{said}{found}; the trainer checks at start that every node shares it")


def file_system_type(path: Path) -> str | None:
    """The type of the file system ``path`` (or the folder it will be created in) is on; None if unknown."""
    existing = nearest_existing(Path(path))
    if isinstance(existing, str):
        return None
    target = os.path.realpath(existing)
    best, kind = "", None
    try:
        lines = MOUNTINFO.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        # Mount points escape spaces and other odd bytes as octal (\040).
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), parts[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, rest.split()[0]
    return kind


def _interface_check(name: str) -> Check:
    if (NET_CLASS_DIR / name).exists():
        return Check(PASS, "network interface", f"{name} exists on this host")
    present = sorted(entry.name for entry in NET_CLASS_DIR.iterdir()) if NET_CLASS_DIR.is_dir() else []
    return Check(
        FAIL,
        "network interface",
        f"{name} does not exist on this host (found: {', '.join(present)})",
        "set runtime.nodes.network_interface to the interface the nodes reach each other over (`ip -br addr`)",
    )


def _port_free_check(port: int) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the rendezvous store binds it: connections of an earlier run in TIME_WAIT do not block it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            busy = error.errno == errno.EADDRINUSE
            return Check(
                FAIL,
                "rendezvous port",
                f"port {port} is {'in use' if busy else 'not usable'} on node 0 ({error.strerror})",
                "stop what listens there (`ss -ltnp`), or pick another port in runtime.nodes.rendezvous",
            )
    return Check(PASS, "rendezvous port", f"port {port} is free to listen on (this is node 0)")


def _reachable_check(host: str, port: int, endpoint: str) -> Check:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS):
            pass
    except OSError as error:
        return Check(
            WARN,
            "rendezvous",
            f"{endpoint} does not answer yet ({error.strerror or error})",
            "fine when node 0 is not started yet (nodes may start in any order); otherwise check the "
            "address and the firewall between the nodes",
        )
    return Check(PASS, "rendezvous", f"{endpoint} answers (node 0 is up)")


def _container_may(path: Path, access: int) -> bool:
    """Whether the container's user (the host user, see hostuser) gets ``access`` (READ or WRITE) on ``path``.

    Decided from the mode bits rather than os.access, which answers for the
    current process: under sudo that is root, who may do anything.
    """
    uid, gid = host_user_ids()
    if uid == 0:
        return True
    try:
        info = path.stat()
    except OSError:  # a symlink to nothing, say: nobody can read it
        return False
    shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
    needed = access | (EXECUTE if path.is_dir() else 0)
    return (info.st_mode >> shift) & needed == needed


def _gpu_runtime_check() -> Check:
    try:
        runtimes = engine.docker("info", "--format", "{{json .Runtimes}}").stdout
    except engine.EngineError:
        runtimes = ""
    if '"nvidia"' in runtimes:
        return Check(PASS, "gpu runtime", "Docker knows the nvidia runtime")
    if shutil.which("nvidia-container-runtime-hook"):
        return Check(PASS, "gpu runtime", "the NVIDIA container runtime hook is installed")
    specs = [p for d in CDI_SPEC_DIRS if d.is_dir() for p in d.iterdir() if "nvidia" in p.name]
    if specs:
        return Check(PASS, "gpu runtime", f"NVIDIA CDI spec {specs[0]}")
    return Check(
        FAIL,
        "gpu runtime",
        "Docker has no NVIDIA runtime or CDI device",
        "install the NVIDIA Container Toolkit and run `sudo nvidia-ctk runtime configure --runtime=docker`, "
        "or train on CPU with runtime.gpu.devices: none",
    )


def _gpu_indices_check(runtime: Runtime) -> Check:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check(SKIP, "gpu devices", "nvidia-smi not found; the indices are checked when the container starts")
    result = subprocess.run([smi, "-L"], capture_output=True, text=True)
    found = [int(m) for m in re.findall(r"^GPU (\d+):", result.stdout, flags=re.MULTILINE)]
    if result.returncode != 0 or not found:
        return Check(
            FAIL,
            "gpu devices",
            f"`nvidia-smi -L` lists no GPU ({result.stderr.strip() or 'no output'})",
            "check the NVIDIA driver, or set runtime.gpu.devices: none",
        )
    if runtime.devices == "all":
        return Check(PASS, "gpu devices", f"all {len(found)} GPU(s): {', '.join(map(str, found))}")
    missing = [index for index in runtime.devices if index not in found]
    if missing:
        return Check(
            FAIL,
            "gpu devices",
            f"runtime.gpu.devices lists {missing} but the host has GPU(s) {found}",
            "use indices from `nvidia-smi -L`",
        )
    return Check(PASS, "gpu devices", f"GPU(s) {list(runtime.devices)} present (host has {len(found)})")


def _trainer_config_check(runtime: Runtime, trainer_args: list[str]) -> tuple[TrainerConfig | None, Check]:
    """The trainer's own reading of train.yaml and of the arguments after ``--``, so its refusals come now."""
    try:
        config = read_trainer_config(runtime, trainer_args)
    except ConfigError as error:
        return None, Check(
            FAIL,
            TRAINER_CONFIG,
            str(error),
            fix_hint(error, runtime),
        )
    given = f" with {shlex.join(trainer_args)}" if trainer_args else ""
    note = ignored_keys_note(config.training, config.log)
    found = f"model/data/parallel/training/ckpt/log sections are valid{given}" + (f"; note: {note}" if note else "")
    return config, Check(PASS, TRAINER_CONFIG, found)


def _compose_config_check(runtime: Runtime) -> Check:
    try:
        program = compose.compose_program()
    except compose.ComposeError:
        return Check(SKIP, "compose config", "not checked without Compose v2")
    try:
        with compose.scratch_override(runtime) as override:
            command = compose.compose_command(runtime, "config", "--quiet", override=override)
            result = subprocess.run(command, capture_output=True, text=True)
    except compose.ComposeError as error:
        return Check(FAIL, "compose config", str(error))
    if result.returncode != 0:
        return Check(
            FAIL,
            "compose config",
            f"{' '.join(program)} rejected the rendered files: {result.stderr.strip()}",
            "see `invoke render` for the override",
        )
    return Check(PASS, "compose config", "the rendered override is accepted")


def image_torch(runtime: Runtime) -> tuple[bool, str]:
    """(matches, text): the torch of the job's built image, from the labels the Dockerfile sets."""
    image = compose.image_name(runtime)
    try:
        labels = engine.image_labels(image)
    except engine.EngineError as error:
        return False, f"unknown ({error})"
    if labels is None:
        return False, f"image {image} is not built yet; `invoke start` builds it with torch {TORCH_VERSION}"
    torch, cuda_tag = labels.get(LABEL_TORCH), labels.get(LABEL_CUDA_TAG)
    if torch is None:
        return False, f"image {image} has no torch label (built by an older astrai); `invoke build` rebuilds it"
    matches = torch == TORCH_VERSION and cuda_tag == runtime.cuda_tag
    note = "" if matches else f"; `invoke start` rebuilds it for torch {TORCH_VERSION} ({runtime.cuda_tag})"
    return matches, f"torch {torch} ({cuda_tag}) in image {image}{note}"


def _image_torch_check(runtime: Runtime) -> Check:
    """Informational: `start` always builds, so a missing or stale image is no failure."""
    matches, text = image_torch(runtime)
    return Check(PASS if matches else SKIP, "image torch", text)
