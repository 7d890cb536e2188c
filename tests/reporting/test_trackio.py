"""The Trackio sink (``log.trackio``), read back from trackio's SQLite database under ``tmp_path``.

``TRACKIO_DIR`` is read when trackio is imported, so each test imports a fresh trackio under its own
directory (the :func:`trackio_dir` fixture) and restores the modules afterwards. Nothing goes to ``~``,
and an audit hook records any attempt to resolve or reach an internet address.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.config.run import LogConfig
from posttrain.reporting.sinks import MetricSinks, read_metrics

pytest.importorskip("trackio", reason="trackio not installed (pip install posttrain[trackio])")

CONFIG = {"train": {"lr": 0.001, "betas": [0.9, 0.99]}, "seed": 3}
_NET: list[tuple] = []  # (event, address) of every internet lookup or connect while recording
_RECORDING = [False]


def _audit(event: str, args: tuple) -> None:
    if not _RECORDING[0]:
        return
    if event == "socket.getaddrinfo" or (event == "socket.connect" and isinstance(args[1], tuple)):
        _NET.append((event, args[0] if event == "socket.getaddrinfo" else args[1]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only inside a test that asks


@pytest.fixture
def trackio_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh ``import trackio`` writing to ``tmp_path/trackio``; no remote target, no network."""
    saved = {k: m for k, m in sys.modules.items() if k == "trackio" or k.startswith("trackio.")}
    for k in saved:
        del sys.modules[k]
    path = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(path))
    _NET.clear()
    _RECORDING[0] = True
    yield path
    _RECORDING[0] = False
    for k in [k for k in sys.modules if k == "trackio" or k.startswith("trackio.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _stored(db: Path) -> tuple[dict[str, str], dict[str, dict[int, list[dict]]], dict[str, dict]]:
    """What trackio wrote, read with plain sqlite3: ``{run_id: name}``, ``{run_id: {step: [metrics, ...]}}``
    (every row, so a step logged twice shows) and ``{run_id: config}``.
    """
    con = sqlite3.connect(db)
    names, steps, configs = {}, {}, {}
    for run_id, name, step, metrics in con.execute("SELECT run_id, run_name, step, metrics FROM metrics ORDER BY id"):
        names[run_id] = name
        steps.setdefault(run_id, {}).setdefault(step, []).append(json.loads(metrics))
    for run_id, name, config in con.execute("SELECT run_id, run_name, config FROM configs"):
        names[run_id] = name
        configs[run_id] = json.loads(config)
    con.close()
    return names, steps, configs


def _log(**kw) -> LogConfig:
    return LogConfig(tensorboard=False, progress=False, trackio=True, **kw)


def _write(sinks: MetricSinks, steps: dict[int, dict[str, float]]) -> None:
    for step, metrics in steps.items():
        sinks.write(step, metrics)
    sinks.close()


def test_rl_train_logs_to_trackio_what_metrics_jsonl_holds(tiny_cfg, trackio_dir, monkeypatch, capsys):
    from posttrain.train.rl import train

    # a token and remote targets in the environment: the sink must still stay local and offline
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/some-space")
    monkeypatch.setenv("TRACKIO_SERVER_URL", "http://example.invalid:7860/?write_token=x")
    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", "eval.every=2", "eval.prompts=4", "log.trackio=true")
    train(cfg, console=Console(quiet=True))

    run = Path(cfg.out)
    rows = read_metrics(run / "metrics.jsonl")
    names, steps, configs = _stored(trackio_dir / "posttrain.db")
    run_id = (run / "trackio_run_id").read_text().strip()
    assert names == {run_id: run.name}
    assert sorted(steps[run_id]) == [1, 2, 3] == [r["step"] for r in rows]
    for row in rows:
        (logged,) = steps[run_id][row["step"]]  # one row a step
        expected = {k: v for k, v in row.items() if k != "step" and v is not None}  # non-finite: null, not sent
        assert logged == expected and all(math.isfinite(v) for v in logged.values())
    assert "eval/pass@1" in steps[run_id][2][0]  # eval metrics at their step, names as they are
    assert configs[run_id]["train"]["steps"] == 3 and configs[run_id]["seed"] == cfg.seed
    assert _NET == []  # no lookup, no connection (HF_TOKEN set: trackio would ask the Hub who we are)
    assert "Trackio" not in capsys.readouterr().out  # trackio's banner does not go through the console
    assert "TRACKIO_SPACE_ID" in os.environ  # hidden from init only


def test_resume_continues_the_run_and_a_rewind_hands_over_to_a_new_one(tmp_path: Path, trackio_dir: Path):
    db = trackio_dir / "posttrain.db"
    _write(MetricSinks(tmp_path, _log(), config=CONFIG), {1: {"r": 0.5}, 2: {"r": 0.75}})
    first = (tmp_path / "trackio_run_id").read_text().strip()
    # resumed at step 2 (nothing after it was logged): the same run goes on
    _write(MetricSinks(tmp_path, _log(), start_step=2, config=CONFIG), {3: {"r": 1.0}})
    assert (tmp_path / "trackio_run_id").read_text().strip() == first
    names, steps, _ = _stored(db)
    assert {s: [m["r"] for m in v] for s, v in steps[first].items()} == {1: [0.5], 2: [0.75], 3: [1.0]}

    # resumed from step 1 (steps 2 and 3 run again): a new run holds steps 1.. once, the old one is kept
    _write(MetricSinks(tmp_path, _log(), start_step=1, config=CONFIG), {2: {"r": 2.0}})
    second = (tmp_path / "trackio_run_id").read_text().strip()
    names, steps, _ = _stored(db)
    assert second != first and names[second] == tmp_path.name
    assert names[first] == f"{tmp_path.name}.superseded-{first[:8]}"
    assert {s: [m["r"] for m in v] for s, v in steps[second].items()} == {1: [0.5], 2: [2.0]}
    assert len(steps[first]) == 3  # untouched

    # a fresh start in the same directory is a new run
    _write(MetricSinks(tmp_path, _log(), config=CONFIG), {1: {"r": 0.0}})
    assert (tmp_path / "trackio_run_id").read_text().strip() not in (first, second)
    assert _NET == []


def test_resume_does_not_continue_another_directorys_run_of_the_same_name(tmp_path: Path, trackio_dir: Path):
    a, b = tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"  # same name, as trackio names runs
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    _write(MetricSinks(a, _log()), {1: {"r": 0.5}, 2: {"r": 0.75}})
    _write(MetricSinks(b, _log()), {1: {"r": 9.0}})  # now the newest "seed0"
    _write(MetricSinks(a, _log(), start_step=2), {3: {"r": 1.0}})
    names, steps, _ = _stored(trackio_dir / "posttrain.db")
    a_id, b_id = (a / "trackio_run_id").read_text().strip(), (b / "trackio_run_id").read_text().strip()
    assert {s: [m["r"] for m in v] for s, v in steps[a_id].items()} == {1: [0.5], 2: [0.75], 3: [1.0]}
    assert {s: [m["r"] for m in v] for s, v in steps[b_id].items()} == {1: [9.0]} and names[b_id] == "seed0"
    assert names[a_id] == "seed0" and sorted(names.values()).count("seed0") == 2  # the old "a" renamed


def test_an_unwritable_trackio_dir_warns_once_and_the_run_goes_on(tiny_cfg, trackio_dir, monkeypatch):
    from posttrain.train.rl import train

    blocker = trackio_dir.parent / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TRACKIO_DIR", str(blocker / "trackio"))  # mkdir fails, whoever runs the test
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "log.trackio=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, console=Console(quiet=True))
    assert [r["step"] for r in read_metrics(Path(cfg.out) / "metrics.jsonl")] == [1, 2]
    about = [str(w.message) for w in caught if "trackio" in str(w.message).lower()]
    assert len(about) == 1 and "Not a directory" in about[0], about


def test_an_exception_from_trackio_log_warns_once_and_logging_goes_on(tmp_path, trackio_dir, monkeypatch):
    import trackio.run

    calls = []

    def broken_log(self, metrics, step=None):  # a fault injected into the real run object
        calls.append(step)
        raise OSError("disk on fire")

    monkeypatch.setattr(trackio.run.Run, "log", broken_log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _write(MetricSinks(tmp_path, _log()), {1: {"r": 0.5}, 2: {"r": 0.75}, 3: {"r": 1.0}})
    about = [str(w.message) for w in caught if "trackio" in str(w.message).lower()]
    assert about == ["log.trackio: trackio failed to log step 1 (OSError: disk on fire); training goes on "
                     "without trackio (metrics.jsonl has every step)"]  # fmt: skip
    assert calls == [1]  # given up after the first failure
    assert [r["r"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.5, 0.75, 1.0]


def test_missing_trackio_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from posttrain.config import ConfigError

    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio -> ImportError
    with pytest.raises(ConfigError, match=r"log.trackio=true needs .* pip install posttrain\[trackio\]"):
        MetricSinks(tmp_path, _log())
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened before the check
