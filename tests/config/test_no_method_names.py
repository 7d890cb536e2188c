"""No method's name in the code that must not know methods.

The config (``posttrain/config/``), the run set-up (``posttrain/run/``) and the update
(``posttrain/learn/update.py``) look entries up by the name a recipe gives and read what the entries
declare (``config/checks.py``); none of them compares a setting with an entry's name. This test parses
them with ``ast`` and fails on any string constant equal to the name of an entry of any registry
(every ``Registry`` in ``posttrain/``, and the built-in tasks), with these exceptions, each documented:

- the names of the advantage-input providers (``prepare/providers.py``): a provider is named by the input
  it provides (``values``, ``external``, ...), which is the key the estimators, the losses and the config
  read by design, not a method;
- a config field's default (the value of a field in a class body: ``advantage: str = "grpo"``,
  ``Field("single_turn", ...)``, ``[RewardSpec(name="task")]``): the config names the entries a recipe
  gets when it names none;
- :data:`ALLOWED`: strings that equal an entry's name by accident, with the reason.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from posttrain.algorithms.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "posttrain"
PHASES = ("produce", "prepare", "learn")  # each binds its entries in <phase>/parts.py, by the names a recipe gives
CHECKED = sorted([*(PACKAGE / "config").glob("*.py"), *(PACKAGE / "run").rglob("*.py"),
                  PACKAGE / "learn" / "update.py", *(PACKAGE / phase / "parts.py" for phase in PHASES)])
INPUT_NAMED = {"advantage-input provider"}  # registries whose entries are named by the input they provide

# (file, string) -> why that string is not a method's name there
ALLOWED = {
    ("posttrain/config/trainers.py", "task"): "dpo.pairs / rm.pairs = 'task': pairs built from the task's "
    "prompts (a Literal choice beside 'file'), not the `task` reward",
    ("posttrain/config/trainers.py", "none"): "rm.debias = 'none' (a Literal choice beside 'odin'), not the "
    "behaviour correction, group filter or batch selector 'none'",
    ("posttrain/config/root.py", "task"): "the kind 'task' in task.name's unknown-name message, not the reward",
}


def _registries() -> dict[str, set[str]]:
    """Every ``Registry`` assigned at module level in ``posttrain/`` (found in the source, read after import),
    by kind, and the built-in tasks.
    """
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        targets = [
            node.targets[0] if isinstance(node, ast.Assign) else node.target
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "Registry"
        ]
        if not targets:
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(
            ".__init__"))
        for target in targets:
            registry = getattr(module, target.id)
            assert isinstance(registry, Registry)
            found.setdefault(registry.kind, set()).update(registry.names())
    from posttrain.tasks import TASKS

    found["task"] = set(TASKS)
    return found


def _field_defaults(tree: ast.AST) -> set[int]:
    """ids of the constants inside the default value of a field of a class (a class-body annotated assignment)."""
    out: set[int] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                value = stmt.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
                    value = value.args[0] if value.args else ast.Constant(None)  # Field(default, description=...)
                out.update(id(n) for n in ast.walk(value) if isinstance(n, ast.Constant))
    return out


def method_names_in(path: Path, names: dict[str, str]) -> list[str]:
    """``file:line: 'name' (kind)`` for every string constant of ``path`` that is a method's name."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    tree = ast.parse(path.read_text())
    defaults = _field_defaults(tree)
    return [
        f"{rel}:{node.lineno}: {node.value!r} ({names[node.value]})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
        and id(node) not in defaults and (rel, node.value) not in ALLOWED
    ]


@pytest.fixture(scope="module")
def method_names() -> dict[str, str]:
    """Each entry name of a registry that names methods -> its registry's kind(s)."""
    kinds: dict[str, list[str]] = {}
    for kind, entries in _registries().items():
        if kind not in INPUT_NAMED:
            for name in entries:
                kinds.setdefault(name, []).append(kind)
    return {name: ", ".join(sorted(k)) for name, k in kinds.items()}


def test_the_registries_are_found(method_names):
    # a registry of each phase and axis is read (a rename that hid them would make the test below vacuous)
    for name, kind in [("single_turn", "rollout driver"), ("rorecomp", "batch selector"), ("drpo", "policy loss"),
                       ("remax", "advantage estimator"), ("par", "reward shaper"), ("aapo", "loss weight"),
                       ("arithmetic", "task")]:
        assert kind in method_names[name]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_method_name_as_a_string(path, method_names):
    found = method_names_in(path, method_names)
    assert not found, "method names in code that reads only what entries declare:\n  " + "\n  ".join(found)


def test_the_check_sees_a_name_it_must_refuse(method_names, tmp_path):
    # the parse finds a comparison with a method's name, and leaves a field's default alone
    probe = tmp_path / "probe.py"
    probe.write_text('class C:\n    driver: str = "single_turn"\n\n\ndef f(c):\n    return c.loss == "drpo"\n')
    assert method_names_in(probe, method_names) == ["probe.py:6: 'drpo' (policy loss)"]
