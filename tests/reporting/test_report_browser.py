"""The report in a real browser: headless Chromium (Debian package ``chromium``) loads the file.

DOM test: a copy of the page gets a probe script in <head> that, on ``load``, writes to data
attributes how many images decoded with a non-zero natural size, their sizes, how many <script>
elements exist (the probe only: an escaped ``<script>`` in a completion must not become one) and
counts ``error`` events; ``--dump-dom`` prints the DOM after load. Console messages go to stderr
(``--enable-logging=stderr``): the probe logs one line, which shows the capture works, and no line
may be an uncaught error. Screenshot test: the unmodified page at 1200 x 2000 must give a PNG of
that size that is not blank.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from .test_report import SECTIONS

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (Debian: apt-get install chromium)")

PROBE = """<script>
window.addEventListener("error", () => {
  const d = document.documentElement.dataset; d.errors = String(Number(d.errors || 0) + 1);
}, true);
window.addEventListener("load", () => {
  const imgs = Array.from(document.images), b = document.body.dataset;
  b.imagesTotal = imgs.length;
  b.imagesLoaded = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0).length;
  b.imageSizes = imgs.map(i => i.naturalWidth + "x" + i.naturalHeight).join(" ");
  b.scripts = document.scripts.length;
  b.samplesTables = document.querySelectorAll("section#samples table.samples").length;
  console.log("probe: loaded " + imgs.length + " images");
});
</script>"""


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--hide-scrollbars", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


def test_dom_after_load(group_report: Path, tmp_path: Path):
    probed = tmp_path / "probed.html"
    probed.write_text(group_report.read_text().replace("</head>", PROBE + "</head>", 1))
    proc = _chromium(
        tmp_path, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    for section in SECTIONS:
        assert re.search(rf'<section id="{section}"', dom), section
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))
    assert int(attrs["images-total"]) >= 5
    assert attrs["images-loaded"] == attrs["images-total"]
    assert all(int(w) > 300 and int(h) > 200 for w, h in re.findall(r"(\d+)x(\d+)", attrs["image-sizes"]))
    assert attrs["scripts"] == "1" and attrs["samples-tables"] == "5"
    assert "&lt;script&gt;alert('x')&lt;/script&gt;" in dom  # shown as text
    assert "data-errors" not in re.search(r"<html([^>]*)>", dom).group(1)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert any("probe: loaded" in line for line in console), proc.stderr[-2000:]
    errors = [line for line in console if re.search(r"Uncaught|Error|Failed to load|Refused", line)]
    assert not errors


def test_screenshot(group_report: Path, tmp_path: Path):
    shot = tmp_path / "report.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000", group_report.as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    im = Image.open(shot)
    assert im.format == "PNG" and im.size == (1200, 2000)
    px = np.asarray(im.convert("L"), dtype=float)
    assert px.std() > 20  # not blank: text, tables and plots on white
    # the curves image lies in the first screen: many rows have dark (plotted or written) pixels
    assert (px < 128).any(axis=1).mean() > 0.3
