"""Remote judges (``{url: ..., kind: openai | score}`` in training.rewards) against a server on 127.0.0.1: both
protocols, the cap on requests in flight, timeouts and retries, a malformed answer, on_error, the key from the
environment that never shows in a rendered file or a log, the entries refused by key, and a run scored by a judge.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from judge_server import JudgeServer

from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.reward_specs import JudgeSpec, parse_rewards
from astrai.host.checklist import FAIL, PASS, WARN
from astrai.host.reward_checks import judge_check
from astrai.host.runtime import resolve_runtime
from astrai.trainer.objectives.judges import load_judge
from astrai.trainer.objectives.rewards import RewardError, RewardLimits, StepAbandoned, score

KEY = "sk-test-$ecret 'quoted' 0123"
"""A key with the characters a renderer could get wrong."""
TEMPLATE = "{prompt}\nRESPONSE:\n{completion}"
"""What the test server reads a chat request's message as: the prompt, then the completion."""


def _judge(server: JudgeServer, path: str = "/v1/chat/completions", **keys) -> JudgeSpec:
    entry = {"url": server.url + path, "kind": "openai", "prompt": TEMPLATE, "backoff": 0.01, **keys}
    (spec,) = parse_rewards([entry])
    return spec


def test_both_protocols_score_each_completion_with_its_fields():
    with JudgeServer(score=lambda prompt, completion: len(completion) / 10) as server:
        chat = load_judge(_judge(server, model="judge-7b", prompt="Q: {prompt} A: {answer}\nRESPONSE:\n{completion}"))
        scores = score([chat], ["2+2?", "3+3?"], ["four", "six!!"], {"answer": ["4", None]})
        assert scores.by_function["judge"] == [0.4, 0.5] and scores.total == [0.4, 0.5]
        first = server.requests[0]["body"]
        assert first["model"] == "judge-7b" and first["temperature"] == 0 and first["max_tokens"] == 16
        asked = sorted(request["body"]["messages"][0]["content"] for request in server.requests)
        assert asked == ["Q: 2+2? A: 4\nRESPONSE:\nfour", "Q: 3+3? A: \nRESPONSE:\nsix!!"]
        server.requests.clear()
        (spec,) = parse_rewards([{"url": server.url + "/score", "kind": "score", "label_field": "answer"}])
        scores = score([load_judge(spec)], ["2+2?", "3+3?"], [" four", " six"], {"answer": ["4", "6"]})
        assert scores.by_function["judge"] == [0.5, 0.4]
        bodies = sorted((request["body"] for request in server.requests), key=lambda body: body["prompts"][0])
        assert bodies == [
            {"query": ["2+2? four"], "prompts": ["2+2?"], "labels": ["4"]},
            {"query": ["3+3? six"], "prompts": ["3+3?"], "labels": ["6"]},
        ]


def test_requests_go_out_together_and_no_more_than_max_in_flight():
    with JudgeServer(delay=0.05) as server:
        judge = load_judge(_judge(server, max_in_flight=4))
        began = time.perf_counter()
        values = judge.function(["p"] * 16, ["x" * n for n in range(16)])
        seconds = time.perf_counter() - began
    assert values == [float(n) for n in range(16)]
    assert server.most_in_flight == 4
    assert seconds < 16 * 0.05 * 0.75, seconds  # one at a time would take 0.8 s; four at a time about 0.2


def test_a_late_or_failing_request_is_retried_with_backoff():
    with JudgeServer() as server:
        server.behave = [("sleep", 2.0), ("status", 503), ("status", 429)]
        judge = load_judge(_judge(server, timeout=0.5, retries=3, max_in_flight=1))
        assert judge.function(["p"], ["abc"]) == [3.0]
        assert len(server.requests) == 4  # timed out, 503, 429, answered


def test_what_is_left_after_the_retries_stops_the_run_naming_the_judge_or_with_on_error_none_is_counted():
    with JudgeServer() as server:
        server.behave = [("status", 503)] * 3
        with pytest.raises(RewardError) as raised:
            score([load_judge(_judge(server, retries=2, max_in_flight=1))], ["what?"], ["x"], {})
        message = str(raised.value)
        assert f"judge judge ({server.url}/v1/chat/completions) could not score the completion of prompt 'what?'" in (
            message
        )
        assert "HTTP 503" in message and "(after 3 attempts)" in message and "on_error: none" in message
        said = []
        (spec,) = parse_rewards(
            [
                {
                    "url": server.url + "/v1",
                    "kind": "openai",
                    "prompt": TEMPLATE,
                    "retries": 2,
                    "max_in_flight": 1,
                    "on_error": "none",
                }
            ]
        )
        judge = load_judge(spec, said.append)
        server.behave = [("status", 503)] * 3  # the first completion's three attempts fail, the second is answered
        assert score([judge], ["a", "b"], ["x", "yy"], {}).by_function["judge"] == [None, 2.0]
        assert len(said) == 1 and said[0].startswith("warning: judge judge (") and "left 1 of 2 completions" in said[0]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ('{"choices": [{"message": {"content": "I cannot rate this."}}]}', "no score in the reply 'I cannot rate"),
        ('{"choices": []}', "the answer has no choices[0].message.content"),
        ("<html>oops</html>", "the answer is not JSON: '<html>oops</html>'"),
        ('{"choices": [{"message": {"content": "Score: 1e999"}}]}', "expected a finite number"),
    ],
)
def test_a_malformed_answer_is_not_retried_and_says_what_it_was(answer, message):
    with JudgeServer() as server:
        server.behave = [("text", answer)]
        with pytest.raises(RewardError, match=re.escape(message)):
            score([load_judge(_judge(server, retries=3))], ["p"], ["c"], {})
        assert len(server.requests) == 1


def test_the_key_comes_from_the_environment_and_never_shows_in_a_message(monkeypatch):
    with JudgeServer() as server:
        spec = _judge(server, api_key_env="JUDGE_KEY")
        monkeypatch.delenv("JUDGE_KEY", raising=False)
        with pytest.raises(RewardError, match="its key's variable JUDGE_KEY \\(api_key_env\\) is not set"):
            load_judge(spec)
        monkeypatch.setenv("JUDGE_KEY", KEY)
        judge = load_judge(spec)
        assert judge.function(["p"], ["ab"]) == [2.0]
        assert server.requests[-1]["headers"]["Authorization"] == f"Bearer {KEY}"
        server.behave = [("status", 401)]
        with pytest.raises(RewardError) as raised:
            score([judge], ["p"], ["c"], {})
        assert "HTTP 401" in str(raised.value) and KEY not in str(raised.value) and "sk-test" not in str(raised.value)


def test_a_stop_during_a_slow_judge_gives_the_step_up():
    with JudgeServer() as server:
        server.behave = [("sleep", 30.0)]
        judge = load_judge(_judge(server, timeout=60, max_in_flight=1))
        began = time.monotonic()
        with pytest.raises(StepAbandoned):
            score([judge], ["p"], ["c"], {}, RewardLimits(300, lambda: time.monotonic() - began > 0.3))
        assert time.monotonic() - began < 5


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"url": "http://user:pw@judge/v1", "kind": "openai"}, "entry 0: url holds credentials; a secret never goes"),
        (
            {"url": "http://judge/v1", "kind": "openai", "api_key": "x"},
            "'api_key' is not one (a key comes from the env",
        ),
        ({"url": "ftp://judge", "kind": "openai"}, "url must be an http:// or https:// address"),
        ({"url": "http://judge", "kind": "grpc"}, "kind must be one of openai | score, got 'grpc'"),
        ({"url": "http://judge", "kind": "score", "on_error": "skip"}, "on_error must be one of stop | none"),
        ({"url": "http://judge", "kind": "score", "timeout": 0}, "timeout must be a number > 0, got 0"),
        ({"url": "http://judge", "kind": "score", "max_in_flight": 0}, "max_in_flight must be an integer >= 1"),
        ({"url": "http://judge", "kind": "score", "retries": -1}, "retries must be an integer >= 0"),
        ({"url": "http://judge", "kind": "openai", "pattern": "(a)(b)"}, "pattern may hold one group"),
        ({"url": "http://judge", "kind": "openai", "prompt": "rate it"}, "prompt must be text holding {completion}"),
        ({"url": "http://judge", "kind": "score", "api_key_env": "not a name"}, "api_key_env must name an environment"),
        ({"url": "http://judge", "kind": "score", "name": "two words"}, "name must be letters, digits and _"),
        ({"model": "/models/base/rm", "temperature": 1}, "a reward model takes batch_size, model, name, weight"),
    ],
)
def test_bad_entries_are_refused_saying_which_key_and_what_is_allowed(entry, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_rewards([entry])


def test_two_judges_need_names_of_their_own(tmp_path, train_yaml):
    judges = [{"url": "http://a/v1", "kind": "openai"}, {"url": "http://b/v1", "kind": "openai"}]
    path = train_yaml(tmp_path / "t.yaml", train_type="online_grpo", rewards=judges)
    with pytest.raises(ConfigError, match="training.rewards: two reward functions named judge"):
        load_trainer_config(path)
    judges[1]["name"] = "second"
    path = train_yaml(tmp_path / "u.yaml", train_type="online_grpo", rewards=judges)
    assert [spec.name for spec in load_trainer_config(path).training.rewards] == ["judge", "second"]


def test_the_key_is_passed_by_name_and_never_written_into_what_is_rendered(tmp_path, monkeypatch, tiny_model):
    from astrai.host import kubernetes, slurm_script
    from astrai.host.compose import dump_override, render_override

    monkeypatch.setenv("JUDGE_KEY", KEY)
    judge = {
        "url": "http://host.docker.internal:8000/v1/chat/completions",
        "kind": "openai",
        "api_key_env": "JUDGE_KEY",
    }
    runtime = {
        "job_name": "judged",
        "gpu": {"devices": "none"},
        "container": {"cuda_tag": "cpu"},
        "paths": {"data": str(tmp_path / "data"), "model": str(tiny_model)},
        "slurm": {"partition": "gpu", "time": "01:00:00", "launcher": "pyxis", "image": "registry/astrai:1"},
        "kubernetes": {"image": "registry/astrai:1", "claims": {"data": "d", "model": "m", "checkpoints": "c"}},
    }
    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump({"runtime": runtime, "training": {"train_type": "online_grpo", "rewards": [judge]}})
    )
    resolved = resolve_runtime(str(config))
    override = render_override(resolved, uid=1000, gid=1000)
    assert override["services"]["trainer"]["environment"]["JUDGE_KEY"] is None
    assert override["services"]["trainer"]["extra_hosts"] == ["host.docker.internal:host-gateway"]
    manifests = kubernetes.render_manifests(resolved, [])
    rendered = [
        dump_override(resolved, override),
        slurm_script.render_script(resolved, []),
        kubernetes.dump_manifests(resolved, manifests),
    ]
    for text in rendered:
        assert KEY not in text and "sk-test" not in text
    assert "# JUDGE_KEY is passed through from the environment sbatch was run in" in rendered[1]
    secret = {
        "name": "JUDGE_KEY",
        "valueFrom": {
            "secretKeyRef": {"name": kubernetes.tracker_secret_name(resolved), "key": "JUDGE_KEY", "optional": True}
        },
    }
    assert secret in _containers_env(manifests)


def test_preflight_says_whether_the_judge_can_be_reached_and_its_key_is_set(monkeypatch):
    (remote,) = parse_rewards([{"url": "https://judge.example/v1/chat/completions", "kind": "openai"}])
    assert judge_check(remote).mark == PASS
    (local,) = parse_rewards([{"url": "http://localhost:8000/v1", "kind": "score"}])
    found = judge_check(local)
    assert found.mark == WARN and "host.docker.internal" in found.detail
    (keyed,) = parse_rewards([{"url": "https://judge.example/v1", "kind": "openai", "api_key_env": "JUDGE_KEY"}])
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    missing = judge_check(keyed)
    assert missing.mark == FAIL and "JUDGE_KEY (api_key_env) is not set in this shell" in missing.detail
    monkeypatch.setenv("JUDGE_KEY", KEY)
    assert judge_check(keyed).mark == PASS and KEY not in judge_check(keyed).detail


def _containers_env(manifests: list[dict]) -> list[dict]:
    found = []

    def walk(value):
        if isinstance(value, dict):
            if "containers" in value:
                for container in value["containers"]:
                    found.extend(container.get("env", []))
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(manifests)
    return found


@pytest.mark.slow
def test_a_run_is_scored_by_a_judge_and_counts_what_it_could_not_score(tmp_path, train_yaml, run_trainer, one_thread):
    from astrai.common.contract import METRICS_FILE
    from astrai.common.metrics import MetricsFile
    from astrai.data.pipeline import prepare

    records = tmp_path / "prompts.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"say {n}:"}) + "\n" for n in range(8)), encoding="utf-8")
    prepare(tmp_path / "data", [records], kind="prompts")
    with JudgeServer(score=lambda prompt, completion: float(len(set(completion)))) as server:
        server.behave = [("status", 500)] * 3  # one completion of the first step gets no score: counted, not fatal
        judge = {
            "url": server.url + "/v1/chat/completions",
            "kind": "openai",
            "prompt": TEMPLATE,
            "retries": 2,
            "backoff": 0.01,
            "max_in_flight": 1,
            "on_error": "none",
        }
        path = train_yaml(
            tmp_path / "t.yaml",
            train_type="online_grpo",
            data_root_path=str(tmp_path / "data"),
            ckpt_dir=str(tmp_path / "job"),
            rewards=[judge],
            num_generations=2,
            batch_per_device=2,
            max_completion_length=4,
            max_steps=2,
            log_interval=1,
        )
        run_trainer(path)
    records = MetricsFile(tmp_path / "job" / METRICS_FILE).records()
    assert [record["judge_failures/judge"] for record in records] == [1.0, 0.0]
    assert all(record["reward_judge"] >= 1 for record in records)
    assert len(server.requests) == 2 * 2 * 2 + 2  # 8 completions, one asked three times
