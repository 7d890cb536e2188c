"""The selection package's docstring is its map: it must name every module, and what it says about
where the loop uses each function must point at files and drivers that exist (issue 38, D12: the old
docstring omitted two modules, named a moved config key and called online code library-only).
"""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.algorithms import selection
from posttrain.produce.drivers.registry import DRIVERS

ROOT = Path(__file__).resolve().parents[2]
PKG = Path(selection.__file__).parent
DOC = selection.__doc__ or ""


def test_every_module_of_the_package_is_listed() -> None:
    # one "- ``module``:" bullet per file; the old text lacked entropy_tokens and selectors
    listed = set(re.findall(r"^- ``(\w+)``:", DOC, flags=re.M))
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert modules - listed == set(), f"modules missing from selection's docstring: {sorted(modules - listed)}"
    assert listed - modules == set(), f"docstring lists modules that do not exist: {sorted(listed - modules)}"


def test_every_path_named_exists() -> None:
    paths = set(re.findall(r"posttrain/[\w/]+\.py", DOC))
    assert paths, "the docstring should say where the loop uses these functions"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == [], f"selection's docstring names files that do not exist: {missing}"


def test_drivers_named_are_registered_and_no_moved_key() -> None:
    drivers = set(re.findall(r'rollout\.driver = "(\w+)"', DOC)) | set(re.findall(r"``(\w+)`` rollout driver", DOC))
    assert drivers, "HINT's re-roll and ReST-GRPO's prefixes run as rollout drivers; the docstring should say so"
    assert drivers <= set(DRIVERS.names()), f"unknown drivers named: {sorted(drivers - set(DRIVERS.names()))}"
    # rollout.hint_reroll moved to rollout.driver (config/moved.py); the old docstring still named it
    assert "rollout.hint_reroll" not in DOC


def test_library_only_names_are_not_called_by_the_loop() -> None:
    # what the docstring calls library-only must not be used anywhere in the package outside selection/
    m = re.search(r"((?:``\w+``(?:,| and) )*``\w+``) (?:is|are) library-only", DOC)
    assert m, "the docstring should say which functions the loop does not use"
    names = re.findall(r"``(\w+)``", m.group(1))
    users = {
        name: [str(p.relative_to(ROOT)) for p in (ROOT / "posttrain").rglob("*.py")
               if PKG not in p.parents and re.search(rf"\b{name}\b", p.read_text())]
        for name in names
    }
    assert all(not u for u in users.values()), f"called library-only but used by the loop: {users}"
