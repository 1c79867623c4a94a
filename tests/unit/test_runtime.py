"""The runtime: block: what a user sees for good and bad train.yaml files."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_cases import MALFORMED, SEED, SEED_YAML, mutated

from astrai.common.configfile import ConfigError, load_yaml
from astrai.common.contract import TORCH_CUDA_TAGS
from astrai.host import runtime as rt
from astrai.host.runtime import SchemaError, load_job_config, parse_duration, resolve_runtime
from tests.support import REPO


def _write(folder: Path, text: str, name: str = "train.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def _rejection(tmp_path: Path, doc: dict) -> tuple[Path, list[str]]:
    path = _write(tmp_path, yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as caught:
        resolve_runtime(path)
    return path, caught.value.messages


def _message_at(messages: list[str], path: Path, key: str) -> str:
    found = [line for line in messages if line.startswith(f"{path}: {key}: ")]
    assert found, f"no message for {key}; got:\n" + "\n".join(messages)
    return found[0]


@pytest.mark.parametrize(("changes", "key", "text"), [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_runtime_names_the_key(tmp_path, changes, key, text):
    path, messages = _rejection(tmp_path, mutated(changes))
    assert text in _message_at(messages, path, key)


def test_every_problem_is_reported_at_once_sorted_by_path(tmp_path):
    doc = mutated(
        {
            "runtime.job_name": "-x",
            "runtime.gpu.devices": [0],
            "runtime.gpu.parallel_mode": "ddp",
            "runtime.container.ipc": "hots",
            "runtime.container.stop_timout_seconds": 1,
            "runtime.environment": {"ASTRAI_X": "1"},
            "trainig": {},
        }
    )
    path, messages = _rejection(tmp_path, doc)
    keys = [line[len(f"{path}: ") :].split(": ", 1)[0] for line in messages]
    assert keys == [
        "runtime.container.ipc",
        "runtime.container.stop_timout_seconds",
        "runtime.environment.ASTRAI_X",
        "runtime.gpu.parallel_mode",
        "runtime.job_name",
        "trainig",
    ]
    assert str(ConfigError(messages)) == "\n".join(messages)


def test_rules_skip_keys_that_failed_the_schema(tmp_path):
    doc = mutated(
        {
            "runtime.gpu.devices": "al",
            "runtime.gpu.parallel_mode": "ddp",
            "runtime.container.stop_grace_period": "soon",
            "runtime.container.cuda_tag": "cpu",
        }
    )
    path, messages = _rejection(tmp_path, doc)
    assert [line.split(": ")[1] for line in messages] == ["runtime.container.stop_grace_period", "runtime.gpu.devices"]


def test_trainer_sections_are_not_validated_here(tmp_path):
    doc = mutated({"model": {"anything": [1, 2]}, "training": "not even a mapping"})
    path = _write(tmp_path, yaml.safe_dump(doc))
    assert rt.validate_config(yaml.safe_load(path.read_text()), path) == []
    loaded, _ = load_job_config(path)
    assert rt.trainer_value(loaded, "model", "anything") == [1, 2]
    assert rt.trainer_value(loaded, "training", "max_steps", 7) == 7
    assert rt.trainer_value(loaded, "data", "data_root_path") is None


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = _write(tmp_path, "runtime:\n  gpu:\n    devices: [0, 1\n  job_name: x\n")
    with pytest.raises(ConfigError) as caught:
        resolve_runtime(path)
    [message] = caught.value.messages
    assert message.startswith(f"{path}:4:") and "YAML syntax error" in message and "started on line 3" in message


def test_duplicate_key_is_an_error_not_a_silent_overwrite(tmp_path):
    path = _write(tmp_path, "runtime:\n  gpu:\n    devices: [0]\n    devices: all\n")
    with pytest.raises(ConfigError) as caught:
        resolve_runtime(path)
    assert caught.value.messages == [f"{path}:4:5: YAML syntax error: duplicate key 'devices' (first on line 3)"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        resolve_runtime(path)
    assert caught.value.messages == [f"{path}: file not found (pass --config FILE)"]


@pytest.mark.parametrize("text", ["- runtime\n", "just words\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_yaml(path)


def test_an_empty_file_lacks_the_runtime_block(tmp_path):
    path = _write(tmp_path, "")
    with pytest.raises(ConfigError, match="runtime: missing: the file needs a runtime: block"):
        resolve_runtime(path)


def test_paths_resolve_from_the_yaml_folder_not_the_working_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    doc = mutated({"runtime.paths": {"data": "../shared/data", "model": "/abs/model", "checkpoints": "~/ckpt"}})
    _write(tmp_path / "jobs", yaml.safe_dump(doc))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    runtime = resolve_runtime("../jobs/train.yaml")
    assert runtime.config_path == tmp_path / "jobs" / "train.yaml"
    assert runtime.data_dir == tmp_path / "shared" / "data"
    assert runtime.model_dir == Path("/abs/model")
    assert runtime.checkpoints_dir == home / "ckpt"
    assert runtime.job_dir == home / "ckpt" / "astrai-train"


def test_resolving_creates_nothing_on_disk(tmp_path):
    path = _write(tmp_path, SEED_YAML)
    before = sorted(tmp_path.rglob("*"))
    resolve_runtime(path)
    assert sorted(tmp_path.rglob("*")) == before


def test_seed_block_resolves(tmp_path):
    path = _write(tmp_path, SEED_YAML)
    assert rt.validate_config(yaml.safe_load(SEED_YAML), path) == []
    assert resolve_runtime(path) == rt.Runtime(
        config_path=path,
        job_name="astrai-train",
        data_dir=tmp_path / "data",
        model_dir=tmp_path / "params",
        checkpoints_dir=tmp_path / "checkpoints",
        job_dir=tmp_path / "checkpoints" / "astrai-train",
        devices="all",
        processes=None,
        parallel_mode="auto",
        cuda_visible_devices=None,
        cuda_tag="cu128",
        base_image=None,
        ipc="host",
        stop_grace_period="10m",
        stop_grace_seconds=600,
        stop_timeout_seconds=600,
        checkpoint_keep_last=5,
        max_duration_hours=12.0,
        environment={"NCCL_P2P_DISABLE": "1"},
    )


def test_empty_runtime_block_takes_the_seed_defaults(tmp_path):
    seed = resolve_runtime(_write(tmp_path / "a", SEED_YAML))
    empty = resolve_runtime(_write(tmp_path / "b", "runtime: {}\n"))
    assert empty.environment == {} and empty.max_duration_hours is None
    differing = {
        "config_path",
        "data_dir",
        "model_dir",
        "checkpoints_dir",
        "job_dir",
        "environment",
        "max_duration_hours",
    }
    assert {k: v for k, v in vars(empty).items() if k not in differing} == {
        k: v for k, v in vars(seed).items() if k not in differing
    }


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("10m", 600),
        ("1h", 3600),
        ("1h30m", 5400),
        ("1h30m15s", 5415),
        ("2m5s", 125),
        ("1h15s", 3615),
        ("90m", 5400),
        ("0h1s", 1),
    ],
)
def test_parse_duration_accepts(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "10",
        "m",
        "10 m",
        "1m30",
        "30s1m",
        "1d",
        "1.5h",
        "-5m",
        "10M",
        "1h 30m",
        " 10m",
        "10m\n",
        "０1m",
        "0s",
        "0h0m0s",
        None,
        600,
    ],
)
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("gpu", "devices", "processes", "mode", "visible"),
    [
        ({"devices": "all"}, "all", None, "auto", None),
        ({"devices": "all", "parallel_mode": "fsdp"}, "all", None, "fsdp", None),
        ({"devices": "all", "parallel_mode": "none"}, "all", None, "none", None),
        ({"devices": [0]}, (0,), 1, "none", "0"),
        ({"devices": [0, 1]}, (0, 1), 2, "ddp", "0,1"),
        ({"devices": [3, 1], "parallel_mode": "fsdp"}, (3, 1), 2, "fsdp", "3,1"),
        ({"devices": [2], "parallel_mode": "none"}, (2,), 1, "none", "2"),
        ({"devices": "none"}, "none", 1, "none", ""),
        ({"devices": "none", "processes": 4}, "none", 4, "ddp", ""),
        ({"devices": "none", "processes": 2, "parallel_mode": "fsdp"}, "none", 2, "fsdp", ""),
        ({"devices": "none", "processes": 1, "parallel_mode": "none"}, "none", 1, "none", ""),
    ],
)
def test_device_resolution(tmp_path, gpu, devices, processes, mode, visible):
    runtime = resolve_runtime(_write(tmp_path, yaml.safe_dump({"runtime": {"gpu": gpu}})))
    assert (runtime.devices, runtime.processes, runtime.parallel_mode, runtime.cuda_visible_devices) == (
        devices,
        processes,
        mode,
        visible,
    )
    assert runtime.uses_gpu == (devices != "none")


def test_environment_values_become_strings(tmp_path):
    text = "runtime:\n  environment: {A: '1', B: 1, C: 2.5, D: true, E: false, F: text, G: ''}\n"
    runtime = resolve_runtime(_write(tmp_path, text))
    assert runtime.environment == {"A": "1", "B": "1", "C": "2.5", "D": "true", "E": "false", "F": "text", "G": ""}


def test_a_null_environment_value_means_pass_through_from_the_shell(tmp_path):
    runtime = resolve_runtime(_write(tmp_path, "runtime:\n  environment:\n    HF_TOKEN: null\n    B: ~\n"))
    assert runtime.environment == {"HF_TOKEN": None, "B": None}


def test_schema_cuda_tags_are_the_builds_of_the_tested_torch():
    schema = json.loads(rt.SCHEMA_PATH.read_text())
    cuda_tag = schema["properties"]["container"]["properties"]["cuda_tag"]
    assert tuple(cuda_tag["enum"]) == TORCH_CUDA_TAGS and cuda_tag["default"] in TORCH_CUDA_TAGS


def test_schema_is_valid_and_documents_every_property():
    schema = json.loads(rt.SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)

    def properties(node, prefix=""):
        for name, rule in node.get("properties", {}).items():
            yield prefix + name, rule
            yield from properties(rule, prefix + name + ".")

    for name, rule in properties(schema):
        assert rule.get("description"), f"{name} has no description"
        assert "default" in rule, f"{name} has no default"


@pytest.mark.parametrize("value", [True, False])
def test_schema_integers_reject_booleans(value):
    validator = jsonschema.Draft202012Validator(json.loads(rt.SCHEMA_PATH.read_text()))
    assert not validator.is_valid({"container": {"stop_timeout_seconds": value}})
    assert not validator.is_valid({"gpu": {"devices": [value]}})


@pytest.mark.parametrize("content", ["{not json", '{"type": 5}', "[]", None])
def test_broken_schema_is_not_reported_as_a_config_error(tmp_path, monkeypatch, content):
    schema = tmp_path / "runtime.schema.json"
    if content is not None:
        schema.write_text(content)
    monkeypatch.setattr(rt, "SCHEMA_PATH", schema)
    path = _write(tmp_path, SEED_YAML)
    with pytest.raises(SchemaError, match="runtime schema") as caught:
        resolve_runtime(path)
    assert not isinstance(caught.value, ConfigError)


def test_imports_without_torch_or_invoke():
    code = textwrap.dedent("""
        import sys

        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "invoke"):
                    raise ImportError("blocked " + name)
                return None

        sys.meta_path.insert(0, Blocker())
        import astrai.host.runtime
        print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "invoke")))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# Property test: a valid block with random breakage is always rejected, with a key under runtime.
# A breakage is (section, key, value): set runtime[section][key] (runtime[key] when section is "").
LEAVES = [
    ("", "job_name"),
    ("paths", "data"),
    ("paths", "model"),
    ("paths", "checkpoints"),
    ("gpu", "devices"),
    ("gpu", "parallel_mode"),
    ("container", "cuda_tag"),
    ("container", "ipc"),
    ("container", "stop_grace_period"),
    ("container", "stop_timeout_seconds"),
    ("container", "checkpoint_keep_last"),
    ("container", "max_duration_hours"),
    ("container", "base_image"),
    ("environment", "NCCL_P2P_DISABLE"),
]
INTEGER_LEAVES = [("container", "stop_timeout_seconds"), ("container", "checkpoint_keep_last")]
ALLOWED_KEYS = {
    "": ["job_name", "paths", "gpu", "container", "environment"],
    "paths": ["data", "model", "checkpoints"],
    "gpu": ["devices", "processes", "parallel_mode"],
    "container": [
        "cuda_tag",
        "base_image",
        "ipc",
        "stop_grace_period",
        "stop_timeout_seconds",
        "checkpoint_keep_last",
        "max_duration_hours",
    ],
}
_mappings = st.dictionaries(st.text(min_size=1), st.integers(), min_size=1)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text())


def _wrong_values(leaf: tuple[str, str]):
    """Values the schema must reject at ``leaf``."""
    choices = [_mappings, st.lists(_mappings, min_size=1)]
    if leaf[0] != "environment":
        choices.append(st.booleans())
    if leaf in INTEGER_LEAVES:
        fractions = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer())
        choices += [st.text(), st.integers(max_value=0), fractions]
    return st.one_of(choices)


def _unknown_keys(section: str):
    keys = st.text(min_size=1).filter(lambda key: key not in ALLOWED_KEYS[section])
    return st.tuples(st.just(section), keys, _scalars)


_breakage = st.one_of(
    st.sampled_from(LEAVES).flatmap(lambda leaf: st.tuples(st.just(leaf[0]), st.just(leaf[1]), _wrong_values(leaf))),
    st.tuples(
        st.just(""),
        st.sampled_from(["paths", "gpu", "container", "environment"]),
        st.one_of(st.text(), st.integers(), st.lists(st.integers()), st.none(), st.booleans()),
    ),
    st.sampled_from(sorted(ALLOWED_KEYS)).flatmap(_unknown_keys),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_breakage, min_size=1, max_size=4))
def test_random_breakage_is_always_rejected_under_runtime(breakages):
    runtime = copy.deepcopy(SEED["runtime"])
    last_applied = None
    for section, key, value in breakages:
        node = runtime.get(section) if section else runtime
        if isinstance(node, dict):
            node[key] = value
            last_applied = ".".join(["runtime", section, key] if section else ["runtime", key])
    if last_applied is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        path = _write(Path(folder), yaml.safe_dump({"runtime": runtime}))
        with pytest.raises(ConfigError) as caught:
            resolve_runtime(path)
    messages = caught.value.messages
    assert all(line.startswith(f"{path}: runtime") for line in messages), messages
    assert any(line.startswith(f"{path}: {last_applied}: ") for line in messages), (last_applied, messages)


def test_node_must_be_one_of_the_jobs_nodes(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"runtime": {"nodes": {"count": 2, "rendezvous": "node0:29500"}}}))
    assert resolve_runtime(path, 1).node == 1
    with pytest.raises(ConfigError, match="--node: 2 is not a node of this job; runtime.nodes.count is 2"):
        resolve_runtime(path, 2)
    one = tmp_path / "one.yaml"
    one.write_text("runtime: {}\n")
    with pytest.raises(ConfigError, match="--node takes 0"):
        resolve_runtime(one, 1)


def test_two_nodes_of_one_process_each_run_ddp(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        yaml.safe_dump({"runtime": {"gpu": {"devices": "none"}, "nodes": {"count": 2, "rendezvous": "node0:29500"}}})
    )
    runtime = resolve_runtime(path)
    assert (runtime.parallel_mode, runtime.world_size, runtime.multi_node) == ("ddp", 2, True)


def test_the_commands_it_suggests_can_be_pasted_into_a_shell(tmp_path):
    folder = tmp_path / "my job's $HOME é"
    path = _write(folder, "runtime:\n  job_name: x\n", name="train 1.yaml")
    _, runtime = load_job_config(path)
    command = runtime.command("logs")
    words = subprocess.run(
        ["sh", "-c", f"for word in {command}; do printf '%s\\n' \"$word\"; done"], capture_output=True, text=True
    ).stdout.splitlines()
    assert words == ["invoke", "logs", "--config", str(path)]
    path.write_text(yaml.safe_dump({"runtime": {"nodes": {"count": 2, "rendezvous": "node0:29500"}}}))
    _, second = load_job_config(path, node=1)
    assert second.command("stop").endswith(" --node 1")
