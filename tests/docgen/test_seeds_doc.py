"""docs/seeds.md is current, names only entries and recipes that exist, and gives each seed row an entry or a reason.

The seed catalog lives outside the repository (../shared); only the last test reads it, and only where it is.
"""

import re
from pathlib import Path

import pytest

from posttrain.docgen import seeds_doc
from posttrain.docgen.seeds_doc import NOTES, REGENERATE, ROWS, STATUSES, kinds, part, render, seed_lines, table_rows

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "seeds.md"


@pytest.fixture(scope="module")
def page() -> str:
    return render()


def _table(text: str) -> dict[str, list[str]]:
    """Seed line -> the row's cells (seed, method, status, entries, recipes, why) of a rendered page."""
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return {cells[0].strip("| `"): cells for cells in rows}


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_docs_seeds_md_is_current(page):
    assert DOC.read_text() == page, f"docs/seeds.md is stale: run `{REGENERATE}`"


def test_one_row_per_catalog_method_row(page):
    lines = [line for line, _, _ in ROWS]
    assert len(lines) == len(set(lines)) == 79  # the catalog's category-(a) rows (issue 37)
    assert list(_table(page)) == lines
    assert set(NOTES) <= set(lines), f"NOTES names rows the catalog does not have: {set(NOTES) - set(lines)}"


def test_every_entry_part_recipe_and_path_the_page_names_exists(page):
    registries = kinds()
    for line, cells in _table(page).items():
        for item in _ticked(cells[3]):
            if ":" in item:
                kind, name = item.split(":", 1)
                assert name in registries[kind], f"{line}: the {kind} registry has no entry {name!r}"
            else:
                part(item)  # raises when the part is gone
        for recipe in _ticked(cells[4]):
            assert (ROOT / recipe).is_file(), f"{line}: {recipe} does not exist"
        for path in (p for p in _ticked(cells[5]) if "/" in p):
            assert (ROOT / path).exists(), f"{line}: its reason names {path}, which does not exist"


def test_every_row_has_an_entry_or_a_reason_and_no_note_is_stale():
    for row in table_rows():
        assert row.status in STATUSES, f"{row.line} ({row.name}): no entry cites it and NOTES gives no reason"
        if row.status in ("not built", "blocked", "withdrawn"):
            assert not row.entries, (f"{row.line} ({row.name}) is marked {row.status!r} in NOTES but {row.entries} "
                                     "cite it: drop its note, or mark it partial with what is missing")
        if row.status != "loop":
            assert row.why, f"{row.line}: a {row.status!r} row needs its reason"


def test_a_row_whose_entry_disappears_fails(monkeypatch):
    # A-LoL's only entry (a policy loss): without it the row has neither an entry nor a reason. The name is read
    # from the row, not quoted, so that docs/methods.md does not list this file among the loss's tests.
    (entry,) = seeds_doc.entries_by_line()["004:31"]
    kind, name = entry.split(":")
    reg = kinds()[kind]
    assert kind == "loss" and "004:31" in seed_lines(reg.doc(name)) and "004:31" not in NOTES
    monkeypatch.delitem(reg._entries, name)
    seeds_doc.entries_by_line.cache_clear()
    seeds_doc.recipes_by_line.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"004:31 \(A-LoL"):
            render()
    finally:
        monkeypatch.undo()
        seeds_doc.entries_by_line.cache_clear()
        seeds_doc.recipes_by_line.cache_clear()


def test_hand_checked_rows(page):
    rows = _table(page)
    a_lol = rows["004:31"]
    assert a_lol[2] == "`loop`" and "`loss:a_lol`" in a_lol[3] and "`recipes/a_lol.toml`" in a_lol[4]
    hint = rows["000:3"]  # a driver and a loss weight: registries beyond the algorithm ones
    assert "`driver:hint_reroll`" in hint[3] and "`loss_weight:aapo`" in hint[3] and "`recipes/hint.toml`" in hint[4]
    assert rows["004:189"][2] == "`withdrawn`" and rows["004:189"][3] == "—"  # LamPO
    assert rows["004:231"][3] == "`posttrain.trainers.rft.rft`" and "`recipes/rft.toml`" in rows["004:231"][4]
    assert rows["004:3"][2] == "`partial`" and rows["004:3"][3] == "—"  # VERL: diagnostics only
    n = {s: sum(r.status == s for r in table_rows()) for s in STATUSES}
    assert f"79 rows: {n['loop']} loop, {n['partial']} partial," in page


def test_seed_lines_reads_both_citation_forms():
    text = "seed ``papers/004_f298e9ec572f7f27.txt:31``; 000_99b2b1db2eead048.txt: 9; catalog L185; 004:45"
    assert seed_lines(text) == {"004:31", "000:9"}


@pytest.mark.skipif(not seeds_doc.CATALOG.is_dir(), reason="the seed catalog (../shared/methods) is not here")
def test_rows_match_the_catalog():
    assert tuple(seeds_doc.rows_from_catalog()) == ROWS, f"the catalog changed: `{REGENERATE}` prints the new ROWS"
