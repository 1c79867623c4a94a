"""The in-process benchmarks run end to end on the tiny preset, so that they keep up with the code they measure.

These check that every key is produced and sane, not the figures: speed is measured by `invoke bench`.
"""

from __future__ import annotations

import math

import pytest

from bench import checkpoint_cost, run, trainer_speed

pytestmark = pytest.mark.slow


def test_trainer_overhead_measures_both_loops(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_speed, "SETUPS", {"tiny": (32, 2, 1)})
    results = trainer_speed.measure("tiny", 3, tmp_path)
    assert results["tiny_trainer_tokens_per_s"] > 0 and results["tiny_bare_tokens_per_s"] > 0
    assert 0 < results["tiny_trainer_vs_bare"] < 10 and math.isfinite(results["tiny_trainer_vs_bare_spread"])


def test_checkpoint_cost_measures_every_key_against_dcp(tmp_path, monkeypatch):
    make_assets = trainer_speed.make_assets
    monkeypatch.setattr(checkpoint_cost, "make_assets", lambda folder, preset: make_assets(folder, "tiny"))
    monkeypatch.setattr(checkpoint_cost, "SETUPS", {"small": (32, 2)})
    monkeypatch.setattr(checkpoint_cost, "REPEATS", {"small": (2, 2)})
    env = checkpoint_cost.init_distributed("none", "cpu")
    results = checkpoint_cost._measure("small", tmp_path, env, quick=True)
    for key in (
        "ckpt_save_vs_dcp",
        "ckpt_save_vs_raw_fsync",
        "ckpt_save_vs_raw",
        "ckpt_stall_vs_dcp_async",
        "ckpt_stall_vs_sync",
        "resume_vs_dcp",
    ):
        assert results[key] > 0 and math.isfinite(results[f"{key}_spread"]), key
    assert results["ckpt_contention_vs_sync"] >= 0 and results["resume_s"] > 0
    # A periodic save copies the state once; a final save streams it (both well above zero only when copying).
    assert 0.5 < results["ckpt_peak_host_mem_vs_state"] < 3
    assert 0 <= results["ckpt_sync_peak_host_mem_vs_state"] < results["ckpt_peak_host_mem_vs_state"]


def test_the_table_names_targets_and_misses():
    results = {"trainer_vs_bare": 0.97, "trainer_vs_bare_spread": 0.01, "kill_exact": 3, "kill_runs": 3}
    table = run.table(results)
    assert "| 0.97 ± 1.0% | MISSED (>= 0.98) |" in table
    assert "| `kill_exact` | 3 | met (== 3) |" in table
    assert "ckpt_save_vs_dcp" not in table
