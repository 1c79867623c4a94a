"""The loss over the vocabulary computed a chunk of positions at a time equals the plain one (the whole logits tensor
in float32): losses and every gradient, for each train type that takes log-probabilities of tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.common.model_folder import ModelConfig
from astrai.common.settings import LoRASettings
from astrai.trainer.feed.records import DPOPair
from astrai.trainer.models import scoring as model_module
from astrai.trainer.models.lora import add_adapters, hold_base_in
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.objectives.reference import summed_log_probs
from astrai.trainer.objectives.rollouts import completion_logps

VOCAB = 509


@pytest.fixture(params=["untied", "tied"])
def model(request):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96)
    model = Transformer(ModelConfig(**{**config.__dict__, "tie_embeddings": request.param == "tied"}))
    model.init_weights(torch.Generator().manual_seed(1))
    return model


@pytest.fixture(autouse=True, params=["kept", "computed again"])
def small_chunks(monkeypatch, request):
    """Chunks of 5 positions (7 in the backward pass of a head that trains): every loss here spans several of them,
    and a last one that is not full; their logits kept from the forward pass for the backward, or computed again
    there."""
    monkeypatch.setattr(model_module, "LOGITS_CHUNK_BYTES", 5 * 4 * VOCAB)
    monkeypatch.setattr(model_module, "LOGITS_BACKWARD_CHUNK_BYTES", 7 * 4 * VOCAB)
    if request.param == "computed again":
        monkeypatch.setattr(model_module, "LOGITS_KEEP_BYTES", 0)


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to 1e-6 of the tensor's own scale: sums over the chunks add the same terms in another order."""
    return (got - expected).abs().max().item() <= 1e-6 * max(1.0, expected.abs().max().item())


def _same(model, plain, chunked) -> None:
    assert _close(chunked, plain), (chunked, plain)
    expected, got = _grads(model, plain), _grads(model, chunked)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        assert _close(got[name], expected[name]), (name, (got[name] - expected[name]).abs().max())


TOKENS = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(2))


def test_next_token_loss(model):
    logits = model(TOKENS[:, :-1])
    plain = F.cross_entropy(logits.float().reshape(-1, VOCAB), TOKENS[:, 1:].reshape(-1))
    chunked = -model(TOKENS[:, :-1], score=TokenTargets(TOKENS[:, 1:])).logps.mean()
    _same(model, plain, chunked)


def test_supervised_tokens_of_packed_records(model):
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    segments = (torch.arange(16) >= 7).long().expand(3, -1)
    positions = torch.where(segments == 0, torch.arange(16), torch.arange(16) - 7)
    weights = (torch.rand(3, 16, generator=torch.Generator().manual_seed(3)) > 0.4).float()
    logits = model(inputs, positions, segments)
    losses = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    plain = (losses * weights.reshape(-1)).sum()
    chunked = -(model(inputs, positions, segments, score=TokenTargets(targets)).logps * weights).sum()
    _same(model, plain, chunked)


def test_dpo_summed_log_probabilities(model):
    inputs, targets = TOKENS[:2, :-1].reshape(1, 2, 16), TOKENS[:2, 1:].reshape(1, 2, 16)
    weights = torch.ones(1, 2, 16)
    weights[..., :5] = 0.0
    pair = DPOPair(inputs, targets, weights, torch.tensor([0]))
    logits = model(inputs.view(-1, 16))
    token = -F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1), reduction="none")
    plain = (token * weights.reshape(-1)).view(-1, 2, 16).sum(-1)
    _same(model, plain.sum(), summed_log_probs(model, pair).sum())


def test_grpo_completion_log_probabilities_and_entropy(model):
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    completions = [[20, 21, 22, 23], [30, 31], [40, 41, 42, 43, 44, 45]]
    logps, mask, entropy = completion_logps(model, prompts, completions)
    # The plain way: every position's logits of the same padded rows, then the completions' positions picked.
    tokens = torch.zeros(3, 11, dtype=torch.long)
    where, targets = torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        where[row, : len(completion)] = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
        targets[row, : len(completion)] = torch.tensor(completion)
    logits = model(tokens)
    log_probs = logits.gather(1, where.unsqueeze(-1).expand(-1, -1, VOCAB)).float().log_softmax(dim=-1)
    plain = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1).detach() * mask, rtol=1e-5, atol=1e-6)
    _same(model, plain.sum(), (logps * mask).sum())


def test_a_frozen_bfloat16_head_under_lora_computes_as_the_plain_path(model):
    add_adapters(model, LoRASettings(4, 8.0), torch.Generator().manual_seed(0))
    hold_base_in(model, torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.02)
    logits = model(TOKENS[:, :-1])
    plain = F.cross_entropy(logits.float().reshape(-1, VOCAB), TOKENS[:, 1:].reshape(-1))
    chunked = -model(TOKENS[:, :-1], score=TokenTargets(TOKENS[:, 1:])).logps.mean()
    _same(model, plain, chunked)
