"""Post-training: chat templates as transformers renders them, SFT and DPO losses against transformers, behaviour.

The tokenizer, base model and records are tests/unit/chat_data.py's; every model is tiny and runs
on one CPU thread.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from chat_data import SYSTEM_PROMPT, make_chat_world, sft_records, write_jsonl
from hf_folders import make_tokenizer

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.data_folder import DataError, TokenData
from astrai.common.fit import SetupError
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.weights import load_pretrained
from astrai.trainer.objectives.supervised import Supervised
from astrai.trainer.run.loop import open_trainer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

END_OF_TURN = {"chatml": "<|im_end|>", "header": "<|eot_id|>"}


def _sequences(folder) -> list[tuple[list[int], list[int]]]:
    """Every (ids, mask) sequence of a post-training data folder, in order."""
    data = TokenData.open(folder)
    out = []
    for shard, path in enumerate(data.shard_files):
        dtype = torch.uint16 if data.dtype == "uint16" else torch.int32
        ids = torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype).to(torch.int64).tolist()
        mask = list(data.mask_file(shard).read_bytes())
        at = 0
        for length in data.sequence_lengths(shard):
            out.append((ids[at : at + length], mask[at : at + length]))
            at += length
    return out


def _template_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("style", ["chatml", "header"])
def test_prepared_chat_records_are_the_tokens_of_apply_chat_template_and_supervise_assistant_turns_only(
    tmp_path, style
):
    # chatml keeps its template in tokenizer_config.json, header in chat_template.jinja.
    world = make_chat_world(tmp_path, style, sft_count=30, dpo_count=12)
    if style == "header":
        assert (world.tokenizer / "chat_template.jinja").is_file()
    tokenizer = HFTokenizer(world.tokenizer)
    prepare(tmp_path / "sft", [world.sft_file], tokenizer=tokenizer, kind="sft")
    reference = transformers.AutoTokenizer.from_pretrained(world.tokenizer)
    end = END_OF_TURN[style]
    sequences = _sequences(tmp_path / "sft")
    assert len(sequences) == len(world.sft_records)
    for record, (ids, mask) in zip(world.sft_records, sequences, strict=True):
        assert ids == _template_ids(reference, record["messages"])
        supervised = reference.decode([token for token, bit in zip(ids, mask, strict=True) if bit])
        answers = [m["content"] + end for m in record["messages"] if m["role"] == "assistant"]
        # Every assistant turn (multi-turn records have two), with its end-of-turn token, and nothing else.
        assert supervised == "".join(answers)
        assert SYSTEM_PROMPT not in supervised and "assistant" not in supervised

    prepare(tmp_path / "dpo", [world.dpo_file], tokenizer=tokenizer, kind="dpo")
    pairs = _sequences(tmp_path / "dpo")
    assert len(pairs) == 2 * len(world.dpo_records)
    for number, record in enumerate(world.dpo_records):
        for row, key in enumerate(("chosen", "rejected")):
            ids, mask = pairs[2 * number + row]
            messages = record["prompt"] + [{"role": "assistant", "content": record[key]}]
            assert ids == _template_ids(reference, messages)
            assert reference.decode([t for t, bit in zip(ids, mask, strict=True) if bit]) == record[key] + end


def test_messages_with_a_tokenizer_without_a_chat_template_are_refused_naming_the_fix(tmp_path):
    folder = make_tokenizer(tmp_path / "plain", ["some words to learn from"] * 20)
    records = write_jsonl(tmp_path / "chat.jsonl", sft_records(3))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "astrai.data", "prepare", "--kind", "sft", "--tokenizer", str(folder)]
    result = subprocess.run([*command, "--out", str(out), str(records)], capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no chat template" in result.stderr and "chat_template" in result.stderr, result.stderr
    assert not out.exists()
    # prompt/completion records need no template.
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "say cat", "completion": " cat"}] * 4)
    result = subprocess.run([*command, "--out", str(out), str(plain)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ids, mask = _sequences(out)[0]
    assert sum(mask) == len(HFTokenizer(folder).ids([" cat"])[0]) + 1 and mask[-1] == 1


def test_a_data_folder_of_another_kind_is_refused_with_the_command_that_prepares_the_right_one(
    tmp_path, post_yaml, corpus_data, chat_world
):
    from astrai.train import main

    path = post_yaml(tmp_path / "train.yaml", "sft", data_root_path=str(corpus_data), ckpt_dir=str(tmp_path / "c"))
    with pytest.raises(Exception) as caught:
        open_trainer(load_trainer_config(path), init_distributed("none", "cpu"))
    message = str(caught.value)
    assert "holds pre-training text (kind seq)" in message and "prepare --kind sft" in message
    assert main(["--config", str(path)]) != 0
    _, _, dpo = chat_world
    path = post_yaml(tmp_path / "seq.yaml", "seq", data_root_path=str(dpo), ckpt_dir=str(tmp_path / "d"))
    with pytest.raises(Exception, match=r"holds DPO pairs \(kind dpo\).*astrai.data prepare --tokenizer"):
        open_trainer(load_trainer_config(path), init_distributed("none", "cpu"))
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def _sft_trainer(tmp_path, post_yaml, make_trainer, **keys):
    tmp_path.mkdir(exist_ok=True)
    path = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), **keys)
    return make_trainer(path)


def test_the_sft_loss_is_transformers_loss_with_labels_ignored_outside_the_supervised_tokens(
    tmp_path, post_yaml, make_trainer, chat_world, one_thread
):
    trainer = _sft_trainer(tmp_path, post_yaml, make_trainer)
    try:
        dataset, env = trainer.dataset, trainer.env
        numbers = [0, 1, 2, 3]
        batch = torch.utils.data.default_collate([dataset.item(n) for n in numbers])
        objective = Supervised(env)
        (prepared,) = objective.prepare_step([batch], trainer.model, 0)
        with torch.no_grad():
            ours, _ = objective.micro(trainer.model, batch, prepared, 1)
        records = [dataset.index.sequence(s, take) for n in numbers for s, take in dataset.packing.windows[n]]
    finally:
        trainer.close()
    assert len(records) > len(numbers)  # windows hold several records each
    longest = max(len(ids) for ids, _ in records)
    inputs = torch.zeros(len(records), longest, dtype=torch.int64)
    labels = torch.full((len(records), longest), -100, dtype=torch.int64)
    attention = torch.zeros(len(records), longest, dtype=torch.int64)
    for row, (ids, mask) in enumerate(records):
        inputs[row, : len(ids)] = ids
        labels[row, : len(ids)] = torch.where(mask.bool(), ids, -100)
        attention[row, : len(ids)] = 1
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_world[0].model, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())


def test_a_record_packed_among_others_has_the_logits_it_has_alone(tmp_path, post_yaml, make_trainer, one_thread):
    trainer = _sft_trainer(tmp_path, post_yaml, make_trainer)
    try:
        dataset, model = trainer.dataset, trainer.model
        inputs, targets, weights, positions, segments = dataset.item(0)
        with torch.no_grad():
            packed = model(inputs[None], positions[None], segments[None])[0]
            at = 0
            assert len(dataset.packing.windows[0]) >= 2
            for sequence, take in dataset.packing.windows[0]:
                ids, _ = dataset.index.sequence(sequence, take)
                alone = model(ids[None, :-1])[0]
                assert (packed[at : at + take - 1] - alone).abs().max().item() <= 1e-5
                at += take - 1
    finally:
        trainer.close()


def test_one_global_batch_as_one_by_four_or_four_by_one_gives_the_same_update(
    tmp_path, post_yaml, make_trainer, one_thread
):
    """The step's gradient, which every optimizer turns into its update, is the same however the batch is split.

    (The weights after one AdamW step are not compared: its first update is about lr * sign(gradient), which
    turns float rounding in near-zero gradients into differences of lr.)
    """
    gradients, counts = [], []
    for per_device, accum in ((4, 1), (1, 4)):
        trainer = _sft_trainer(
            tmp_path / f"{per_device}x{accum}",
            post_yaml,
            make_trainer,
            batch_per_device=per_device,
            grad_accum_steps=accum,
            max_steps=1,
            max_grad_norm=0.0,
        )
        try:
            windows = list(trainer.sampler)[:accum]
            counts.append([trainer.dataset[w][2].sum().item() for batch in windows for w in batch])
            step = trainer.optimizer.step

            def keep_gradients(step=step, model=trainer.model):
                gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
                step()

            trainer.optimizer.step = keep_gradients
            trainer.train()
        finally:
            trainer.close()
    assert counts[0] == counts[1] and len(set(counts[0])) > 1, counts  # the same windows, uneven supervision
    one_by_four, four_by_one = gradients
    for name, gradient in one_by_four.items():
        assert torch.allclose(gradient, four_by_one[name], rtol=1e-4, atol=1e-7), name
    # What averaging each micro-batch's own loss would do instead: weight every window equally.
    total = sum(counts[0])
    assert max(abs(count / total - 1 / 4) for count in counts[0]) > 0.02


def _token_log_probs(model, inputs, targets, weights):
    logits = model(input_ids=inputs).logits.float()
    chosen = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return (chosen * weights).sum(-1)


@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_dpo_starts_at_ln2_with_zero_rewards_and_matches_the_formula_on_transformers_log_probs(
    tmp_path, post_yaml, make_trainer, chat_world, reference, one_thread
):
    world, _, _ = chat_world
    path = post_yaml(
        tmp_path / "dpo.yaml",
        "dpo",
        ckpt_dir=str(tmp_path / "ckpt"),
        log_interval=1,
        max_steps=8,
        dpo_reference=reference,
    )
    trainer = make_trainer(path)
    try:
        trainer.train(steps=1)
        first = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[0])
        assert abs(first["loss"] - math.log(2)) <= 1e-6, first
        for key in ("rewards_chosen", "rewards_rejected", "rewards_margin"):
            assert abs(first[key]) <= 1e-7, first
        trainer.train()
        dataset = trainer.dataset
        batch = torch.utils.data.default_collate([dataset.item(n) for n in range(6)])
        objective = trainer.objective
        with torch.no_grad():
            losses, rewards = objective._pairs(trainer.model, batch)
    finally:
        trainer.close()
    latest = latest_complete_checkpoint(tmp_path / "ckpt")
    policy = transformers.AutoModelForCausalLM.from_pretrained(latest.path, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(world.model, dtype=torch.float32)
    inputs, targets, weights = (part.view(-1, part.shape[-1]) for part in batch[:3])
    with torch.no_grad():
        pi = _token_log_probs(policy, inputs, targets, weights).view(-1, 2)
        ref = _token_log_probs(base, inputs, targets, weights).view(-1, 2)
    beta = 0.1
    expected = -F.logsigmoid(beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])))
    assert (losses - expected).abs().max().item() <= 1e-5
    assert (rewards - beta * (pi - ref)).abs().max().item() <= 1e-5
    assert rewards.abs().max().item() > 1e-3  # the policy moved: this is not the first step again


def test_sft_lowers_the_loss_of_the_replies_and_never_learns_the_system_prompt(
    tmp_path, post_yaml, make_trainer, chat_world, one_thread
):
    world, _, _ = chat_world
    held_out = tmp_path / "held-out"
    tokenizer = HFTokenizer(world.tokenizer)
    prepare(held_out, [write_jsonl(tmp_path / "eval.jsonl", sft_records(30, seed=99))], tokenizer=tokenizer, kind="sft")
    prefix = tokenizer.ids([f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>"])[0]

    def losses(folder) -> tuple[float, float]:
        """Mean loss on the replies' supervised tokens, and on the system prompt's tokens."""
        model = load_pretrained(folder)
        replies = system = 0.0
        counted = [0, 0]
        with torch.no_grad():
            for ids, mask in _sequences(held_out):
                assert ids[: len(prefix)] == prefix
                ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.float32)
                token = F.cross_entropy(model(ids[None, :-1])[0], ids[1:], reduction="none")
                replies += (token * mask[1:]).sum().item()
                system += token[1 : len(prefix) - 1].sum().item()
                counted[0] += mask[1:].sum().item()
                counted[1] += len(prefix) - 2
        return replies / counted[0], system / counted[1]

    path = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), max_steps=60, max_lr=3e-3)
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    before = losses(world.model)
    after = losses(latest_complete_checkpoint(tmp_path / "ckpt").path)
    print(f"replies {before[0]:.3f} -> {after[0]:.3f}, system prompt {before[1]:.3f} -> {after[1]:.3f}")
    assert after[0] < 0.6 * before[0]
    # Never supervised, the system prompt is not learned: supervising it would drive its loss near 0 first.
    assert after[1] >= 0.95 * before[1]


def test_dpo_raises_the_margin_and_ranks_its_training_pairs(tmp_path, post_yaml, make_trainer, one_thread):
    path = post_yaml(tmp_path / "dpo.yaml", "dpo", ckpt_dir=str(tmp_path / "ckpt"), max_steps=40, max_lr=1e-3)
    trainer = make_trainer(path)
    try:
        trainer.train()
        dataset = trainer.dataset
        with torch.no_grad():
            batch = torch.utils.data.default_collate([dataset[n] for n in range(len(dataset))])
            _, rewards = trainer.objective._pairs(trainer.model, batch)
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    margins = [record["rewards_margin"] for record in records if "rewards_margin" in record]
    assert margins[-1] > margins[0] + 1.0, margins
    accuracy = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
    assert accuracy >= 0.9, accuracy


def test_a_post_training_checkpoint_chats_in_transformers_with_its_own_template(
    tmp_path, post_yaml, make_trainer, one_thread
):
    path = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), max_steps=5)
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    folder = latest_complete_checkpoint(tmp_path / "ckpt").path
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "cat sat"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert tokenizer.decode(prompt[0]).endswith("<|im_start|>assistant\n")
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_resuming_against_another_reference_or_another_train_type_is_refused(
    tmp_path, post_yaml, make_trainer, tiny_model, chat_world, one_thread
):
    world, _, _ = chat_world
    other = tmp_path / "other-reference"
    from astrai.common.model_folder import ModelConfig
    from astrai.trainer.models.weights import write_base_model

    write_base_model(other, ModelConfig.load(world.model), seed=5)
    path = post_yaml(tmp_path / "dpo.yaml", "dpo", ckpt_dir=str(tmp_path / "ckpt"), max_steps=4, ckpt_interval=2)
    trainer = make_trainer(path, max_steps=2)
    try:
        trainer.train()
    finally:
        trainer.close()
    meta = latest_complete_checkpoint(tmp_path / "ckpt").meta
    assert meta.train_type == "dpo" and meta.reference["path"] == str(world.model)
    assert len(meta.reference["sha256"]) == 64
    with pytest.raises(SetupError, match="is not the one its checkpoint"):
        make_trainer(path, reference_path=str(other))
    with pytest.raises(SetupError, match="a job dir holds one run"):
        make_trainer(post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt")))
    trainer = make_trainer(path)  # the same reference resumes
    try:
        assert trainer.progress.step == 2
    finally:
        trainer.close()


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_records_longer_than_the_window_are_cut_or_left_out_and_counted_at_start(
    tmp_path, post_yaml, make_trainer, chat_world, capsys, overlong, one_thread
):
    lengths = sorted(len(ids) for ids, _ in _sequences(chat_world[1]))
    window = lengths[len(lengths) // 2]  # about half the records are longer
    trainer = make_trainer(
        post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), window_size=window, overlong=overlong)
    )
    try:
        units = trainer.dataset.packing
        for packed in units.windows:
            assert sum(take - 1 for _, take in packed) <= window
    finally:
        trainer.close()
    output = capsys.readouterr().out
    longer = sum(length - 1 > window for length in lengths)
    assert longer > 0
    count = units.truncated if overlong == "truncate" else units.dropped
    assert count == longer
    word = "cut to the window" if overlong == "truncate" else "left out"
    assert f"longer than the window: {count:,} {word} (data.overlong: {overlong})" in output


def test_muon_takes_the_block_matrices_and_is_refused_under_fsdp(tmp_path, post_yaml, make_trainer, one_thread):
    trainer = _sft_trainer(tmp_path, post_yaml, make_trainer, optimizer="muon")
    try:
        adamw, muon = trainer.optimizer.parts
        assert isinstance(muon, torch.optim.Muon)
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        in_muon = sorted(names[id(p)] for group in muon.param_groups for p in group["params"])
        in_adamw = sorted(names[id(p)] for group in adamw.param_groups for p in group["params"])
        # 4 layers x (wq, wk, wv, wo, w1, w2, w3); the embedding (tied to the head) and the norms stay with AdamW.
        assert len(in_muon) == 4 * 7 and all(n.startswith("layers.") for n in in_muon)
        assert "tok_embeddings.weight" in in_adamw and "layers.0.attention_norm.weight" in in_adamw
        assert len(in_muon) + len(in_adamw) == len(names)
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="muon orthogonalises each weight matrix whole"):
        load_trainer_config(post_yaml(tmp_path / "fsdp.yaml", "sft", optimizer="muon"), [("parallel_mode", "fsdp")])


def test_the_base_model_s_generation_config_travels_into_every_checkpoint_and_export(
    tmp_path, post_yaml, make_trainer, chat_world, one_thread
):
    from astrai.host.export import export_checkpoint

    world, _, _ = chat_world
    base = tmp_path / "base"
    shutil.copytree(world.model, base)
    stops = {"eos_token_id": [3, 4], "max_new_tokens": 12, "do_sample": False}
    (base / "generation_config.json").write_text(json.dumps(stops))
    path = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), param_path=str(base), max_steps=4)
    for stop_at in (2, 4):  # the second run resumes from a checkpoint: it carries the file on
        trainer = make_trainer(path, max_steps=stop_at, ckpt_interval=2)
        try:
            trainer.train()
        finally:
            trainer.close()
        (base / "generation_config.json").unlink(missing_ok=True)
    for folder in sorted((tmp_path / "ckpt").glob("epoch_*")):
        assert transformers.GenerationConfig.from_pretrained(folder).eos_token_id == [3, 4], folder
    export_checkpoint(latest_complete_checkpoint(tmp_path / "ckpt").path, tmp_path / "export", None, 1 << 30)
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text()) == stops


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_window_that_cuts_records_to_their_prompts_is_refused_in_preflight_and_the_trainer(
    tmp_path, post_yaml, make_trainer, chat_world, kind
):
    from astrai.common.data_folder import data_kind

    world, sft, dpo = chat_world
    folder = sft if kind == "sft" else dpo
    first = min(mask.index(1) for _, mask in _sequences(folder))
    window = first - 2  # shorter than every prompt: each cut keeps no supervised target
    path = post_yaml(tmp_path / "post.yaml", kind, ckpt_dir=str(tmp_path / "ckpt"), window_size=window)
    expected = rf"data.window_size {window} cuts .* before their first supervised token .* would train on nothing"
    with pytest.raises(DataError, match=expected):
        data_kind(kind).units(TokenData.open(folder), window, "truncate")
    with pytest.raises(DataError, match=expected):
        make_trainer(path)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("epoch_*"))
    # Records whose cut still holds a supervised token train as before, and the others are counted.
    lengths = sorted(len(ids) for ids, _ in _sequences(folder))
    units = data_kind(kind).units(TokenData.open(folder), lengths[-1] - 3, "truncate")
    assert units.unsupervised == 0 and units.truncated > 0


def test_data_of_another_tokenizer_than_the_model_s_own_is_refused_naming_both(
    tmp_path, post_yaml, make_trainer, chat_world, one_thread
):
    from astrai.common.data_folder import tokenizer_digest
    from astrai.common.fit import check_model_tokenizer

    world, sft, _ = chat_world
    model = tmp_path / "model"
    shutil.copytree(world.model, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(world.tokenizer / name, model / name)
    check_model_tokenizer(TokenData.open(sft), model)  # its own tokenizer: fine
    # The same tokenizer saved again (another key order) means the same ids.
    saved = json.loads((model / "tokenizer.json").read_text())
    (model / "tokenizer.json").write_text(json.dumps(dict(reversed(list(saved.items())))))
    assert tokenizer_digest(model / "tokenizer.json") == TokenData.open(sft).tokenizer_meaning()
    # Another tokenizer of the same vocabulary size: other ids for the same text.
    vocab = len(saved["model"]["vocab"]) + len(saved["added_tokens"])
    other = make_tokenizer(
        tmp_path / "other",
        ["entirely different words here"] * 50,
        vocab_size=vocab,
        special=("<|im_end|>", "<|im_start|>", "<|endoftext|>"),
    )
    shutil.copyfile(world.tokenizer / "tokenizer_config.json", other / "tokenizer_config.json")
    data = tmp_path / "other-data"
    prepare(data, [world.sft_file], tokenizer=HFTokenizer(other), kind="sft")
    path = post_yaml(
        tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), param_path=str(model), data_root_path=str(data)
    )
    with pytest.raises(
        SetupError,
        match=rf"{data} was prepared with another tokenizer .* but the model {model} has its own tokenizer.json",
    ):
        make_trainer(path)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_resume_that_cannot_carry_the_optimizer_is_refused_and_other_data_is_announced(
    tmp_path, post_yaml, make_trainer, chat_world, capsys, one_thread
):
    from astrai.common.fit import check_resume

    world, sft, _ = chat_world
    data = tmp_path / "data"
    shutil.copytree(sft, data)
    path = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "ckpt"), data_root_path=str(data))
    trainer = make_trainer(path, max_steps=2, ckpt_interval=2)
    try:
        trainer.train()
    finally:
        trainer.close()
    latest = latest_complete_checkpoint(tmp_path / "ckpt")
    assert latest.meta.optimizer == "adamw" and latest.meta.data_digest
    with pytest.raises(SetupError, match=r"holds adamw moments, and this config asks for training.optimizer muon"):
        make_trainer(path, max_steps=4, optimizer="muon")
    # The same rule in preflight's hands (torch-free): the checkpoint's meta and the config.
    config = load_trainer_config(path, [("optimizer", "muon")])
    with pytest.raises(SetupError, match="cannot carry over"):
        check_resume(latest.meta, latest.path, config.training, latest.meta.data_digest)
    # The data folder prepared again from other records: the resume says so.
    prepare(
        data,
        [write_jsonl(tmp_path / "more.jsonl", sft_records(90, seed=5))],
        tokenizer=HFTokenizer(world.tokenizer),
        kind="sft",
    )
    capsys.readouterr()
    trainer = make_trainer(path, max_steps=3)
    trainer.close()
    assert "note: the data was prepared again since epoch_0_step_2 was written" in capsys.readouterr().out
