"""The shape of the package itself: layers that import downward only, no import cycle between its modules, no
function too long to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

import astrai

PACKAGE = Path(astrai.__file__).resolve().parent
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its text (a function's late import counts too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(candidate for candidate in candidates if candidate in modules and candidate != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that reach each other through imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "astrai.host.slurm" in graph["astrai.host.jobs"]  # the walk sees imports at all
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_third_module():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


LAYERS = {
    "astrai.common": {"astrai.common"},
    "astrai.data": {"astrai.common", "astrai.data"},
    "astrai.host": {"astrai.common", "astrai.host"},
    "astrai.trainer": {"astrai.common", "astrai.data", "astrai.trainer"},
}
"""What each layer may import: common (nothing of astrai) < data, host (common) < trainer (common, data) < the
top-level commands (astrai/train.py, model.py, rewards.py), which may import any layer."""


def _layer(module: str) -> str | None:
    """The layer a module belongs to; None for the top-level commands (and the package itself)."""
    return next((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer its own may not import (a higher one, or a sibling)."""
    found = []
    for module, imported in sorted(graph.items()):
        layer = _layer(module)
        if layer is None:
            continue
        for other in sorted(imported):
            if (_layer(other) or other) not in LAYERS[layer]:
                found.append(f"{module} imports {other}")
    return found


def test_layers_import_downward_only():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "astrai.common.contract" in graph["astrai.host.jobs"]  # the walk sees imports between layers at all
    assert upward_imports(graph) == []


def test_an_upward_import_is_found():
    """A planted import of the trainer into common, of host into data, and of the top-level commands into the
    trainer: each is named; a downward one is not."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    graph["astrai.common.config"] = graph["astrai.common.config"] | {"astrai.trainer.objectives.rewards"}
    graph["astrai.data.chat"] = graph["astrai.data.chat"] | {"astrai.host.runtime"}
    graph["astrai.trainer.run.loop"] = graph["astrai.trainer.run.loop"] | {"astrai.train", "astrai.data.chat"}
    assert upward_imports(graph) == [
        "astrai.common.config imports astrai.trainer.objectives.rewards",
        "astrai.data.chat imports astrai.host.runtime",
        "astrai.trainer.run.loop imports astrai.train",
    ]


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({path.name}:{node.lineno}): {lines} lines")
    assert long == []


def test_the_architecture_page_names_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = [
        name
        for name, path in _modules().items()
        if name.count(".") >= 2
        and path.name not in ("__init__.py", "__main__.py")
        and f"`{name.rpartition('.')[2]}`" not in page
        and f"/{name.rpartition('.')[2]}`" not in page
    ]
    assert unnamed == []


REGISTRIES = {"astrai.common.train_types", "astrai.trainer.run.build"}
"""Where a train type's name may be compared with: its two entries (the torch-free one and the trainer's)."""


def _compares_train_type(tree: ast.AST) -> list[int]:
    """Lines that compare a ``train_type`` (a name or an attribute) with a string or a tuple of strings."""

    def names_train_type(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "train_type") or (
            isinstance(node, ast.Attribute) and node.attr == "train_type"
        )

    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(literal(item) for item in node.elts)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names_train_type(side) for side in sides) and any(literal(side) for side in sides):
                found.append(node.lineno)
    return found


def test_a_train_type_is_compared_with_by_name_only_in_the_registries():
    found = {
        name: lines
        for name, path in _modules().items()
        if name not in REGISTRIES and (lines := _compares_train_type(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert found == {}
    assert _compares_train_type(ast.parse("if config.training.train_type == 'dpo': pass")) == [1]
    assert _compares_train_type(ast.parse("x = train_type in ('grpo', 'online_grpo')")) == [1]


def test_every_train_type_has_its_trainer_side_and_an_unknown_one_is_refused_by_name():
    import pytest

    from astrai.common.config import TrainingSection
    from astrai.common.configfile import ConfigError
    from astrai.common.train_types import TRAIN_TYPES
    from astrai.trainer.run.build import TRAINER_TYPES

    assert list(TRAINER_TYPES) == list(TRAIN_TYPES)
    with pytest.raises(ConfigError, match=r"training.train_type: expected seq \| sft \| dpo .*got 'ppo'"):
        TrainingSection(train_type="ppo")


def _string_literals(tree: ast.AST) -> dict[str, int]:
    """Every string constant of a module but its docstrings, with a line where it appears."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
        # An attribute's docstring: a string statement right after an assignment.
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            for statement in statements if isinstance(statements, list) else []:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                    docstrings.add(id(statement.value))
    return {
        node.value: node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def test_a_familys_model_type_is_named_only_in_its_spec():
    from astrai.common.families import MODEL_TYPES
    from astrai.data.tool_calls import FORMATS

    # A tool-call format is named after the templates that write it (Mistral's), not after a model_type.
    formats = {"astrai.data.tool_calls": {tool_format.name for tool_format in FORMATS}}
    found = {}
    for name, path in _modules().items():
        if name.startswith("astrai.common.families"):
            continue
        literals = _string_literals(ast.parse(path.read_text(encoding="utf-8")))
        named = sorted(set(literals) & set(MODEL_TYPES) - formats.get(name, set()))
        if named:
            found[name] = {model_type: literals[model_type] for model_type in named}
    assert found == {}
    assert _string_literals(ast.parse('"""mixtral"""\nx = "mixtral"')) == {"mixtral": 2}


BACKEND_MODULES = {"astrai.common.backends", "astrai.trainer.models.backend"}
"""Where the backend (native or transformers) is told from a model's config: nowhere else asks."""


def _config_isinstance(tree: ast.AST) -> list[int]:
    """Lines calling isinstance(..., TransformersConfig or ModelConfig)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            classes = node.args[1] if len(node.args) == 2 else None
            names = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            if any(isinstance(n, ast.Name) and n.id in ("TransformersConfig", "ModelConfig") for n in names):
                lines.append(node.lineno)
    return lines


def test_a_models_backend_is_told_from_its_config_only_in_the_backend_modules():
    found = {}
    for name, path in _modules().items():
        if name not in BACKEND_MODULES:
            lines = _config_isinstance(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[name] = lines
    assert found == {}
    assert _config_isinstance(ast.parse("isinstance(c, (int, TransformersConfig))\nisinstance(c, ModelConfig)")) == [
        1,
        2,
    ]


TRAINER = "astrai.trainer"
TRAINER_GROUPS = ("launch", "feed", "models", "generation", "checkpoint", "objectives", "run")
"""The trainer's groups, by lifetime, each importing only those before it: the process's start (launch), what the
loader feeds (feed), the model (models), sampling from it (generation), its checkpoints, what a step optimises
(objectives), and one training run (run)."""
MAX_TRAINER_TOP_LEVEL = 8
MODEL_CLI = "astrai.trainer.generation.cli"


def _trainer_group(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["astrai", "trainer"] or len(parts) < 3:
        return None
    return "launch" if parts[2] == "entrypoint" else parts[2]  # the entrypoint's old name, kept for images


def trainer_group_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a trainer group from one after it (or from an unknown group)."""
    found = []
    for module, imported in sorted(graph.items()):
        group = _trainer_group(module)
        if group is None:
            continue
        for other in sorted(imported):
            theirs = _trainer_group(other)
            if theirs is None or theirs == group:
                continue
            if group not in TRAINER_GROUPS or theirs not in TRAINER_GROUPS:
                found.append(f"{module} imports {other} (a module outside the groups)")
            elif TRAINER_GROUPS.index(theirs) > TRAINER_GROUPS.index(group):
                found.append(f"{module} ({group}) imports {other} ({theirs})")
    return found


def test_the_trainer_is_grouped_by_lifetime_and_its_groups_import_earlier_ones_only():
    top = sorted(p.name for p in (PACKAGE / "trainer").iterdir() if p.name != "__init__.py" and p.name != "__pycache__")
    assert len(top) <= MAX_TRAINER_TOP_LEVEL, top
    assert {name for name in top if (PACKAGE / "trainer" / name).is_dir()} == set(TRAINER_GROUPS)
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert trainer_group_violations(graph) == []
    planted = {**graph, "astrai.trainer.models.native": {"astrai.trainer.run.loop", "astrai.trainer.launch.signals"}}
    assert trainer_group_violations(planted) == [
        "astrai.trainer.models.native (models) imports astrai.trainer.run.loop (run)"
    ]


def test_the_entrypoint_imports_no_torch():
    import subprocess
    import sys

    probe = "import sys, astrai.trainer.entrypoint; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def _defines_model_cli(tree: ast.AST) -> list[int]:
    """Lines building the ``python -m astrai.model`` parser or one of its subcommands."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        prog = [k.value for k in node.keywords if k.arg == "prog" and isinstance(k.value, ast.Constant)]
        if prog and str(prog[0].value).startswith("python -m astrai.model"):
            lines.append(node.lineno)
        is_add_parser = isinstance(node.func, ast.Attribute) and node.func.attr == "add_parser"
        first = node.args[0] if node.args else None
        if is_add_parser and isinstance(first, ast.Constant) and first.value in ("init", "generate", "check"):
            lines.append(node.lineno)
    return lines


def test_the_model_cli_is_defined_in_its_folder_only():
    found = {}
    for name, path in _modules().items():
        if not name.startswith(MODEL_CLI.rpartition(".")[0]):
            lines = _defines_model_cli(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[name] = lines
    assert found == {}
    assert _defines_model_cli(ast.parse(MODEL_CLI_PATH.read_text(encoding="utf-8")))


MODEL_CLI_PATH = PACKAGE / "trainer" / "generation" / "cli.py"
