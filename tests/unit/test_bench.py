"""The benchmarks: the in-process ones run end to end on the tiny preset, so that they keep up with the code
they measure, and every figure in bench/results.json is recomputed from the samples kept beside it.

These check that every key is produced and sane, not the figures: speed is measured by `invoke bench`.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import checkpoint_cost, gpu, run, trainer_speed
from bench.common import Figures
from tests.support import REPO


@pytest.mark.slow
def test_trainer_overhead_measures_both_loops(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_speed, "SETUPS", {"tiny": (32, 2, 1)})
    results = Figures()
    trainer_speed.measure("tiny", 3, tmp_path, results)
    assert results["tiny_trainer_tokens_per_s"] > 0 and results["tiny_bare_tokens_per_s"] > 0
    assert 0 < results["tiny_trainer_vs_bare"] < 10 and math.isfinite(results["tiny_trainer_vs_bare_spread"])


@pytest.mark.slow
def test_checkpoint_cost_measures_every_key_against_dcp(tmp_path, monkeypatch):
    make_assets = trainer_speed.make_assets
    monkeypatch.setattr(checkpoint_cost, "make_assets", lambda folder, preset: make_assets(folder, "tiny"))
    monkeypatch.setattr(checkpoint_cost, "SETUPS", {"small": (32, 2)})
    monkeypatch.setattr(checkpoint_cost, "REPEATS", {"small": (2, 2)})
    env = checkpoint_cost.init_distributed("none", "cpu")
    results = Figures()
    checkpoint_cost._measure("small", tmp_path, env, True, results)
    for key in (
        "ckpt_save_vs_dcp",
        "ckpt_save_vs_raw_fsync",
        "ckpt_save_vs_raw",
        "ckpt_stall_vs_dcp_async",
        "ckpt_stall_vs_sync",
        "resume_vs_dcp",
        "ckpt_write_vs_disk",
    ):
        assert results[key] > 0 and math.isfinite(results[f"{key}_spread"]), key
    assert results["disk_write_mb_per_s"] > 0
    assert results["ckpt_contention_vs_sync"] >= 0 and results["resume_s"] > 0
    # A periodic save copies the state once; a final save streams it (both well above zero only when copying).
    assert 0.5 < results["ckpt_peak_host_mem_vs_state"] < 3
    assert 0 <= results["ckpt_sync_peak_host_mem_vs_state"] < results["ckpt_peak_host_mem_vs_state"]

    assert set(results.samples) >= {"ckpt_save_vs_dcp", "resume_vs_dcp", "ckpt_peak_host_mem_vs_state"}


def test_the_table_names_targets_misses_and_the_run_of_each_row():
    runs = {"trainer_vs_bare": {"date": "2026-12-01", "mode": "quick", "load_average": 1.04}}
    results = {"trainer_vs_bare": 0.97, "trainer_vs_bare_spread": 0.01, "kill_exact": 3, "kill_runs": 3, "runs": runs}
    table = run.table(results)
    assert "| 0.97 ± 1.0% | MISSED (>= 0.98) | 2026-12-01 quick, load 1.0 |" in table
    assert "| `kill_exact` | 3 | met (== 3) |" in table
    assert "ckpt_save_vs_dcp" not in table


def test_every_figure_in_results_json_comes_back_from_its_samples():
    results = json.loads(run.RESULTS.read_text(encoding="utf-8"))
    figures = [key for key in results if key not in run.META_KEYS and not key.endswith("_spread")]
    assert set(run.TARGETS) <= set(figures), sorted(set(run.TARGETS) - set(figures))
    for key in figures:
        assert key in results["samples"] and key in results["runs"], key
        value, spread = run.recompute(results, key)
        assert value == pytest.approx(results[key]), key
        assert (spread is None) == (f"{key}_spread" not in results), key
        if spread is not None:
            assert spread == pytest.approx(results[f"{key}_spread"]), key


def test_a_partial_run_replaces_only_what_it_measured():
    earlier = {"date": "2026-11-30", "mode": "full", "load_average": 0.9, "section": "checkpoint cost"}
    results = {
        "base_ckpt_save_vs_dcp": 0.5,
        "base_ckpt_save_vs_dcp_spread": 0.1,
        "ckpt_save_vs_dcp": 0.6,
        "samples": {"base_ckpt_save_vs_dcp": {"method": "paired_ratio", "pairs": [[1, 2]]}},
        "runs": {"base_ckpt_save_vs_dcp": earlier},
    }
    figures = Figures()
    figures.ratio("ckpt_save_vs_dcp", [1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    now = {"date": "2026-12-01", "mode": "quick", "load_average": 1.1, "section": "checkpoint cost"}
    run.merge(results, figures, now)
    assert results["base_ckpt_save_vs_dcp"] == 0.5 and results["runs"]["base_ckpt_save_vs_dcp"] == earlier
    assert results["ckpt_save_vs_dcp"] == 1.0 and results["runs"]["ckpt_save_vs_dcp"] == now
    assert results["samples"]["ckpt_save_vs_dcp"]["pairs"] == [[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]]


def test_the_docs_table_is_the_one_results_json_makes():
    results = json.loads(run.RESULTS.read_text(encoding="utf-8"))
    assert run.summary(results) in run.DOCS.read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_gpu_section_runs_on_a_cpu_at_tiny_sizes(tmp_path):
    """`invoke bench --gpu`'s code, every part of it, on a CPU (so it cannot rot between GPU runs): it writes a gpu
    block with each figure and its samples into the results file it is given, and nothing else there changes."""
    import json
    import subprocess
    import sys

    out = tmp_path / "results.json"
    out.write_text(json.dumps({"trainer_vs_bare": 1.0}))
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    block = results["gpu"]
    assert results["trainer_vs_bare"] == 1.0 and block["errors"] == {}, block["errors"]
    for key in (
        "trainer_vs_bare",
        "trainer_vs_transformers",
        "compile_speedup",
        "lora_tokens_per_s_vs_full",
        "lora_peak_mem_vs_full",
        "nf4_tokens_per_s_vs_bf16",
        "nf4_peak_mem_vs_bf16",
        "nf4_step0_loss_vs_bf16",
        "chunked_loss_tokens_per_s_vs_plain",
        "generate_vs_transformers",
        "generate_sampled_vs_transformers",
        "rollout_share",
        "ckpt_save_vs_disk",
        "ckpt_stall_vs_sync",
        "ckpt_peak_host_mem_vs_state",
        "deterministic_bitwise",
        "deterministic_bitwise_eager",
        "default_save_max_abs_diff",
    ):
        assert key in block and key in block["samples"], key
    # On a CPU every run is bitwise equal to every other, in either mode.
    assert block["deterministic_bitwise"] is True and block["default_save_max_abs_diff"] == 0.0
    assert block["generate_same_rows"] == 1.0
    assert set(block["part_seconds"]) == set(gpu.PARTS) and block["device"] == gpu.CPU_DEVICE


@pytest.mark.slow
def test_a_gpu_part_that_raises_or_kills_its_process_costs_only_its_own_figures(tmp_path):
    """Each part runs in a process of its own: one that raises and one whose process dies (as an out-of-memory kill
    or a sticky CUDA error would end it) are recorded under errors, and the other part's figures are still written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--out", str(out)]
    for part in ("chunked loss", "lora", "checkpoints"):
        command += ["--only", part]
    command += ["--fault", "chunked loss=raise", "--fault", "lora=kill"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    block = json.loads(out.read_text())["gpu"]
    assert block["errors"] == {
        "chunked loss": "RuntimeError: a fault asked for in chunked loss",
        "lora": "its process was killed by SIGKILL",
    }
    for key in ("ckpt_save_vs_disk", "ckpt_stall_vs_sync", "ckpt_peak_host_mem_vs_state"):
        assert key in block and key in block["samples"], key
    assert not any(key.startswith(("lora_", "chunked_loss_")) for key in block)
    assert set(block["part_seconds"]) == {"chunked loss", "lora", "checkpoints"}
