from posttrain.cli import main


def test_algorithms_lists_every_registry(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for name in ("grpo", "rloo", "ppo_clip", "cispo", "token_mean", "k3", "dpo", "overlong"):
        assert name in out


def test_algorithms_name_prints_the_docstring(capsys):
    assert main(["algorithms", "grpo"]) == 0
    assert "2402.03300" in capsys.readouterr().out


def test_unknown_algorithm_is_a_clear_error(capsys):
    assert main(["algorithms", "grpoo"]) == 2
    assert "Did you mean 'grpo'" in capsys.readouterr().out


def test_bad_override_exits_2_with_message(capsys, tmp_path):
    assert main(["train", "recipes/tiny.toml", "--out", str(tmp_path / "r"), "rollout.group_sise=3"]) == 2
    assert "group_size" in capsys.readouterr().out


def test_missing_model_path_exits_2(capsys, tmp_path):
    code = main(["train", "recipes/tiny.toml", "--out", str(tmp_path / "r"), f'model.path="{tmp_path}/none"'])
    assert code == 2
    assert "does not exist" in capsys.readouterr().out


def test_report_command_writes_html_for_a_run_and_rejects_a_non_run(capsys, tmp_path, tiny_cfg, quiet):
    from posttrain.train.rl import train

    train(tiny_cfg("train.steps=2", "checkpoint.every=0", "log.plot_groups=true"), console=quiet)
    run = tmp_path / "run"
    assert (run / "plots" / "reward.png").exists()  # one PNG per metric group
    html = tmp_path / "r.html"
    assert main(["report", str(run), "--html", str(html), "--title", "t"]) == 0
    page = html.read_text()
    assert 'id="curves"' in page and "data:image/png;base64," in page
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "error" in capsys.readouterr().out


def test_dpo_command_trains_from_a_pairs_file(tmp_path, capsys):
    import json

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1)[::-1], "rejected": "0"}) + "\n"
                             for a in range(1, 9)))
    out = tmp_path / "dpo"
    rc = main(["dpo", "recipes/tiny.toml", "--out", str(out), "dpo.steps=2", 'dpo.pairs="file"',
               f'dpo.path="{pairs}"', "dpo.eval_every=0", "log.progress=false", "log.tensorboard=false"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["dpo/loss"] - 0.6931) < 1e-3  # log 2


def test_the_parser_imports_no_torch_and_help_answers_at_once():
    """Building the parser imports neither torch, transformers nor the config (they took ~4 s before the
    commands imported them lazily), and a subcommand's --help still prints its arguments.
    """
    import subprocess
    import sys

    code = (
        "import sys; from posttrain.cli import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'posttrain.config') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    helped = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "overrides" in helped.stdout


def test_an_input_error_raised_inside_a_command_is_a_message_not_a_traceback(capsys, tmp_path):
    # the errors are imported only when one is raised: a missing run directory is a RunDirError
    assert main(["report", str(tmp_path / "none"), "--html", str(tmp_path / "r.html")]) == 2
    assert "error:" in capsys.readouterr().out
