"""`posttrain dpo` with the losses that need more than four sequence sums: Ra-DPO (token-level risk) and INPO
(the previous iterate). Smoke runs on the tiny model, the iteration schedule, resume, and config errors."""

import json
import math

import pytest
from safetensors.torch import load_file

from posttrain.algorithms import preference
from posttrain.config import ConfigError
from posttrain.run.checkpoint import latest_checkpoint
from posttrain.trainers.dpo import dpo_train


def rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def changed(run):
    """Largest absolute parameter change between the starting tiny model and the final checkpoint."""
    start = load_file(run / "base_model" / "model.safetensors")
    end = load_file(latest_checkpoint(run / "checkpoints") / "model.safetensors")
    return max(float((end[k] - start[k]).abs().max()) for k in start)


@pytest.fixture
def file_pairs(pairs_file):
    # batch 8 > 5 pairs: every step sees all five, so batch means are comparable across steps
    return ("dpo.pairs=file", f'dpo.path="{pairs_file}"', "dpo.fields={prompt='q', chosen='good', rejected='bad'}",
            "dpo.lr=1e-3", "dpo.warmup_steps=0", "dpo.batch_size=8")


def test_ra_dpo_trains_with_token_level_risk(tiny_cfg, quiet, tmp_path, file_pairs):
    dpo_train(tiny_cfg(*file_pairs, "dpo.loss=ra_dpo", "dpo.steps=6", "checkpoint.every=0"), console=quiet)
    r = rows(tmp_path / "run")
    # step 1: policy == reference, so D_t(v) = 0, no token lies above VaR = 0 and R = 0: the loss is DPO's log 2
    # (up to float noise between the two models' forwards)
    assert r[0]["dpo/chosen_risk"] == pytest.approx(0.0, abs=1e-6)
    assert r[0]["dpo/rejected_risk"] == pytest.approx(0.0, abs=1e-6)
    assert r[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert all(math.isfinite(x["dpo/loss"]) for x in r)
    assert all(x["dpo/chosen_risk"] > 0 and x["dpo/rejected_risk"] > 0 for x in r[1:])  # the policy drifted
    margins = [x["dpo/reward_margin"] for x in r]
    assert all(b > a for a, b in zip(margins, margins[1:], strict=False)), margins
    assert r[-1]["dpo/accuracy"] == 1.0 and r[-1]["dpo/loss"] < r[0]["dpo/loss"]
    assert changed(tmp_path / "run") > 1e-4


def test_inpo_file_pairs_iterate_every(tiny_cfg, quiet, tmp_path, file_pairs):
    dpo_train(tiny_cfg(*file_pairs, "dpo.loss=inpo", "dpo.iterate_every=3", "dpo.steps=9", "checkpoint.every=0"),
              console=quiet)
    r = rows(tmp_path / "run")
    # step 1: pi = pi_t = pi_ref, so h = 0 and L = (0 - eta/2)^2 = 0.25
    assert r[0]["dpo/loss"] == pytest.approx(0.25, abs=1e-5)
    assert all(math.isfinite(x["dpo/loss"]) for x in r)
    # pi_t is re-taken at steps 0, 3, 6 (rows 1, 4, 7): constant within an iteration, new at its start
    # (the batch is the five pairs in another order each step, so means agree to float rounding)
    prev = [x["dpo/prev_chosen_logps"] for x in r]
    for start in (0, 3, 6):
        assert prev[start + 1] == pytest.approx(prev[start], abs=1e-5)
        assert prev[start + 2] == pytest.approx(prev[start], abs=1e-5)
    assert abs(prev[3] - prev[0]) > 1e-2 and abs(prev[6] - prev[3]) > 1e-2
    # pi_t of the first iteration is the starting model, i.e. the reference: its chosen sums are the reference's
    # (h = m_w - m_l targets eta/2 = 0.5); later iterations move the target, so the margin keeps rising
    margins = [x["dpo/reward_margin"] for x in r]
    assert margins[2] > 0.3 and margins[-1] > 1.0 > margins[2], margins
    assert r[-1]["dpo/accuracy"] == 1.0
    assert changed(tmp_path / "run") > 1e-4


def test_inpo_task_pairs_take_the_sampling_policy(tiny_cfg, quiet, tmp_path):
    # pairs sampled at steps 0 and 2 (refresh_every=2): pi_t is the policy that sampled them
    dpo_train(tiny_cfg("dpo.loss=inpo", "dpo.steps=4", "dpo.refresh_every=2", "dpo.prompts_per_refresh=8",
                       "dpo.group_size=4", "dpo.batch_size=4", "checkpoint.every=0"), console=quiet)
    r = rows(tmp_path / "run")
    assert "dpo/pair_prompts" in r[0] and "dpo/pair_prompts" in r[2]
    assert r[0]["dpo/loss"] == pytest.approx(0.25, abs=1e-5)  # pi_t = pi_0 = pi_ref at the first refresh
    assert all(math.isfinite(x["dpo/loss"]) for x in r)
    assert r[1]["dpo/reward_margin"] > 0 and r[1]["dpo/loss"] < 0.25
    assert changed(tmp_path / "run") > 1e-4


@pytest.mark.parametrize("source", ["file", "task"])
def test_inpo_resume_equals_an_uninterrupted_run(tiny_cfg, quiet, tmp_path, file_pairs, source):
    # cut mid-iteration (pi_t taken at step 2, checkpoint after step 3): a resumed run must use the saved pi_t,
    # not the policy it restarts from
    common = {
        "file": (*file_pairs, "dpo.iterate_every=2"),
        "task": ("dpo.refresh_every=2", "dpo.prompts_per_refresh=8", "dpo.group_size=4", "dpo.batch_size=4"),
    }[source] + ("dpo.loss=inpo", "checkpoint.every=3")
    dpo_train(tiny_cfg("dpo.steps=5", *common, out=str(tmp_path / "full")), console=quiet)
    dpo_train(tiny_cfg("dpo.steps=3", *common, out=str(tmp_path / "cut")), console=quiet)
    dpo_train(tiny_cfg("dpo.steps=5", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)

    def strip(run):
        return [{k: v for k, v in x.items() if not k.startswith("time/")} for x in rows(run)]

    full, cut = strip(tmp_path / "full"), strip(tmp_path / "cut")
    assert [x["step"] for x in cut] == [1, 2, 3, 4, 5] and "dpo/prev_chosen_logps" in cut[3]
    for a, b in zip(full, cut, strict=True):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a), (a, b)


def test_config_accepts_the_new_losses_and_rejects_the_rest(tiny_cfg, monkeypatch):
    assert tiny_cfg("dpo.loss=inpo", "dpo.loss_params={eta=0.5, tau=0.2}").dpo.loss == "inpo"
    assert tiny_cfg("dpo.loss=ra_dpo", "dpo.risk_confidence=0.99", "dpo.loss_params={variant=2}").dpo.loss == "ra_dpo"

    def needs_tokens(cw, cl, rw, rl, *, token_logps):  # an input the trainer does not compute
        return cw

    monkeypatch.setitem(preference.REGISTRY._entries, "needs_tokens", needs_tokens)
    with pytest.raises(ConfigError, match=r"'needs_tokens' needs input\(s\) \['token_logps'\].*usable: .*'inpo'"):
        tiny_cfg("dpo.loss=needs_tokens")
    with pytest.raises(ConfigError, match=r"no parameter\(s\) \['prev_chosen_logps'\].*inputs the trainer computes"):
        tiny_cfg("dpo.loss=inpo", "dpo.loss_params={prev_chosen_logps=1.0}")
    with pytest.raises(ConfigError, match="variant must be 1 or 2; got 3"):
        tiny_cfg("dpo.loss=ra_dpo", "dpo.loss_params={variant=3}")
    with pytest.raises(ConfigError, match=r"dpo.iterate_every: 'dpo' does not use it \(got 4\); only \['inpo'\]"):
        tiny_cfg("dpo.iterate_every=4")
    with pytest.raises(ConfigError, match=r"dpo.risk_confidence: 'inpo' does not use it.*\['ra_dpo'\]"):
        tiny_cfg("dpo.loss=inpo", "dpo.risk_confidence=0.9")
    with pytest.raises(ConfigError, match="dpo.iterate_every: with pairs = 'task'.*got 4; valid: 0"):
        tiny_cfg("dpo.loss=inpo", "dpo.iterate_every=4")
    with pytest.raises(ConfigError, match="risk_confidence"):
        tiny_cfg("dpo.loss=ra_dpo", "dpo.risk_confidence=1.0")
