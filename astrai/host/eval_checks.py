"""Preflight's look at the generative evaluation (``log.eval_prompts``): the prompts folder where the container will
find it, of the right kind and tokenizer, its prompts leaving room for their completions — the refusals the trainer
makes at its start (:func:`astrai.common.fit.eval_prompt_units`), made on the host's copy of the folder.
"""

from __future__ import annotations

from astrai.common.config import TrainerConfig
from astrai.common.data_folder import DataError, TokenData
from astrai.common.fit import SetupError, eval_prompt_units, open_eval_prompts
from astrai.host.checklist import FAIL, PASS, SKIP, Check
from astrai.host.launch import mounts
from astrai.host.runtime import Runtime
from astrai.host.trainer_config import host_path

NAME = "evaluation"


def evaluation_check(runtime: Runtime, config: TrainerConfig, datas: list[TokenData] | None, model) -> Check | None:
    """The evaluation's line of the checklist; None for a job without one. ``model``: (config, folder) of the model
    the run starts from, as preflight read it."""
    settings = config.log.evaluation(config.training)
    if settings is None:
        return None
    inside = config.eval_prompts_folder()
    folder = host_path(runtime, str(inside))
    if folder is None:
        mounted = ", ".join(f"runtime.paths.{m.key} at {m.target}" for m in mounts(runtime) if m.key != "config")
        return Check(FAIL, NAME, f"log.eval_prompts: {inside} is in no folder the container mounts ({mounted})")
    if datas is None or model is None:
        return Check(SKIP, NAME, "not checked: see the data and model lines above")
    try:
        data = open_eval_prompts(folder)
        units = eval_prompt_units(settings, data, datas[0], model[0], config.data.overlong, model[1])
    except (DataError, SetupError) as error:
        return Check(FAIL, NAME, str(error))
    rewards = ", ".join(spec.name for spec in config.log.eval_reward_specs(config.training))
    how = "greedy" if settings.sampling.greedy else f"temperature {settings.sampling.temperature:g}"
    left = units.truncated if config.data.overlong == "truncate" else units.dropped
    cut = f"; {left:,} longer than the room left: {config.data.overlong}" if left else ""
    start = " and at step 0" if settings.at_start else ""
    return Check(
        PASS,
        NAME,
        f"{len(units):,} prompts of {inside} x {settings.generations} completion(s) ({how}, at most "
        f"{settings.sampling.max_new_tokens} tokens) every {settings.interval} steps{start}, scored by {rewards}{cut}",
    )
