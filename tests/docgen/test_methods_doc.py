"""docs/methods.md is current, and every method is traceable to a test and a paper (or is a marked baseline)."""

from pathlib import Path

import pytest

from posttrain.docgen.catalog import REGISTRIES
from posttrain.docgen.methods_doc import BASELINES, REGENERATE, covering_tests, has_paper, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
# Kinds whose every entry must cite a test and a paper. Selectors and rewards are listed in the
# page too but are not methods from papers in the same sense (`none`, `task`, `code`, ...).
CHECKED = ("advantage", "loss", "aggregation", "kl", "entropy", "loss_weight", "shaper", "preference",
           "parameterization")


@pytest.fixture(scope="module")
def page() -> str:
    return render()


def test_docs_methods_md_is_current(page):
    assert DOC.read_text() == page, f"docs/methods.md is stale: run `{REGENERATE}`"


def test_every_method_has_a_test_and_a_paper_or_is_a_marked_baseline():
    no_test, no_paper = [], []
    for kind in CHECKED:
        reg = REGISTRIES[kind]
        for name in reg.names():
            if not covering_tests(kind, name, reg.get(name)):
                no_test.append(f"{kind}:{name}")
            if not has_paper(reg.doc(name)) and (kind, name) not in BASELINES:
                no_paper.append(f"{kind}:{name}")
    assert not no_test, f"entries no test file names (quote the registry name in a test): {no_test}"
    assert not no_paper, (
        f"entries whose docstring cites no arXiv id or papers/FILE:LINE: {no_paper}; "
        "cite the paper, or add the entry to posttrain.docgen.methods_doc.BASELINES with the reason"
    )


def test_baselines_list_is_small_and_not_stale():
    # Each baseline exists and really cites no paper; a baseline that gains a citation leaves the list.
    assert len(BASELINES) <= 9  # the 8 defaults and verl modes, plus the plain parameterization
    for kind, name in BASELINES:
        reg = REGISTRIES[kind]
        assert name in reg, f"BASELINES names {kind}:{name}, which is not registered"
        assert not has_paper(reg.doc(name)), f"{kind}:{name} cites a paper now; drop it from BASELINES"


def _row(page: str, section: str, name: str) -> str:
    body = page.split(f"(`{section}` registry", 1)[1].split("\n## ", 1)[0]
    return next(line for line in body.splitlines() if line.startswith(f"| `{name}` |"))


def test_hand_checked_rows(page):
    grpo = _row(page, "advantage", "grpo").split(" | ")
    assert grpo[1] == '`algorithm.advantage = "grpo"`'
    assert grpo[2] == "`posttrain/algorithms/advantages/group.py::grpo`"
    assert "`tests/algorithms/test_advantages.py`" in grpo[3]
    assert "arXiv:2402.03300" in grpo[4]  # DeepSeekMath
    assert "`grpo.toml`" in grpo[5]

    keep_all = _row(page, "group_filter", "none").split(" | ")  # registry name differs from the function's
    assert keep_all[1] == '`algorithm.group_filter = "none"`'
    assert keep_all[2] == "`posttrain/algorithms/selection/filters.py::keep_all`"
    assert "`tests/algorithms/test_selection.py`" in keep_all[3]
    assert keep_all[4].startswith("baseline:")

    dpo = _row(page, "preference", "dpo").split(" | ")
    assert dpo[1] == '`dpo.loss = "dpo"`' and "arXiv:2305.18290" in dpo[4] and "`dpo.toml`" in dpo[5]
