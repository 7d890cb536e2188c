"""The HTML report: structure (parsed with html.parser), embedded images, escaping, groups, missing files."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from posttrain.reporting.report import RunDirError, load_run, write_report

from .conftest import SCRIPT

SECTIONS = ["runs", "config", "curves", "pass-at-k", "calibration", "samples", "metrics"]


class Page(HTMLParser):
    """Sections, images, tables (rows of cell texts, with the row class) and every tag of a page."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.sections: list[str] = []
        self.images: list[dict] = []
        self.tables: list[dict] = []  # {"class", "section", "rows": [(tr class, [cell text])]}
        self.missing: list[str] = []  # texts of p.missing
        self._section = ""
        self._cell: list[str] | None = None
        self._missing: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "section":
            self._section = a.get("id", "")
            self.sections.append(self._section)
        elif tag == "img":
            self.images.append({**a, "section": self._section})
        elif tag == "table":
            self.tables.append({"class": a.get("class"), "section": self._section, "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append((a.get("class"), []))
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "p" and a.get("class") == "missing":
            self._missing = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1]["rows"][-1][1].append("".join(self._cell))
            self._cell = None
        elif tag == "p" and self._missing is not None:
            self.missing.append("".join(self._missing))
            self._missing = None

    def handle_data(self, data: str) -> None:
        for buf in (self._cell, self._missing):
            if buf is not None:
                buf.append(data)

    def table(self, cls: str, section: str | None = None) -> list[dict]:
        return [t for t in self.tables if t["class"] == cls and section in (None, t["section"])]


@pytest.fixture(scope="module")
def page(group_report: Path) -> Page:
    return Page(group_report.read_text())


def test_sections_and_self_contained(page: Page):
    assert page.sections == SECTIONS
    tags = {t for t, _ in page.tags}
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    urls = [v for _, a in page.tags for k, v in a.items() if k in ("src", "href") and v]
    assert urls and all(u.startswith("data:image/png;base64,") for u in urls)


def test_images_are_pngs(page: Page):
    by_section = {s: [i for i in page.images if i["section"] == s] for s in SECTIONS}
    # key curves, pass@k, calibration (the hand run has confidences), one per metric group
    assert len(by_section["curves"]) == 1 and len(by_section["pass-at-k"]) == 1
    assert len(by_section["calibration"]) == 1
    alts = {i["alt"] for i in by_section["metrics"]}
    assert {"main metrics", "reward metrics", "policy metrics", "eval metrics", "time metrics"} <= alts
    for img in page.images:
        assert img["class"] == "plot" and img["alt"]
        png = base64.b64decode(img["src"].removeprefix("data:image/png;base64,"), validate=True)
        im = Image.open(io.BytesIO(png))
        assert im.format == "PNG" and im.width > 300 and im.height > 200


def test_runs_table_lists_every_run_with_its_group(page: Page, report_runs):
    (table,) = page.table("runs")
    header, *rows = table["rows"]
    assert header[1][:2] == ["run", "group"]
    got = {cells[0]: cells[1] for _, cells in rows}
    assert got == {"hand": "", "grpo-s0": "grpo", "grpo-s1": "grpo", "rloo-s0": "rloo", "rloo-s1": "rloo"}
    method = {cells[0]: cells[2] for _, cells in rows}
    assert method["rloo-s0"] == "rloo / ppo_clip" and method["hand"] == "grpo / ppo_clip"


def test_config_is_collapsible_toml(page: Page, group_report: Path):
    details = [a for t, a in page.tags if t == "details" and a.get("class") == "config"]
    assert len(details) == 5
    assert "[algorithm]" in group_report.read_text()


def test_pass_at_k_mean_and_spread_per_group(page: Page, report_runs):
    (table,) = page.table("pass-at-k")
    header, *rows = table["rows"]
    assert header[1] == ["run / group", "metric", "k=1", "k=2", "runs", "source"]
    cells = {(c[0], c[1]): c for _, c in rows}
    assert set(cells) == {(s, m) for s in ("grpo", "rloo", "hand") for m in ("pass@k", "maj@k")}
    # the hand run's eval.json wins over its summary.json (which has pass@4 but no pass@2)
    assert cells["hand", "pass@k"][2:] == ["0.500", "1.000", "1", "eval.json"]
    # a group: mean [min, max] over its two seeds; seed 1 is seed 0 shifted by 0.25 (capped at 1)
    p0 = json.loads((report_runs["grpo"][0] / "summary.json").read_text())["final"]["pass@1"]
    p1 = min(p0 + 0.25, 1.0)
    assert cells["grpo", "pass@k"][2] == f"{(p0 + p1) / 2:.3f} [{p0:.3f}, {p1:.3f}]"
    assert cells["grpo", "pass@k"][4:] == ["2", "summary.json"]


def test_samples_best_and_worst_escaped(page: Page, group_report: Path):
    html = group_report.read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html
    tables = page.table("samples")
    assert len(tables) == 5  # one per run
    hand = tables[0]["rows"][1:]  # runs are listed with the plain runs first
    # 4 samples: the 2 best (reward 1.0, later step first), then the 2 worst (lowest first)
    assert [(cls, c[1], c[2]) for cls, c in hand] == [
        ("best", "4", "1.000"), ("best", "1", "1.000"), ("worst", "2", "-1.000"), ("worst", "3", "0.000"),
    ]  # fmt: skip
    worst = hand[2][1]
    assert worst[3] == "-1.500" and worst[4] == "a < b & c" and worst[5] == SCRIPT


def test_real_samples_table_has_rewards_and_advantages(page: Page):
    rows = page.table("samples")[1]["rows"]
    assert rows[0][1] == ["", "step", "reward", "advantage", "prompt", "completion", "answer"]
    assert 2 <= len(rows) - 1 <= 10
    for _, cells in rows[1:]:
        float(cells[2]), float(cells[3])


def test_groups_are_drawn_with_bands(page: Page, group_report: Path):
    assert "mean over seeds, shaded band from min to max" in group_report.read_text()
    assert not page.missing  # every run has metrics, samples, config and pass@k


def test_missing_files_still_render(tmp_path: Path):
    only_summary = tmp_path / "only_summary"
    only_summary.mkdir()
    (only_summary / "summary.json").write_text(json.dumps({"steps": 2, "final": {"pass@1": 0.25}}))
    only_metrics = tmp_path / "only_metrics"
    only_metrics.mkdir()
    rows = [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew'  # killed mid-write
    (only_metrics / "metrics.jsonl").write_text(text)
    out = write_report([only_summary, only_metrics], tmp_path / "r.html")
    page = Page(out.read_text())
    assert page.sections == SECTIONS
    missing = " | ".join(page.missing)
    assert "only_summary: no config.toml" in missing and "only_metrics: no config.toml" in missing
    assert "no metrics.jsonl (or no rows) in: only_summary" in missing
    assert "no pass@k (summary.json 'final' or eval.json) in: only_metrics" in missing
    assert "no confidences" in missing
    assert "only_summary: no samples.jsonl" in missing and "only_metrics: no samples.jsonl" in missing
    notes = {c[0]: c[7] for _, c in page.table("runs")[0]["rows"][1:]}
    assert notes["only_metrics"] == "missing config.toml, samples.jsonl, summary.json; 1 unreadable JSONL line(s)"
    alts = [i["alt"] for i in page.images]
    assert alts == ["key metrics against step and wall time", "pass@k and maj@k against k", "reward metrics"]


def test_not_a_run_directory(tmp_path: Path):
    with pytest.raises(RunDirError, match="is not a run directory: it has none of config.toml, metrics.jsonl"):
        write_report([tmp_path], tmp_path / "r.html")
    with pytest.raises(RunDirError, match="no such directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(ValueError, match="at least one run"):
        write_report([], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_a_multi_turn_transcript_marks_trained_and_context_tokens(tmp_path):
    run = tmp_path / "agent"
    run.mkdir()
    (run / "config.toml").write_text('seed = 0\n[algorithm]\nadvantage = "trloo"\n')
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    sample = {"step": 1, "prompt": "guess", "answer": "7", "completion": "assistant: 3\nuser: no\nassistant: 7",
              "reward": 1.0, "advantage": 0.5,
              "transcript": [["3<|eos|>", True], ["<|user|>no & <b>", False], ["7<|eos|>", True]]}
    (run / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    html = write_report([run], tmp_path / "r.html").read_text()
    assert '<pre class="transcript"><span class="trained">3&lt;|eos|&gt;</span>' in html
    assert '<span class="context">&lt;|user|&gt;no &amp; &lt;b&gt;</span>' in html  # escaped, marked as context
    assert html.count('class="trained"') == 2
