"""The loss over the vocabulary in chunks, on the CPU: its speed against the plain loss, and its memory as the
vocabulary grows.

- ``chunked_loss_vs_plain``: CPU time of a forward and backward pass of the `small` preset (window 128, batch 8)
  with the plain loss (the whole logits, then cross-entropy) over the same pass with the loss in chunks, in
  alternating turns. The trainer's loss is the chunked one.
- ``vocab_152k_step_peak_growth_gb``: a fresh process's peak resident memory during one forward and backward pass
  of 4,096 tokens (the `tiny` preset, batch 4, window 1024), above what it held before the pass, with Qwen's
  vocabulary (151,936) minus the same with a vocabulary of 512: what a large vocabulary costs a step beside its
  weights. ``plain_vocab_152k_step_peak_growth_gb``: the same with the plain loss, for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from astrai.trainer.models.native import Transformer
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.models.weights import PRESETS
from bench.common import REPO, TORCH_THREADS, Figures, fix_threads

QWEN_VOCAB = 151936

_PEAK = """
import json, sys
import torch
import torch.nn.functional as F
torch.set_num_threads({threads})
from astrai.common.model_folder import ModelConfig
from astrai.trainer.models.weights import PRESETS
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.models.native import Transformer

def status(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

vocab, chunked = int(sys.argv[1]), sys.argv[2] == "chunked"
config = ModelConfig(**{{**PRESETS["tiny"].__dict__, "vocab_size": vocab, "max_seq_len": 1024}})
model = Transformer(config)
tokens = torch.randint(0, vocab, (4, 1025), generator=torch.Generator().manual_seed(0))
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # the peak resident size starts again from now
before = status("VmRSS")
if chunked:
    loss = -model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:])).logps.mean()
else:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
loss.backward()
print(json.dumps({{"growth": status("VmHWM") - before}}))
"""


def _peak_growth(vocab: int, how: str) -> int:
    script = _PEAK.format(threads=TORCH_THREADS)
    done = subprocess.run(
        [sys.executable, "-c", script, str(vocab), how], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def _speed(turns: int, figures: Figures) -> None:
    model = Transformer(PRESETS["small"])
    model.init_weights(torch.Generator().manual_seed(0))
    tokens = torch.randint(0, model.config.vocab_size, (8, 129), generator=torch.Generator().manual_seed(1))

    def plain():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().view(-1, model.config.vocab_size), tokens[:, 1:].reshape(-1)).backward()

    def chunked():
        (-model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:])).logps.mean()).backward()

    sides = {"plain": plain, "chunked": chunked}
    for side in sides.values():  # warm-up
        side()
    times = {name: [] for name in sides}
    for turn in range(turns):
        for name in sides if turn % 2 == 0 else reversed(list(sides)):
            model.zero_grad(set_to_none=True)
            start = time.process_time()
            sides[name]()
            times[name].append(time.process_time() - start)
    figures.ratio("chunked_loss_vs_plain", times["plain"], times["chunked"])


def run(quick: bool) -> Figures:
    fix_threads()
    figures = Figures()
    _speed(7 if quick else 21, figures)
    growth = {(vocab, how): _peak_growth(vocab, how) for vocab in (512, QWEN_VOCAB) for how in ("chunked", "plain")}
    gb = 1e9
    figures.fraction(
        "vocab_152k_step_peak_growth_gb",
        (growth[(QWEN_VOCAB, "chunked")] - growth[(512, "chunked")]) / gb,
        1.0,
        inputs={f"{vocab} {how}": value for (vocab, how), value in growth.items()},
    )
    figures.fraction(
        "plain_vocab_152k_step_peak_growth_gb",
        (growth[(QWEN_VOCAB, "plain")] - growth[(512, "plain")]) / gb,
        1.0,
        inputs={f"{vocab} {how}": value for (vocab, how), value in growth.items()},
    )
    return figures
