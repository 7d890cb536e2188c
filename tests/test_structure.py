"""The house's structure, read from the source with ``ast`` (nothing of posttrain is imported).

What ``house.md`` asks of the floor plan, as checks that fail with the offenders named:

- no import circle among ``posttrain`` modules. Every import counts, also one inside a function (a lazy
  import hides a circle, it does not remove it); only ``if TYPE_CHECKING:`` blocks are left out. A
  package's ``__init__`` is the package's module; ``from posttrain.x import y`` with ``y`` a submodule
  imports ``posttrain.x.y``;
- no module over 500 lines, no function or method over 80 lines;
- ``posttrain/train/`` holds the RL loop only;
- a module imports nothing from a floor above its own (``FLOORS``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "posttrain"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
TRAIN_FILES = {"__init__.py", "rl.py", "loop_state.py", "diagnose.py", "prompt_stats.py"}

# Floors, top down: a module may import its own floor and the floors below it, never one above. The phase
# packages stand in house.md's order (train/ -> prepare/ -> learn/ -> produce/, run/ -> config/ -> rewards/ ->
# rollout/ -> envs/ -> models/, tasks/ -> algorithms/, seeds.py, sandbox/); every other top-level name stands
# where what it imports and what imports it put it:
# - cli, demos, compare and docgen drive whole runs or read every registry, and nothing below imports them;
#   ``evaluation.run`` is the ``posttrain eval`` command (it opens a run with run/setup like ``train`` does),
#   so it stands with the commands, not with the rest of evaluation/ (an entry "pkg.module" places one module).
# - api (the Python API: load_config, train, sft, dpo, evaluate) drives whole runs like cli: with the commands.
# - plugins (a recipe's user modules, the register_* decorators) is imported by config/load.py before it
#   validates and by the learner ranks; it registers into rewards/, envs/, tasks/, algorithms/: with config/.
# - trainers/ (sft, dpo, rm, rft, astar_values) are the RL loop's siblings: beside train/.
# - planning/ is the memory plan a run checks before it starts: train/rl.py and cli import it, it reads
#   run/ (build_task), learn/ (LearnParts) and config/: below the loop, above prepare/ and run/.
# - reporting/ (run directories' sinks, progress tables, plots) is imported by run/, train/ and compare; it
#   reads config/ and evaluation/'s metrics: below run/, above evaluation/.
# - evaluation/ samples with an engine, scores with rewards/ and reads the Config: just above config/.
# - data/ reads data sets into tasks with their rewards/ verifiers; config/ imports its spec: between them.
# - diagnostics/ are pure tensor statistics like algorithms/ (and read them): beside algorithms/.
# - serve/ (the OpenAI-compatible server) reads a rollout engine, the chat template and the tool parsers:
#   with rollout/, so that the phases above can serve their policy; ``serve.command`` loads a run's model
#   like ``evaluation.run`` does: with the commands.
# - errors.py, the exception types every floor raises, imports nothing: at the bottom with seeds.py, sandbox/;
#   durable.py (fsync and write-then-rename, for checkpoints, recorded batches and logs) too.
FLOORS: list[set[str]] = [
    {"cli", "api", "demos", "compare", "docgen", "evaluation.run", "serve.command"},
    {"train", "trainers"},
    {"planning"},
    {"prepare"},
    {"learn"},
    {"produce", "run"},
    {"reporting"},
    {"evaluation"},
    {"config", "plugins"},
    {"data"},
    {"rewards"},
    {"rollout", "serve"},
    {"envs"},
    {"models", "tasks"},
    {"algorithms", "diagnostics"},
    {"seeds", "sandbox", "errors", "durable"},
]
# The one way up: the config's generic check (config/checks.py) reads the traits of every entry a run
# chooses, before any model loads, and two registries live on floors above it because their entries are
# the phases' own code: the rollout drivers (produce/) and the batch selectors (prepare/). It imports them
# inside the functions that look them up; neither imports the config back at run time (no circle).
REGISTRY_LOOKUPS = {
    ("posttrain.config.checks", "posttrain.produce.drivers"),
    ("posttrain.config.checks", "posttrain.prepare.selectors"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__`` under the package's name)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``, at any depth, except inside the body of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The posttrain modules that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
            continue
        if node.level:  # relative: from the package that holds this module
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in modules:
                out.add(sub)
            elif target in modules:
                out.add(target)
    out.discard(name)
    return out


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, dep) for dep in _imported(name, path, modules))
    return graph


def _floor_of(module: str) -> tuple[int, str]:
    """The floor of ``module`` and the ``FLOORS`` entry that places it (the longest dotted prefix wins)."""
    rel = module.removeprefix("posttrain.")
    hits = [(len(e), i, e) for i, floor in enumerate(FLOORS) for e in floor if rel == e or rel.startswith(e + ".")]
    if not hits:
        raise AssertionError(f"{module}: no entry of FLOORS places it; add its top-level name where it belongs")
    _, i, entry = max(hits)
    return i, entry


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_no_import_circle() -> None:
    circles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not circles, "import circles among posttrain modules (every import counts, also inside functions):\n" + (
        "\n".join("  " + " <-> ".join(c) for c in sorted(circles))
    )


def test_modules_at_most_500_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _modules().values()}
    over = {p: n for p, n in sorted(sizes.items()) if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in over.items())


def test_functions_at_most_80_lines() -> None:
    over = []
    for path in _modules().values():
        for fn in _functions(ast.parse(path.read_text(), filename=str(path))):
            n = fn.end_lineno - fn.lineno + 1  # the ``def`` line to the last line of the body (decorators apart)
            if n > MAX_FUNCTION_LINES:
                over.append(f"{path.relative_to(ROOT).as_posix()}::{fn.name} ({n})")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(sorted(over))


def test_train_holds_only_the_loop() -> None:
    found = {p.name for p in (PACKAGE / "train").iterdir() if p.name != "__pycache__"}
    assert found == TRAIN_FILES, f"posttrain/train/ holds the RL loop only; extra: {sorted(found - TRAIN_FILES)}"


def test_every_top_level_module_has_a_floor() -> None:
    tops = {m.split(".")[1] for m in _modules() if "." in m}
    placed = {e.split(".")[0] for floor in FLOORS for e in floor}
    assert tops <= placed, f"top-level names without a floor in FLOORS: {sorted(tops - placed)}"


def test_phase_packages_import_only_downward() -> None:
    upward = []
    for a, b in sorted(_graph().edges):
        if "posttrain" in (a, b) or (a, b) in REGISTRY_LOOKUPS:  # the root package stands above every floor
            continue
        (fa, ea), (fb, eb) = _floor_of(a), _floor_of(b)
        if fb < fa:
            upward.append(f"{a} (floor {fa}: {ea}) imports {b} (floor {fb}: {eb})")
    assert not upward, "imports from a floor above (FLOORS, top down):\n  " + "\n  ".join(upward)


def test_the_import_reader_counts_lazy_imports_and_submodules_and_skips_type_checking(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from posttrain.a import b, helper\n"  # b is a submodule, helper a name of posttrain.a
        "if TYPE_CHECKING:\n"
        "    from posttrain.c import C\n"
        "def f():\n"
        "    import posttrain.d\n"  # lazy: still an import
        "    from . import e\n"  # relative to posttrain.x
    )
    modules = dict.fromkeys(["posttrain.a", "posttrain.a.b", "posttrain.c", "posttrain.d", "posttrain.x.e"], path)
    assert _imported("posttrain.x.m", path, modules) == {"posttrain.a", "posttrain.a.b", "posttrain.d", "posttrain.x.e"}
