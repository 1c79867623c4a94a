"""The models users bring, at the edges of the transformers path: the loss is the library's own whatever a family
does to its logits, a mixture's router loss is added and reported, a family without sdpa runs on the attention it
has, config.json is read as transformers reads it, LoRA goes on nn.Linear's subclasses that are linear, and
`--dry-run` and preflight refuse, with exit 2 and the folder named, what the trainer would refuse at its start.

Tiny random models of each family, built with transformers (hf_folders.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_folders import FAMILY_CASES, LIBRARY_CASES, MOE_CASES, make_hf_model, make_library_model

from astrai.common.backends import TransformersConfig
from astrai.common.settings import LoRASettings
from astrai.trainer.models.experts import RouterBalance, router_balance
from astrai.trainer.models.hf_model import (
    TransformersModel,
    add_transformers_adapters,
    inspect_folder,
    load_transformers_start,
)
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.models.weights import load_pretrained

transformers = pytest.importorskip("transformers")

NATIVE_CASES = {
    "llama": dict(model_type="llama", kv_heads=2),
    "mistral": dict(model_type="mistral", kv_heads=2, sliding_window=6),
    **FAMILY_CASES,
    **MOE_CASES,
}
"""The native families, each with every feature on (hf_folders.py)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A folder per family: the native ones and those only transformers trains."""
    root = tmp_path_factory.mktemp("families")
    made = {name: make_hf_model(root / name, seed=4, **case) for name, case in NATIVE_CASES.items()}
    made.update({name: make_library_model(root / name, name, seed=4, **case) for name, case in LIBRARY_CASES.items()})
    return made


def _transformers_path(folder: Path) -> TransformersModel:
    config, weights = load_transformers_start(folder)
    model = TransformersModel(config)
    model.load_weights(weights, str(folder))
    return model.eval()


def _our_loss(model, balance: RouterBalance | None, tokens: torch.Tensor) -> float:
    """The next-token loss of ``tokens`` as the trainer scores it (the whole row through the model, each position
    but the last scored), plus the router's weighted loss when there is one."""
    where = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    scores = model(tokens, score=TokenTargets(tokens[:, 1:], where=where))
    loss = -scores.logps.mean()
    added = balance.loss(1) if balance is not None else None
    return float(loss if added is None else loss + added)


@pytest.mark.parametrize("family", sorted({*NATIVE_CASES, *LIBRARY_CASES}))
def test_the_loss_is_transformers_own_on_each_path(folders, family):
    """transformers' loss (labels given; a mixture's router loss asked for, weighted by router_aux_loss_coef) is the
    trainer's, through transformers for every family and natively for those the trainer computes: logits shaped
    after the output projection (soft caps, Granite's and Cohere's scales, Falcon-H1's lm_head_multiplier) included,
    sequences past a sliding window, the load-balancing loss of every mixture."""
    folder = folders[family]
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))
    library = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    routed = hasattr(library.config, "output_router_logits")
    with torch.no_grad():
        expected = float(library(tokens, labels=tokens, **({"output_router_logits": True} if routed else {})).loss)
    model = _transformers_path(folder)
    assert (model.top_k is not None) == routed
    balance = RouterBalance([model], model.router_aux_loss_coef) if routed else None
    paths = {"transformers": _our_loss(model, balance, tokens)}
    if family in NATIVE_CASES:
        native = load_pretrained(folder)
        paths["native"] = _our_loss(native, router_balance(native), tokens)
    for path, loss in paths.items():
        assert math.isclose(loss, expected, rel_tol=2e-6, abs_tol=1e-6), (path, loss, expected)


def test_a_shaped_familys_logits_are_the_librarys_own_and_its_config_is_read_as_transformers_reads_it(folders):
    """Falcon-H1 scales its logits by lm_head_multiplier in its forward, and Bamba and Falcon-H1 save
    time_step_limit as a tagged float: both build, and score from the library's logits."""
    for family in ("falcon_h1", "bamba"):
        saved = json.loads((folders[family] / "config.json").read_text())
        assert {"__float__": "Infinity"} in saved["time_step_limit"]
    model = _transformers_path(folders["falcon_h1"])
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(tokens)
        hidden = model.library_model.get_decoder()(input_ids=tokens).last_hidden_state
        unshaped = model.library_model.lm_head(hidden)
        assert torch.allclose(logits, unshaped * 0.37, atol=1e-5)
        scores = model(tokens, score=TokenTargets(tokens)).logps
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (scores - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("family", "attention"), [("gemma2", "eager"), ("gpt_oss", "eager"), ("llama", "sdpa"), ("cohere", "sdpa")]
)
def test_a_family_without_sdpa_runs_on_the_best_attention_it_has_and_the_plan_says_so(folders, family, attention):
    built = inspect_folder(folders[family], lora=False)
    assert built.attention == attention
    said = built.describe()
    assert ("does not support sdpa; the best it supports" in said) == (attention != "sdpa"), said


def test_lora_goes_on_every_linear_layer_that_computes_x_w_plus_b(folders):
    """Falcon's FalconLinear subclasses nn.Linear and computes x W^T + b: adapted, as PEFT adapts it. Phi-MoE's
    router subclasses nn.Linear but routes: left alone. GPT-NeoX's plain nn.Linear layers: adapted."""
    settings = LoRASettings(4, 8.0)
    expected = {
        "falcon": {"self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"},
        "phimoe": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
    }
    for family, layers in expected.items():
        model = _transformers_path(folders[family])
        adapted = add_transformers_adapters(model, settings)
        assert {name.split(".", 3)[3] for name in adapted} == layers, adapted
        assert len(adapted) == 2 * len(layers)
        tokens = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(3))
        loss = -model(tokens, score=TokenTargets(tokens)).logps.mean()
        loss.backward()  # the adapters train (B starts at zero: A gets no gradient yet, B does)
        assert all(param.grad is not None for name, param in model.named_parameters() if "lora_B" in name)


def test_the_run_plan_builds_without_weights_what_the_trainer_builds(folders):
    """inspect_folder makes the model on the meta device: no weight is read, and what it finds is the model's."""
    built = inspect_folder(folders["olmoe"], lora=True)
    assert (built.model_type, built.attention, built.router_aux_loss_coef) == ("olmoe", "sdpa", 0.3)
    assert "load-balancing loss x 0.3" in built.describe()
    assert TransformersConfig.load(folders["olmoe"]).folder == folders["olmoe"]


@pytest.mark.slow
def test_a_mixtures_router_loss_is_trained_and_reported_through_transformers_as_natively(
    folders, tmp_path, train_yaml, run_trainer, one_thread
):
    """Mixtral trained through transformers takes the steps the native path takes (the loss of step 2 follows the
    gradients of step 1), router loss included, and both report router_aux_loss and expert_load/<e>; OLMoE (only
    transformers computes it) reports them too."""
    from astrai.common.contract import METRIC_EXPERT_LOAD, METRIC_ROUTER_AUX_LOSS, METRICS_FILE
    from astrai.common.metrics import read_records

    runs = {"native": ("mixtral", "native"), "transformers": ("mixtral", "transformers"), "olmoe": ("olmoe", "auto")}
    records = {}
    for name, (family, backend) in runs.items():
        keys = dict(max_steps=2, ckpt_interval=2, log_interval=1, val_fraction=0.0, backend=backend)
        run_trainer(
            train_yaml(
                tmp_path / f"{name}.yaml", ckpt_dir=str(tmp_path / name), param_path=str(folders[family]), **keys
            )
        )
        records[name] = read_records(tmp_path / name / METRICS_FILE)
        assert [record["step"] for record in records[name]] == [1, 2]
        for record in records[name]:
            assert record[METRIC_ROUTER_AUX_LOSS] > 0 and f"{METRIC_EXPERT_LOAD}/3" in record, record
    for native, through in zip(records["native"], records["transformers"], strict=True):
        for key in ("loss", METRIC_ROUTER_AUX_LOSS):
            assert math.isclose(native[key], through[key], rel_tol=1e-5), (key, native, through)


def _edit(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _albert(folder: Path) -> Path:
    """A masked language model: transformers has no causal LM of its kind."""
    config = transformers.AlbertConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    transformers.AlbertModel(config).save_pretrained(folder)
    return folder


def _gpt2(folder: Path) -> Path:
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


REFUSED = {
    "unknown model_type": (
        lambda folder: _edit(make_library_model(folder, "gpt_neox"), model_type="not_a_family"),
        {},
        "transformers cannot read its config.json (model_type 'not_a_family'): The checkpoint you are trying to load "
        "has model type `not_a_family`",
    ),
    "not a causal language model": (
        _albert,
        {},
        "transformers cannot build model_type 'albert' as a causal language model (AutoModelForCausalLM): "
        "Unrecognized configuration class",
    ),
    "a value its config refuses": (
        lambda folder: _edit(make_library_model(folder, "gpt_neox"), layer_norm_eps="tiny"),
        {},
        "Field 'layer_norm_eps' expected float, got str",
    ),
    "an activation it does not have": (
        lambda folder: _edit(make_library_model(folder, "stablelm"), hidden_act="swoosh"),
        {},
        "transformers cannot build model_type 'stablelm' as a causal language model (AutoModelForCausalLM): 'swoosh'",
    ),
    "LoRA without a linear layer": (
        _gpt2,
        {"lora_rank": 4},
        "gpt2: its decoder blocks hold no nn.Linear layer for LoRA to adapt (their layers with weights: Conv1D, ",
    ),
}


ASKED_BY_PREFLIGHT = ("not a causal language model", "LoRA without a linear layer")
"""The cases preflight also makes (each asks a Python process of its own: seconds of imports)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_dry_run_and_preflight_refuse_what_the_trainer_refuses_naming_the_folder(tmp_path, train_yaml, capsys, case):
    import yaml

    from astrai.host import preflight
    from astrai.host.runtime import resolve_runtime
    from astrai.host.trainer_config import read_trainer_config
    from astrai.trainer.run.loop import main

    make, keys, reason = REFUSED[case]
    folder = make(tmp_path / "m")
    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), param_path=str(folder), **keys)
    assert main(["--config", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"error: {folder}: " in err and reason in err and "Traceback" not in err, err
    assert main(["--config", str(config)]) == 2  # the trainer itself: refused before anything is read or built
    assert reason in capsys.readouterr().err
    if case not in ASKED_BY_PREFLIGHT:
        return
    for name in ("d", "c"):
        (tmp_path / name).mkdir()
    block = {"job_name": "edge", "gpu": {"devices": "none"}, "paths": {"data": "d", "model": "m", "checkpoints": "c"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"runtime": block, "training": keys}))
    runtime = resolve_runtime(tmp_path / "job.yaml")
    model, check = preflight._model_check(runtime, read_trainer_config(runtime, []))
    assert model is None and check.mark == preflight.FAIL and f"{folder}: " in check.detail and reason in check.detail


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_dry_run_of_a_family_without_sdpa_passes_and_names_its_attention(folders, tmp_path, train_yaml, capsys, family):
    from astrai.trainer.run.loop import main

    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), param_path=str(folders[family]))
    assert main(["--config", str(config), "--dry-run", "--backend", "transformers", "--lora_rank", "4"]) == 0
    out = capsys.readouterr().out
    assert f"attention eager ({family} does not support sdpa; the best it supports)" in out, out
    assert "start checks: passed" in out


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "starcoder2"])
def test_generate_takes_a_family_only_transformers_trains_as_training_does(folders, capsys, family):
    """`python -m astrai.model generate` on a folder of a family only transformers computes (a checkpoint of such a
    run is one): the library's greedy tokens, up to the model's stop tokens; --backend native is refused naming
    the way, and --backend transformers takes a native family too, with the native engine's tokens."""
    from astrai.model import main as model_main
    from astrai.trainer.generation.decoding import until_stop
    from tests.support import transformers_generate

    folder = folders[family]
    args = ["generate", str(folder), "--prompt", "héllo", "--max_new_tokens", "10", "--tokenizer", "bytes"]
    assert model_main(args) == 0
    library = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs = until_stop(transformers_generate(library, [list("héllo".encode())], 10)[0], {2, 256})
    assert capsys.readouterr().out == bytes(t for t in theirs if t < 256).decode("utf-8", "replace") + "\n"
    assert model_main([*args, "--backend", "native"]) == 2
    err = capsys.readouterr().err
    assert f"--backend native, but model_type '{family}' has no native implementation" in err, err
    llama = ["generate", str(folders["llama"]), *args[2:]]
    assert model_main(llama) == 0
    native = capsys.readouterr().out
    assert model_main([*llama, "--backend", "transformers"]) == 0
    assert capsys.readouterr().out == native


def test_model_compile_true_compiles_the_librarys_blocks_and_auto_leaves_them_eager(folders, tmp_path, train_yaml):
    from astrai.common.config import load_trainer_config
    from astrai.common.plan import resolve_plan

    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), param_path=str(folders["gpt_neox"]))
    for compile, device, compiled in [("true", "cpu", True), ("auto", "cuda", False), ("false", "cuda", False)]:
        plan = resolve_plan(load_trainer_config(path, [("compile", compile)]), device, 1)
        assert plan.compile is compiled
        assert (", each block compiled" in "\n".join(plan.lines())) is compiled


@pytest.mark.slow
def test_a_compiled_run_through_transformers_takes_the_eager_runs_steps(folders, tmp_path, train_yaml, make_trainer):
    from astrai.common.contract import METRICS_FILE
    from astrai.common.metrics import read_records

    losses = {}
    for compile in (False, True):
        keys = dict(max_steps=2, ckpt_interval=2, log_interval=1, compile=compile, param_path=str(folders["gpt_neox"]))
        trainer = make_trainer(train_yaml(tmp_path / f"{compile}.yaml", ckpt_dir=str(tmp_path / str(compile)), **keys))
        try:
            assert all((layer._compiled_call_impl is not None) is compile for layer in trainer.model.layers)
            trainer.train()
        finally:
            trainer.close()
        losses[compile] = [record["loss"] for record in read_records(tmp_path / str(compile) / METRICS_FILE)]
    assert len(losses[True]) == 2
    for eager, compiled in zip(losses[False], losses[True], strict=True):
        assert math.isclose(eager, compiled, rel_tol=1e-4)


@pytest.mark.parametrize("family", ["gpt_oss", "mistral", "gemma2"])
def test_rollouts_through_transformers_go_past_a_sliding_window_as_transformers_generates(folders, family):
    """The online types' rollouts on the transformers path (gpt-oss's window of 4, Mistral's of 6, Gemma 2's local
    layers of 8): prompts and completions past the window, left-padded in one batch, are transformers' greedy
    tokens; the room they may take is the model's context, not its window."""
    from astrai.common.settings import Sampling
    from astrai.trainer.generation.library import TransformersDecoding
    from tests.support import transformers_generate

    model = _transformers_path(folders[family])
    assert model.config.context >= model.config.max_seq_len >= 128  # the window (at most 8) is no limit
    prompts = [[5, 17, 42, 7, 99, 3, 12, 40, 41], [8, 250], [61, 62, 63, 64, 65]]
    ours = TransformersDecoding(model).generate(prompts, Sampling(max_new_tokens=12))
    library = transformers.AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32).eval()
    assert ours == [transformers_generate(library, [prompt], 12)[0] for prompt in prompts]


@pytest.mark.slow
def test_preflight_builds_the_folder_with_the_hosts_python_or_says_it_could_not(folders, tmp_path, monkeypatch):
    """Preflight asks `python -m astrai.model check` (the host never imports torch); on a host without
    transformers its line says the trainer builds the model at its start instead."""
    import shutil

    import yaml

    from astrai.host import preflight
    from astrai.host.runtime import resolve_runtime
    from astrai.host.trainer_config import read_trainer_config

    shutil.copytree(folders["gpt_oss"], tmp_path / "m")
    for name in ("d", "c"):
        (tmp_path / name).mkdir()
    block = {"job_name": "edge", "gpu": {"devices": "none"}, "paths": {"data": "d", "model": "m", "checkpoints": "c"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"runtime": block}))
    runtime = resolve_runtime(tmp_path / "job.yaml")
    config = read_trainer_config(runtime, [])
    _, check = preflight._model_check(runtime, config)
    assert check.mark == preflight.PASS, check.detail
    assert "attention eager (gpt_oss does not support sdpa; the best it supports); the router's load-balancing" in (
        check.detail
    )
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    _, check = preflight._model_check(runtime, config)
    assert check.mark == preflight.PASS
    assert "(not built here: transformers is not installed on this host; the trainer builds it at its start" in (
        check.detail
    )
