"""The host–container contract: every fixed name both sides rely on, written once.

The host tasks (runtime block, Compose override, preflight, status, clean) and
the trainer inside the container (entrypoint, training loop, checkpoints) import
these names from here and nowhere else, so the two sides cannot drift apart.
Standard library only: the host side must import without torch.
"""

from __future__ import annotations

from collections.abc import Mapping

# --- Mount points inside the container (docs/architecture.md) --------------------------------
CONTAINER_DATA = "/data"
"""Token data, mounted read-only from ``runtime.paths.data``."""
CONTAINER_MODEL = "/models/base"
"""Base model, mounted read-only from ``runtime.paths.model``."""
CONTAINER_CHECKPOINTS = "/checkpoints"
"""Checkpoints root, mounted read-write from ``runtime.paths.checkpoints``; the job dir is ``<root>/<job_name>``."""
CONTAINER_CONFIG = "/run/astrai/train.yaml"
"""The job's YAML file, mounted read-only."""
CONTAINER_HOME = "/home/astrai"
"""HOME of the trainer user (set by the Dockerfile); a scratch tmpfs, since the root file system is read-only."""


def container_job_dir(job_name: str) -> str:
    """The job dir as the trainer sees it."""
    return f"{CONTAINER_CHECKPOINTS}/{job_name}"


TRAINER_MODULE = "astrai.train"
"""What the entrypoint runs: ``python -m astrai.train`` (or under torchrun)."""
TORCHRUN_MODULE = "astrai.trainer.launch.torchrun"
"""How the entrypoint runs several trainer processes: torchrun, with a quick exit (``python -m`` this)."""


def trainer_arguments(
    job_name: str, parallel_mode: str | None, user_args: list[str], config: str = CONTAINER_CONFIG
) -> list[str]:
    """The trainer's arguments in the container: the mounts' paths, the derived mode, then the user's words.

    The entrypoint launches exactly these; the host parses exactly these too (preflight, start), with ``config``
    the YAML's path where each reads it, so both judge the same configuration. The user's words come last and win.
    """
    mode = ["--parallel_mode", parallel_mode] if parallel_mode is not None else []
    return [
        "--config",
        config,
        "--ckpt_dir",
        container_job_dir(job_name),
        "--param_path",
        CONTAINER_MODEL,
        *mode,
        *user_args,
    ]


# --- Environment the host sets for the entrypoint ------------------------------------------------
ENV_JOB_NAME = "TRAIN_JOB_NAME"
ENV_CONFIG = "ASTRAI_CONFIG"
ENV_GPU_DEVICES = "ASTRAI_GPU_DEVICES"
ENV_PARALLEL_MODE = "ASTRAI_PARALLEL_MODE"
ENV_PROCESSES = "ASTRAI_PROCESSES"
ENV_STOP_TIMEOUT_SECONDS = "ASTRAI_STOP_TIMEOUT_SECONDS"
ENV_CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
"""cuBLAS's workspace setting, read when CUDA starts: with DETERMINISTIC_CUBLAS_WORKSPACE its results are reproducible
(training.deterministic); the entrypoint and the trainer set it before CUDA starts."""
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"


def deterministic_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a process's environment needs before CUDA starts for training.deterministic: cuBLAS's workspace, unless
    one of the two settings with which cuBLAS is deterministic is already there."""
    if environ.get(ENV_CUBLAS_WORKSPACE_CONFIG) in (DETERMINISTIC_CUBLAS_WORKSPACE, ":16:8"):
        return {}
    return {ENV_CUBLAS_WORKSPACE_CONFIG: DETERMINISTIC_CUBLAS_WORKSPACE}


ENV_NODES = "ASTRAI_NODES"
"""Hosts in the job (runtime.nodes.count); more than 1 makes the entrypoint join a rendezvous."""
ENV_NODE_RANK = "ASTRAI_NODE_RANK"
"""Which node this container is (``--node``); the trainer orders global ranks by it, so rank 0 is on node 0."""
ENV_RDZV_ENDPOINT = "ASTRAI_RDZV_ENDPOINT"
ENV_RDZV_BACKEND = "ASTRAI_RDZV_BACKEND"
ENV_RDZV_ID = "ASTRAI_RDZV_ID"
"""The c10d rendezvous id; absent, every node derives it from the job name (a scheduler gives its job id)."""
ENV_SUPERVISOR_PID = "ASTRAI_SUPERVISOR_PID"
"""A host process the container must not outlive (the Slurm task that started it; the container shares the
host's PID namespace to see it). When it is gone, the entrypoint stops the trainer gracefully, then for good."""
ENV_STOPPED_EXIT_CODE = "ASTRAI_STOPPED_EXIT_CODE"
"""When set (Kubernetes pods), a graceful stop that leaves the run unfinished exits with this code instead of 0:
a pod stopped by an eviction or a drain is then retried by the Job's podFailurePolicy, not counted as done."""
ENV_ENVIRONMENTS = "ASTRAI_ENVIRONMENTS"
"""The server environments of a job (runtime.environments) as the trainer reaches them: a JSON object of name ->
address (http://HOST:PORT), set by the host."""
ENV_FAILURE_TIMEOUT_SECONDS = "ASTRAI_FAILURE_TIMEOUT_SECONDS"
"""Survivors of a lost node exit within this many seconds; the trainer watches the other ranks' heartbeats."""
RESERVED_ENV_PREFIX = "ASTRAI_"
"""Every variable with this prefix belongs to the product; ``runtime.environment`` may not set one."""

# --- Container labels ----------------------------------------------------------------------------
LABEL_JOB = "ai.astrai.job"
LABEL_NODE = "ai.astrai.node"
"""The node index (``--node``) of a container: 0 for a one-host job."""
LABEL_ENVIRONMENT = "ai.astrai.environment"
"""The name of the server environment (runtime.environments) a container runs."""
LABEL_CONFIG = "ai.astrai.common.config"
LABEL_TORCH = "ai.astrai.torch"
"""Image label: the torch version the Dockerfile installed or verified (the Dockerfile writes it out)."""
LABEL_CUDA_TAG = "ai.astrai.cuda_tag"
"""Image label: the torch build (cpu, cuNNN) the image was built for."""
LABEL_EVAL_PACKAGES = "ai.astrai.eval_packages"
"""Image label: the lm-evaluation-harness packages `invoke eval`'s image installed (empty in the job's own)."""

# --- The trainer image's torch (one version, the tested one) ------------------------------------
TORCH_VERSION = "2.13.0"
"""The torch every image the product builds holds, and the one the tests run."""
TORCH_CUDA_TAGS = ("cpu", "cu126", "cu128", "cu130")
"""The builds of TORCH_VERSION on https://download.pytorch.org/whl/<tag>; runtime.container.cuda_tag takes one."""

# --- Model folders (base model and checkpoint alike) ---------------------------------------------
# They are Hugging Face's names: a checkpoint folder is a model folder transformers loads (docs/models.md).
MODEL_CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
"""Sharded weights instead of one WEIGHTS_FILE: which shard file holds each tensor."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_ADAPTER_FILE = "adapter_model.bin"
"""An adapter folder's weights as older PEFT versions wrote them (a pickle): recognised, and refused with a way out."""
"""A PEFT adapter folder: its LoRA settings, and the adapters' weights under PEFT's names."""
TOKENIZER_FILE = "tokenizer.json"
"""A Hugging Face ``tokenizers`` tokenizer (``prepare --tokenizer``)."""
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A tokenizer folder's chat template as a file of its own (newer transformers write it there)."""
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
"""A model folder's generation settings (stop tokens, sampling defaults): every checkpoint and export keeps it."""
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE)
"""A model folder's tokenizer files, which the data folder and every checkpoint carry along."""

# --- Checkpoint folders (docs/checkpoints.md; the rule is astrai/common/checkpoints.py) ---------
META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
REQUIRED_FILES = (META_FILE, MODEL_CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE)
"""The files every checkpoint holds (more are allowed); astrai/common/checkpoints.py says what else makes one whole."""
RNG_FILE = "rng_state.safetensors"
"""Every rank's RNG states. Optional: without it a resume seeds each rank from random_seed, step and rank."""
TRAINER_STATE_FILE = "trainer_state.pt"
"""The state of the run's parts that have no file of their own, by part name (optional: only runs with such parts)."""
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
"""Sharded format: the optimizer's parameter-shaped tensors (AdamW's moments), laid out whole like the weights;
``optimizer.pt`` then holds the rest of the optimizer state and names this file."""
CHECKPOINT_INTERNALS = (META_FILE, OPTIMIZER_FILE, OPTIMIZER_TENSORS_FILE, SCHEDULER_FILE, RNG_FILE, TRAINER_STATE_FILE)
"""A checkpoint's training state, beside the model folder it also is: never part of an export."""
CKPT_FORMAT_FULL = "full"
CKPT_FORMAT_SHARDED = "sharded"
CKPT_FORMATS = (CKPT_FORMAT_FULL, CKPT_FORMAT_SHARDED)
"""``ckpt.format``: ``full`` gathers the state on rank 0, which writes it; ``sharded``: every rank writes its rows."""
CKPT_FORMAT_LORA = "lora"
"""The run plan's format of a LoRA run (training.lora_rank >= 1), whatever ckpt.format says: the full format's files,
of the adapters alone (meta.json records ``full``, the files' format)."""
SHARED_FS_CHECK_PREFIX = ".shared-fs-check-"
"""A file rank 0 writes into the job dir at start, which every node must read (sharded format on several nodes)."""

REASON_PERIODIC = "periodic"
REASON_FINAL = "final"
REASON_EMERGENCY = "emergency"
REASONS = (REASON_PERIODIC, REASON_FINAL, REASON_EMERGENCY)
"""Why a checkpoint was written (``meta.json``'s ``reason``)."""

# --- Files in the job dir ---------------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"
"""One JSON object per logged step; readers take the last record of a step."""
METRIC_STEP = "step"
METRIC_MAX_STEPS = "max_steps"
METRIC_LOSS = "loss"
METRIC_EPOCH = "epoch"
METRIC_TOKENS_SEEN = "tokens_seen"
METRIC_REWARDS_CHOSEN = "rewards_chosen"
"""DPO (TRL's rewards/chosen): beta times the policy-over-reference log-probability ratio of the chosen answers."""
METRIC_REWARDS_REJECTED = "rewards_rejected"
METRIC_REWARDS_MARGIN = "rewards_margin"
METRIC_REWARDS_ACCURACY = "rewards_accuracy"
"""DPO: the share of pairs whose chosen reward exceeds the rejected one's."""
METRIC_LOGPS_CHOSEN = "logps_chosen"
"""KTO (TRL's logps/chosen): the policy's mean summed log-probability of the desirable completions."""
METRIC_LOGPS_REJECTED = "logps_rejected"
"""KTO (TRL's logps/rejected): the same of the undesirable completions."""
METRIC_REWARD = "reward"
"""online_grpo: the mean total reward of the completions sampled since the last report (TRL's reward)."""
STD_SUFFIX = "_std"
"""A metric's standard deviation is reported under its name and this suffix."""
METRIC_REWARD_STD = METRIC_REWARD + STD_SUFFIX
METRIC_REWARD_OF = "reward_{name}"
"""online_grpo: the mean of one reward function (``reward_{name}_std`` its std), over the completions it scored."""
METRIC_JUDGE_FAILURES = "judge_failures/{name}"
"""A remote judge with on_error: none: the completions it could not score since the last report."""
METRIC_FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"
"""online_grpo: the share of groups whose completions all scored the same (no signal to learn from)."""
METRIC_COMPLETION_LENGTH = "completion_length"
METRIC_COMPLETION_LENGTH_MAX = "completion_length_max"
METRIC_COMPLETION_CLIPPED = "completion_clipped"
"""online_grpo: the share of completions that reached max_completion_length without a stop token."""
METRIC_PAIRS_TIED = "pairs_tied"
"""online_dpo: the share of prompts whose two completions scored the same (or went unscored): no pair to learn from."""
METRIC_KL = "kl"
METRIC_CLIP_LOW = "clip_ratio_low"
METRIC_CLIP_HIGH = "clip_ratio_high"
METRIC_CLIP_REGION = "clip_ratio_region"
METRIC_ENTROPY = "entropy"
METRIC_TOKENS_PER_SOURCE = "tokens_per_source"
"""With data.sources: tokens trained from each source so far, by its path."""
METRIC_ROUTER_AUX_LOSS = "router_aux_loss"
"""Mixture of experts: the routers' load-balancing loss (transformers' load_balancing_loss_func), unweighted."""
METRIC_EXPERT_LOAD = "expert_load"
"""Mixture of experts: ``expert_load/<e>``, expert e's share of the tokens' expert assignments (all sparse layers)."""
METRIC_TIME = "time"
METRIC_TOKENS_PER_S = "tokens_per_s"
METRIC_ETA_S = "eta_s"
METRIC_LR = "lr"
METRIC_GRAD_NORM = "grad_norm"
METRIC_VAL_LOSS = "val_loss"
"""Mean loss over the held-out validation windows; only in the records of eval steps."""
METRIC_MFU = "mfu"
"""Model FLOPs utilization, a fraction of the device's peak; absent where the peak is unknown (CPU)."""
METRIC_MAX_ALLOCATED_GIB = "max_allocated_gib"
"""Peak memory allocated by tensors on global rank 0's GPU so far; absent on CPU."""

METRIC_EPISODE_TURNS = "episode/turns"
"""Episodes (tools, an environment): the mean assistant turns of the episodes sampled since the last report."""
METRIC_EPISODE_TOOL_CALLS = "episode/tool_calls"
"""Episodes: the mean tool calls an episode made (those that parsed, and those that did not)."""
METRIC_EPISODE_TOOL_ERRORS = "episode/tool_errors"
"""Episodes: the mean calls an episode made that were answered with an error (no such tool, arguments it does not
take, a tool that raised or ran past training.tool_timeout)."""
METRIC_EPISODE_UNPARSED = "episode/unparsed_calls"
"""Episodes: the mean calls an episode began that did not parse in the template's tool-call format."""
METRIC_EPISODE_TRUNCATED = "episode/truncated"
"""Episodes: the share of episodes a limit ended (max_turns, max_tool_calls, max_episode_tokens, a turn cut at
max_completion_length)."""
EPISODE_METRICS = (
    METRIC_EPISODE_TURNS,
    METRIC_EPISODE_TOOL_CALLS,
    METRIC_EPISODE_TOOL_ERRORS,
    METRIC_EPISODE_UNPARSED,
    METRIC_EPISODE_TRUNCATED,
)
METRIC_REWARD_MODEL_ACCURACY = "reward_model/accuracy"
"""reward_model: the share of the pairs since the last report whose chosen sequence the model scores higher (TRL's
accuracy)."""
METRIC_REWARD_MODEL_MARGIN = "reward_model/margin"
"""reward_model: the mean of the chosen sequence's reward less the rejected one's (TRL's margin)."""
METRIC_REWARD_MODEL_VAL_ACCURACY = "reward_model/val_accuracy"
"""reward_model: the accuracy on the held-out pairs (data.val_fraction), at each validation."""
METRIC_REWARD_MODEL_VAL_MARGIN = "reward_model/val_margin"
"""reward_model: the margin on the held-out pairs, at each validation."""
METRIC_EVAL_PREFIX = "eval/"
"""Generative evaluation in the loop (log.eval_prompts): its metrics are named under this prefix, in metrics.jsonl,
TensorBoard and the trackers alike."""
METRIC_EVAL_REWARD = METRIC_EVAL_PREFIX + "reward"
"""The mean total reward of the evaluation's completions (those scored)."""
METRIC_EVAL_REWARD_OF = METRIC_EVAL_PREFIX + "{name}"
"""The mean of one reward of the evaluation (``eval/<reward name>``), over the completions it scored."""
METRIC_EVAL_PASS_AT_K = METRIC_EVAL_PREFIX + "pass@k"
"""The share of evaluation prompts with at least one of their k completions (log.eval_generations) scoring at least
log.eval_pass_threshold."""
METRIC_EVAL_COMPLETION_LENGTH = METRIC_EVAL_PREFIX + "completion_length"
"""The mean length of the evaluation's completions, in tokens."""
METRIC_EVAL_UNSCORED = METRIC_EVAL_PREFIX + "unscored"
"""The share of the evaluation's completions that no reward scored."""

COMPLETIONS_LOG = "completions.log"
"""online_grpo: every log_interval steps, a group of sampled completions with their rewards, for people to read."""

REFERENCE_LOG_PROBS_FILE = "reference_logps.safetensors"
"""DPO with training.dpo_reference precomputed: the reference's log-probabilities of every pair (chosen,
rejected), computed once for the job, kept for its resumes; its metadata names the reference and data."""

TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files of a job: ``<job dir>/tensorboard/``, written by global rank 0."""
TAG_TRAIN_LOSS = "train/loss"
TAG_TRAIN_LR = "train/lr"
TAG_TRAIN_GRAD_NORM = "train/grad_norm"
TAG_VAL_LOSS = "val/loss"
TAG_TOKENS_PER_S = "perf/tokens_per_s"
TAG_MFU = "perf/mfu"
TAG_MAX_ALLOCATED_GIB = "memory/max_allocated_gib"
TAG_TOKENS_PREFIX = "data/tokens/"
"""With data.sources: one scalar per source, data/tokens/<path>."""
TAG_CHECKPOINT = "checkpoint"
"""A text event at the step of every checkpoint save, naming its folder and reason."""

# --- Experiment trackers (docs/trackers.md) --------------------------------------------------------
TRACKER_TENSORBOARD = "tensorboard"
TRACKER_MLFLOW = "mlflow"
TRACKER_WANDB = "wandb"
TRACKER_NONE = "none"
REPORT_TO = (TRACKER_TENSORBOARD, TRACKER_MLFLOW, TRACKER_WANDB, TRACKER_NONE)
"""What ``log.report_to`` lists; ``none`` stands alone (metrics.jsonl is written whatever it says)."""
TRACKERS_FILE = "trackers.json"
"""The job dir's record of its tracker runs (id, address, last step sent), so a resume continues the same run."""
WANDB_DIR = "wandb"
"""W&B's local files of a job: ``<job dir>/wandb/`` (offline runs stay there for ``wandb sync``)."""
TRACKER_PACKAGES = {TRACKER_MLFLOW: "mlflow-skinny==3.17.2", TRACKER_WANDB: "wandb==0.28.2"}
EPISODE_PACKAGES = ("jinja2>=3.1", "tokenizers>=0.20")
"""What the trainer image installs for a job of episodes (training.tools, training.environment): the chat template
that renders the tools and replies, and the tokenizer that reads them."""
OPENENV_PACKAGE = "openenv-core==0.3.0"
"""OpenEnv's client, which the trainer image installs for a job with a server environment (training.environment
{server: NAME}): the trainer speaks to the server through it (the version the tests run)."""
"""What the trainer image installs for a tracker ``log.report_to`` asks for (the versions the tests run)."""
LM_EVAL_PACKAGE = "lm-eval==0.4.13"
"""lm-evaluation-harness, which `invoke eval` runs in the job's image (the version the tests run)."""
LM_EVAL_PACKAGES = (LM_EVAL_PACKAGE, "accelerate==1.16.0", "peft==0.21.2")
"""What the image installs for a job that uses `invoke eval`, beside transformers: the harness and what its Hugging
Face model needs (astrai/common/backends.py pins transformers)."""
EVAL_RESULTS_DIR = "eval"
"""`invoke eval`'s results: ``<job dir>/eval/<checkpoint name>.json``."""
LM_EVAL_PREFIX = "lm_eval/"
LM_EVAL_METRIC = LM_EVAL_PREFIX + "{task}/{metric}"
"""`invoke eval`'s numbers as the trackers get them, at the checkpoint's step."""
LM_EVAL_STEP = LM_EVAL_PREFIX + "step"
"""W&B's step axis of `invoke eval`'s numbers (a W&B run takes each of its own steps once)."""
TRACKER_SECRETS = {
    TRACKER_MLFLOW: (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
    ),
    TRACKER_WANDB: ("WANDB_API_KEY", "WANDB_BASE_URL"),
}
"""Variables a tracker's client reads, passed by name from the host's environment, never written down."""
TAG_STATE = "astrai.state"
"""The tracker run's tag for how the run ended: finished, stopped, diverged or failed."""
TAG_FINAL_CHECKPOINT = "astrai.checkpoint"
"""The tracker run's tag naming the last checkpoint written."""
TAG_REPLAYED = "astrai.replayed_steps"
"""Set on resume: the steps trained again after the checkpoint, whose values the tracker kept from the first time."""

EXIT_LOST_NODE = 75
"""Exit code of a trainer rank that gave up because another node was lost (not a stop: it may be restarted)."""
EXIT_STOPPED_UNFINISHED = 76
"""What a Kubernetes pod's trainer exits with after a graceful stop short of max_steps (ENV_STOPPED_EXIT_CODE)."""

# --- Token data -----------------------------------------------------------------------------------
DATA_MANIFEST_FILE = "manifest.json"

# --- Parallel modes (docs/runtime.md) -------------------------------------------------------------
PARALLEL_MODES = ("none", "ddp", "fsdp")
"""The concrete modes the trainer runs."""
REQUESTED_PARALLEL_MODES = ("auto", *PARALLEL_MODES)
"""What ``runtime.gpu.parallel_mode`` may ask for."""


def resolve_parallel_mode(requested: str, processes: int) -> str:
    """The concrete mode for ``processes`` processes; ValueError explains a mismatch.

    ``auto`` means ``none`` for one process and ``ddp`` for more; ``none`` needs
    exactly one process; ``ddp`` and ``fsdp`` need two or more.
    """
    if requested not in REQUESTED_PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {requested!r}; allowed: {', '.join(REQUESTED_PARALLEL_MODES)}")
    if processes < 1:
        raise ValueError(f"the process count must be at least 1, got {processes}")
    if requested == "auto":
        return "none" if processes == 1 else "ddp"
    if requested == "none" and processes != 1:
        raise ValueError(f"none needs exactly 1 process, but {processes} were requested")
    if requested in ("ddp", "fsdp") and processes < 2:
        raise ValueError(f"{requested} needs 2 or more processes, but {processes} was requested")
    return requested
