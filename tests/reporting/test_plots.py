"""Metric groups, wall time, mean/min/max curves over seeds, and the PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from PIL import Image

from posttrain.reporting.plots import (
    Series,
    curve,
    curves_figure,
    metric_groups,
    plot_metric_groups,
    plot_metrics,
    wall_times,
)

ROWS = [
    {"step": 1, "accuracy": 0.1, "loss": 2.0, "reward/mean": 0.0, "reward/task/mean": 0.0, "time/step_s": 1.5,
     "policy/kl_ref": None},
    {"step": 2, "accuracy": 0.3, "loss": 1.0, "reward/mean": 0.5, "reward/task/mean": 0.5, "time/step_s": 0.5,
     "policy/kl_ref": None, "eval/pass@1": 0.25},
    {"step": 3, "accuracy": 0.2, "loss": float("nan"), "reward/mean": 1.0, "time/step_s": 2.0, "policy/kl_ref": None},
]  # fmt: skip


def test_metric_groups_main_first_and_all_null_keys_dropped():
    assert metric_groups(ROWS) == {
        "main": ["accuracy", "loss"],
        "eval": ["eval/pass@1"],
        "reward": ["reward/mean", "reward/task/mean"],
        "time": ["time/step_s"],
    }  # policy/kl_ref is null everywhere: no "policy" group


def test_metric_groups_of_a_real_run(report_runs):
    rows = [json.loads(line) for line in (report_runs["grpo"][0] / "metrics.jsonl").read_text().splitlines()]
    groups = metric_groups(rows)
    expected = {"main", "reward", "policy", "eval", "time", "throughput", "response", "optim", "adv", "selection"}
    assert expected <= set(groups) and next(iter(groups)) == "main"
    assert {"accuracy", "loss"} <= set(groups["main"]) and "reward/task/mean" in groups["reward"]


def test_wall_times_are_cumulative_step_times():
    # 1.5, 1.5 + 0.5 = 2.0, 2.0 + 2.0 = 4.0
    assert wall_times(ROWS) == {1: 1.5, 2: 2.0, 3: 4.0}
    assert wall_times([{"step": 1, "accuracy": 0.5}]) is None


def test_curve_mean_min_max_over_seeds():
    a = [{"step": 1, "m": 1.0, "time/step_s": 1.0}, {"step": 2, "m": 3.0, "time/step_s": 1.0}]
    b = [{"step": 1, "m": 2.0, "time/step_s": 3.0}, {"step": 3, "m": 5.0, "time/step_s": 1.0}]
    x, mean, lo, hi = curve([a, b], "m")
    # step 1: both seeds (1, 2) -> mean 1.5; step 2 only a (3); step 3 only b (5)
    np.testing.assert_allclose(x, [1, 2, 3])
    np.testing.assert_allclose(mean, [1.5, 3.0, 5.0])
    np.testing.assert_allclose(lo, [1.0, 3.0, 5.0])
    np.testing.assert_allclose(hi, [2.0, 3.0, 5.0])
    x, mean, _, _ = curve([a, b], "m", x="wall")
    # wall of step 1: a 1.0, b 3.0 -> 2.0; step 2: a 1 + 1 = 2.0; step 3: b 3 + 1 = 4.0
    np.testing.assert_allclose(x, [2.0, 2.0, 4.0])
    assert curve([a], "missing")[0].size == 0


def _png(path: Path) -> Image.Image:
    im = Image.open(path)
    assert im.format == "PNG"
    return im


def test_plot_metric_groups_one_png_per_group(tmp_path: Path):
    paths = plot_metric_groups(ROWS, tmp_path / "plots")
    assert [p.name for p in paths] == ["main.png", "eval.png", "reward.png", "time.png"]
    sizes = {p.stem: _png(p).size for p in paths}
    # two keys side by side are wider than one; every figure has the step and the wall-time panel
    assert sizes["main"][0] > sizes["eval"][0] and sizes["main"][1] == sizes["eval"][1]


def test_many_keys_make_a_grid_and_no_step_time_drops_the_wall_panel(tmp_path: Path):
    many = [{"step": s, **{f"policy/k{i}": float(i * s) for i in range(9)}} for s in range(1, 4)]
    (path,) = plot_metric_groups(many, tmp_path)
    with_wall = [{**r, "time/step_s": 1.0} for r in many]
    (path_wall,) = [p for p in plot_metric_groups(with_wall, tmp_path / "w") if p.stem == "policy"]
    w, h = _png(path).size
    w2, h2 = _png(path_wall).size
    assert w == w2 and h2 > 1.8 * h  # 9 keys: a 3 x 4 grid per panel; the wall-time panel doubles it
    four = [{"step": 1, **{f"policy/k{i}": 1.0 for i in range(4)}}]
    (path_four,) = plot_metric_groups(four, tmp_path / "four")
    assert w == _png(path_four).size[0] and w < 2 * h  # four columns at most, not one row of nine


def test_curves_figure_overlays_series_and_skips_absent_keys():
    runs = [[{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}], [{"step": 1, "a": 3.0}, {"step": 2, "a": 0.0}]]
    fig = curves_figure([Series("m1", runs), Series("m2", runs[:1])], ["a", "absent"])
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["a"]  # no step times: one panel, one key
    assert [line.get_label() for line in axes[0].get_lines()] == ["m1", "m2"]
    assert len(axes[0].collections) == 1  # the min-max band of the group with two runs
    plt.close(fig)
    assert curves_figure([Series("m", runs)], ["absent"]) is None


@pytest.mark.parametrize("keys", [["accuracy", "reward/mean"], ["nothing"]])
def test_plot_metrics_still_works(tmp_path: Path, keys):
    out = plot_metrics(ROWS, keys, tmp_path / "train.png", title="t")
    if keys == ["nothing"]:
        assert out is None
    else:
        assert _png(out).size[0] > 0
