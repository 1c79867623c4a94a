"""Reward models in the trainer: ``{model: DIR, weight, name, batch_size}`` in ``training.rewards`` (or
``log.eval_rewards``), and the loading of every entry of those lists (:func:`load_rewards`).

``DIR`` is a sequence-classification folder of one label: a checkpoint of ``train_type: reward_model``, or a Hugging
Face ``XForSequenceClassification`` folder. A family the trainer computes itself (Llama, Qwen, Mistral, Gemma, ...) runs
on the trainer's own model; any other goes through ``transformers.AutoModelForSequenceClassification`` (one process
or DDP). Either way it is frozen, in eval mode, on the trainer's device, its weights in bfloat16 on a GPU (the
forward passes under the run's autocast), and under FSDP sharded as the reference model is.

What it scores, for each completion: the prompt and the completion as ``prepare --kind dpo`` writes a pair's sequence
with the folder's own tokenizer, so that a model trained here scores what it learnt from —

- a chat prompt (its messages, kept by ``prepare --kind prompts``): the messages and an assistant turn holding the
  completion, rendered by the folder's chat template (as ``apply_chat_template`` renders them) and tokenized whole;
- a text prompt: the prompt's tokens, the completion's, and the tokenizer's end-of-text token.

A sequence longer than the model's context keeps its last tokens. The reward is the score head at the last token that
is not the padding token (transformers' rule). Rows go through the model ``batch_size`` at a time, padded at the end;
under FSDP every rank runs as many forward passes (a rank with fewer rows scores its first batch again and keeps
nothing of it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from astrai.common.backends import BACKEND_NATIVE, folder_model_type, resolve_backend
from astrai.common.contract import TOKENIZER_FILE
from astrai.common.model_folder import ModelConfig, ModelLoadError
from astrai.common.reward_specs import JudgeSpec, ModelRewardSpec, RewardSpec
from astrai.trainer.launch.distributed import DistEnv, broadcast_from_master
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.parallel import parallelize
from astrai.trainer.models.weights import load_base_model
from astrai.trainer.objectives.reward_model import sequence_rewards
from astrai.trainer.objectives.rewards import Reward, RewardError, load_reward


class ModelReward:
    """A reward model's scores of completions, in TRL's reward function shape (and given the prompts' messages)."""

    def __init__(
        self,
        spec: ModelRewardSpec,
        model: torch.nn.Module,
        tokenizer,
        template,
        pad_token_id: int | None,
        context: int,
        env: DistEnv,
        autocast: contextlib.AbstractContextManager,
        library: bool = False,
    ):
        self.spec, self.model, self.tokenizer, self.template = spec, model, tokenizer, template
        self.pad_token_id, self.context, self.env, self.autocast, self.library = (
            pad_token_id,
            context,
            env,
            autocast,
            library,
        )
        self.together = env.control_group if env.parallel_mode == "fsdp" else None

    def sequence(self, prompt: str, completion: str, messages: list[dict] | None) -> list[int]:
        """The tokens the model scores for one completion (its last ``context`` ones)."""
        if messages is not None and self.template is not None:
            text = self.template.render([*messages, {"role": "assistant", "content": completion}])
            (ids,) = self.tokenizer.ids([text])
        else:
            prompt_ids, completion_ids = self.tokenizer.ids([prompt, completion])
            ids = [*prompt_ids, *completion_ids]
            if self.tokenizer.end_of_text is not None:
                ids.append(self.tokenizer.end_of_text)
        return ids[-self.context :] or [self.tokenizer.end_of_text or 0]

    def __call__(self, prompts: list[str], completions: list[str], prompt_messages=None, **fields) -> list[float]:
        messages = prompt_messages or [None] * len(prompts)
        rows = [
            self.sequence(prompt, completion, given)
            for prompt, completion, given in zip(prompts, completions, messages, strict=True)
        ]
        return self.score_rows(rows)

    @torch.no_grad()
    def score_rows(self, rows: list[list[int]]) -> list[float]:
        """Each token sequence's reward."""
        if self.library:
            return self._library_rows(rows)
        size = self.spec.batch_size
        batches = [rows[start : start + size] for start in range(0, len(rows), size)]
        count = len(batches)
        if self.together is not None:
            agreed = torch.tensor([count], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.together)
            count = int(agreed)
        rewards: list[float] = []
        for index in range(count):
            batch = batches[index] if index < len(batches) else batches[0] if batches else [[0]]
            scored = self._forward(batch)
            if index < len(batches):
                rewards += scored
        return rewards

    def _forward(self, batch: list[list[int]]) -> list[float]:
        width = max(len(row) for row in batch)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        tokens = torch.full((len(batch), width), pad, dtype=torch.long)
        lengths = torch.tensor([len(row) for row in batch], dtype=torch.long)
        for number, row in enumerate(batch):
            tokens[number, : len(row)] = torch.tensor(row, dtype=torch.long)
        tokens, lengths = tokens.to(self.env.device), lengths.to(self.env.device)
        with self.autocast:
            return sequence_rewards(self.model, tokens, lengths, self.pad_token_id).tolist()

    def _library_rows(self, rows: list[list[int]]) -> list[float]:
        """A transformers classifier's rewards: rows of one length go through it together, unpadded, so that it reads
        each one as it reads it alone (its own pooling, whatever its architecture)."""
        rewards: list[float] = [0.0] * len(rows)
        by_length: dict[int, list[int]] = {}
        for number, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(number)
        for numbers in by_length.values():
            for start in range(0, len(numbers), self.spec.batch_size):
                chosen = numbers[start : start + self.spec.batch_size]
                batch = [rows[number] for number in chosen]
                tokens = torch.tensor(batch, dtype=torch.long, device=self.env.device)
                with self.autocast, _pad_for(self.model.config, batch):
                    scores = self.model(input_ids=tokens).logits[:, 0].float().tolist()
                for number, value in zip(chosen, scores, strict=True):
                    rewards[number] = value
        return rewards


@contextlib.contextmanager
def _pad_for(config, batch: list[list[int]]):
    """A classifier without a padding token refuses a batch of several rows (it could not tell where each ends): rows
    of one length have no padding, so any id none of them holds serves, and it reads each row's last token."""
    if config.pad_token_id is not None or len(batch) == 1:
        yield
        return
    held = {token for row in batch for token in row}
    config.pad_token_id = next(token for token in range(len(held) + 1) if token not in held)
    try:
        yield
    finally:
        config.pad_token_id = None


def load_model_reward(spec: ModelRewardSpec, env: DistEnv, autocast) -> Reward:
    """The reward model of ``spec``, on the device, frozen; RewardError naming it for a folder that is not a
    classifier of one label."""
    folder = Path(spec.model)
    native = resolve_backend("auto", folder_model_type(folder)) == BACKEND_NATIVE
    if native:
        model, config = _native(spec, folder, env)
        pad, context = config.pad_token_id, config.max_seq_len
    else:
        model, pad, context = _library(spec, folder, env)
    tokenizer, template = _tokenizer(spec, folder)
    scorer = ModelReward(spec, model, tokenizer, template, pad, context, env, autocast, library=not native)
    return Reward(spec, scorer, takes_messages=True, in_thread=False)


def _native(spec: ModelRewardSpec, folder: Path, env: DistEnv) -> tuple[torch.nn.Module, ModelConfig]:
    def read():
        try:
            return load_base_model(folder)
        except ModelLoadError as error:
            raise RewardError(f"reward model {spec.name} ({spec.model}): {error}") from None

    config, weights = broadcast_from_master(env, read, errors=(RewardError,))
    if config.num_labels != 1:
        what = "a causal language model" if config.num_labels is None else f"a classifier of {config.num_labels} labels"
        raise RewardError(
            f"reward model {spec.name} ({spec.model}) is {what}; a reward model is a sequence classifier of one label "
            "(train one with train_type reward_model, or give an XForSequenceClassification folder with num_labels 1)"
        )
    model = Transformer(config)
    model.load_state_dict(weights)
    del weights
    held = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    model.to(env.device, held).eval().requires_grad_(False)
    if env.parallel_mode == "fsdp":
        model = parallelize(model, env)
    return model, config


def _library(spec: ModelRewardSpec, folder: Path, env: DistEnv) -> tuple[torch.nn.Module, int | None, int]:
    """A classifier of a family the trainer does not compute, through transformers (not under FSDP)."""
    if env.parallel_mode == "fsdp":
        raise RewardError(
            f"reward model {spec.name} ({spec.model}) is a family the trainer does not compute (it goes through "
            "transformers), which is not sharded under FSDP; use parallel_mode ddp, or a reward model of a native "
            "family"
        )
    try:
        from transformers import AutoModelForSequenceClassification
    except ImportError:
        raise RewardError(
            f"reward model {spec.name} ({spec.model}) needs transformers, which this image lacks (invoke start "
            "installs it for such a model)"
        ) from None
    held = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    try:
        model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=held)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise RewardError(f"reward model {spec.name} ({spec.model}): transformers cannot load it: {error}") from None
    if model.config.num_labels != 1 or not hasattr(model, "score"):
        raise RewardError(
            f"reward model {spec.name} ({spec.model}) is a classifier of {model.config.num_labels} labels; a reward "
            "model has one"
        )
    model.to(env.device).eval().requires_grad_(False)
    context = getattr(model.config, "max_position_embeddings", None) or 2048
    return model, model.config.pad_token_id, context


def _tokenizer(spec: ModelRewardSpec, folder: Path):
    """The folder's tokenizer and chat template (bytes, without a template, for a folder without a tokenizer.json)."""
    from astrai.common.data_folder import DataError
    from astrai.data.chat import ChatTemplate
    from astrai.data.tokenizing import ByteTokenizer, HFTokenizer

    if not (folder / TOKENIZER_FILE).is_file():
        return ByteTokenizer(), None
    try:
        return HFTokenizer(folder), ChatTemplate.of_folder(folder)
    except DataError as error:
        raise RewardError(f"reward model {spec.name} ({spec.model}): {error}") from None


def load_rewards(specs, env: DistEnv, autocast, log=None) -> list[Reward]:
    """Every entry of a rewards list, loaded: functions (:mod:`astrai.trainer.objectives.rewards`), reward models
    (this module) and remote judges (:mod:`astrai.trainer.objectives.judges`)."""
    from astrai.trainer.objectives.judges import load_judge

    loaded = []
    for spec in specs:
        if isinstance(spec, RewardSpec):
            loaded.append(load_reward(spec))
        elif isinstance(spec, ModelRewardSpec):
            loaded.append(load_model_reward(spec, env, autocast))
        elif isinstance(spec, JudgeSpec):
            loaded.append(load_judge(spec, log))
    return loaded
