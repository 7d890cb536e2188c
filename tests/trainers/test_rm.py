"""Reward-model training (`posttrain rm`): the Bradley-Terry and ODIN losses by hand, a run on the tiny task
that ranks held-out pairs, the saved model through the `reward_model` reward, ODIN's decorrelation from
length, exact resume, and config errors."""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from posttrain.algorithms.reward_modeling import bradley_terry, odin_length_loss, odin_loss, odin_orthogonality, pearson
from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.models.load import load_model, load_tokenizer
from posttrain.rewards import score
from posttrain.rewards.reward_model import RewardModel
from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
from posttrain.trainers.dpo_pairs import TokenPair
from posttrain.trainers.rm import rm_train
from posttrain.trainers.rm_model import as_reward_model, last_token_features, load_reward_model, pair_rows, score_rows

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false"]
SMALL = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=1",
         "model.tiny.max_positions=32"]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def rm_cfg(out: Path, *overrides: str):
    """recipes/rm.toml (task pairs, tiny model) made small, writing into ``out``."""
    return load_config(ROOT / "recipes" / "rm.toml", [f'out="{out}"', "checkpoint.every=0", *QUIET, *overrides])


# ---- the losses, by hand ----


def test_bradley_terry_by_hand():
    r_w, r_l = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 3.0])
    # l = -log sigmoid(r_w - r_l) = log(1 + exp(-(r_w - r_l))), differences d = [1, 0, -2]:
    #   log(1 + e^-1) = log 1.367879 = 0.313262;  log(1 + 1) = 0.693147;  log(1 + e^2) = log 8.389056 = 2.126928
    torch.testing.assert_close(bradley_terry(r_w, r_l), torch.tensor([0.313262, 0.693147, 2.126928]))
    # margin m = 0.5: d - m = [0.5, -0.5, -2.5]: log(1 + e^-0.5) = log 1.606531 = 0.474077;
    #   log(1 + e^0.5) = log 2.648721 = 0.974077;  log(1 + e^2.5) = log 13.182494 = 2.578890
    torch.testing.assert_close(bradley_terry(r_w, r_l, margin=0.5), torch.tensor([0.474077, 0.974077, 2.578890]))
    # the gradient on r_w is -(1 - sigmoid(d)) = -sigmoid(-d): at d = 0 it is -1/2
    r = torch.zeros(1, requires_grad=True)
    bradley_terry(r, torch.zeros(1)).sum().backward()
    assert r.grad.item() == pytest.approx(-0.5)


def test_odin_terms_by_hand():
    lengths = torch.tensor([1.0, 2.0, 3.0, 4.0])  # centred: [-1.5, -0.5, 0.5, 1.5], sum of squares 5
    quality = torch.tensor([0.0, 1.0, 0.0, 0.0])  # centred: [-0.25, 0.75, -0.25, -0.25], sum of squares 0.75
    length_reward = torch.tensor([1.0, 1.0, 2.0, 2.0])  # centred: [-0.5, -0.5, 0.5, 0.5], sum of squares 1
    # rho(r_Q, L) = (0.375 - 0.375 - 0.125 - 0.375) / sqrt(0.75 * 5) = -0.5 / 1.936492 = -0.258199
    assert float(pearson(quality, lengths)) == pytest.approx(-0.258199, abs=1e-5)
    # rho(r_L, L) = (0.75 + 0.25 + 0.25 + 0.75) / sqrt(1 * 5) = 2 / 2.236068 = 0.894427
    assert float(pearson(length_reward, lengths)) == pytest.approx(0.894427, abs=1e-5)
    # L_L = |rho(r_Q, L)| - rho(r_L, L) = 0.258199 - 0.894427 = -0.636228
    assert float(odin_length_loss(quality, length_reward, lengths)) == pytest.approx(-0.636228, abs=1e-5)
    # L_O = |cos(w_Q, w_L)|, w_Q = [1, 0], w_L = [1, 1]: 1 / sqrt(2) = 0.707107
    w_q, w_l = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    assert float(odin_orthogonality(w_q, w_l)) == pytest.approx(0.707107, abs=1e-6)
    # whole objective, B = 2 (rows: chosen 0, 1; rejected 2, 3): r = r_Q + r_L = [1, 2, 2, 2], so
    #   BT = mean(log(1 + e^(-(1 - 2))), log(1 + e^0)) = (1.313262 + 0.693147) / 2 = 1.003204
    #   L = 1.003204 + 1 * (-0.636228) + 1 * 0.707107 = 1.074083
    loss, parts = odin_loss(quality, length_reward, lengths, w_q, w_l)
    assert float(parts["bt"]) == pytest.approx(1.003204, abs=1e-5)
    assert float(loss) == pytest.approx(1.074083, abs=1e-5)
    loss, _ = odin_loss(quality, length_reward, lengths, w_q, w_l, length_coef=0.5, ortho_coef=0.0)
    assert float(loss) == pytest.approx(1.003204 - 0.5 * 0.636228, abs=1e-5)


def test_a_batch_of_equal_lengths_gives_zero_correlation_and_finite_gradients():
    quality = torch.tensor([0.3, -0.1, 0.2, 0.5], requires_grad=True)
    length_reward = torch.zeros(4, requires_grad=True)  # a constant head too: both roots are at 0 + eps
    loss = odin_length_loss(quality, length_reward, torch.full((4,), 3.0))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.isfinite(quality.grad).all() and torch.isfinite(length_reward.grad).all()


# ---- the model ----


def test_the_reward_model_keeps_the_base_weights_and_reads_its_head_where_hf_does(tmp_path):
    from posttrain.models.tiny import TinySpec, build_tiny

    base = build_tiny(tmp_path / "base", TinySpec(alphabet="0123456789+=", hidden_size=16, intermediate_size=32,
                                                   num_layers=1, max_positions=32))
    causal, tok = load_model(str(base)), load_tokenizer(str(base))
    rm = as_reward_model(causal, tok.pad_token_id)
    assert rm.config.num_labels == 1 and rm.score.weight.shape == (1, 16)
    for name, w in causal.model.state_dict().items():
        assert torch.equal(w, rm.model.state_dict()[name]), name
    rows = [[1, 5, 6, 7], [1, 5, 2], [1, 8, 9, 10, 11, 2]]  # ragged: right-padded inside
    with torch.no_grad():
        ids = torch.tensor([r + [tok.pad_token_id] * (6 - len(r)) for r in rows])
        hf = rm(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, 0]
        mine = rm.score(last_token_features(rm, rows))[:, 0]
    torch.testing.assert_close(mine, hf)
    # a completion without EOS gets one (the reward_model reward's chat template closes the turn with it)
    built, lengths = pair_rows([TokenPair([1, 5], [6, 2], [7])], eos_id=2)
    assert built == [[1, 5, 6, 2], [1, 5, 7, 2]] and lengths.tolist() == [2.0, 2.0]


# ---- a run on the tiny task ----


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """recipes/rm.toml on task pairs (the tiny model's samples vs the demonstrations), 30 steps."""
    out = tmp_path_factory.mktemp("rm") / "run"
    cfg = rm_cfg(out, "rm.steps=30", "rm.prompts=64", "rm.eval_prompts=32", "rm.eval_every=10")
    return out, rm_train(cfg, console=Console(quiet=True))


def test_a_short_run_ranks_held_out_pairs(task_run):
    run, summary = task_run
    r = rows_of(run)
    # at step 1 the head is a fresh init (std 0.02), so r_w - r_l ~ 0 and the loss is ~ log 2
    assert r[0]["rm/loss"] == pytest.approx(math.log(2), abs=0.05)
    assert r[0]["rm/pairs"] > 0 and 0 <= r[0]["rm/demo_chosen"] <= 1  # the task pairs' statistics, at step 1
    val = [(x["step"], round(x["rm/val_accuracy"], 3)) for x in r if "rm/val_accuracy" in x]
    print(f"\nheld-out pair accuracy by step {val}; loss {r[0]['rm/loss']:.3f} -> {r[-1]['rm/loss']:.3f}")
    assert [s for s, _ in val] == [10, 20, 30]
    assert summary["val_accuracy"] == pytest.approx(val[-1][1], abs=1e-3)
    assert summary["val_accuracy"] >= 0.8 and r[-1]["rm/loss"] < r[0]["rm/loss"] / 2
    assert summary["steps"] == 30 and summary["pairs_used"] == 30 * 16


def test_the_saved_model_scores_through_the_reward_model_reward(task_run):
    run, summary = task_run
    saved = Path(summary["reward_model"])
    assert saved == run / "reward_model" and (saved / "config.json").exists()
    held_out = [TokenPair(*p) for p in load_trainer_state(latest_checkpoint(run / "checkpoints"))["loop"]["val_pool"]]
    tok = load_tokenizer(str(saved))
    eos = tok.eos_token_id
    # back to text: the user prompt (the chat template's role tokens stripped) and each completion without its EOS
    # (special tokens a random policy wrote stay in the text; the tokenizer reads them back as the same ids)
    prompts = [tok.decode(p.prompt).removeprefix("<|bos|><|user|>").removesuffix("<|assistant|>") for p in held_out]
    texts = [tok.decode(c[:-1] if c[-1] == eos else c) for p in held_out for c in (p.chosen, p.rejected)]
    got = score("reward_model", [p for p in prompts for _ in range(2)], texts, params={"path": str(saved)})
    b = len(held_out)
    chosen, rejected = torch.tensor(got[0::2]), torch.tensor(got[1::2])
    acc = float((chosen > rejected).float().mean())
    print(f"\nreward_model reward on {b} held-out pairs: chosen > rejected on {acc:.3f}")
    assert acc >= 0.8
    # the same numbers as the trainer's own scoring
    rows, _ = pair_rows(held_out, eos)
    mine = score_rows(load_reward_model(str(saved), torch.float32, torch.device("cpu")), rows, 16)
    torch.testing.assert_close(torch.stack([chosen, rejected]), torch.stack([mine[:b], mine[b:]]), atol=1e-4, rtol=0)


# ---- ODIN ----


def _length_biased_pairs(path: Path, n: int = 400) -> None:
    """Pairs ranked by 3 quality + 0.5 length: a response of n tokens is n - 1 filler digits and a last digit
    that is 7 (good) or 3 (bad), so the chosen is systematically longer (equal quality: the longer wins) but
    quality dominates (a good response wins unless it is 7 or more tokens shorter)."""
    rng = random.Random(0)
    rows = []
    while len(rows) < n:
        (g1, n1), (g2, n2) = [(rng.random() < 0.5, rng.randint(1, 9)) for _ in range(2)]
        if 3 * g1 + 0.5 * n1 == 3 * g2 + 0.5 * n2:
            continue
        (gw, nw), (gl, nl) = sorted([(g1, n1), (g2, n2)], key=lambda x: 3 * x[0] + 0.5 * x[1], reverse=True)
        rows.append({"prompt": f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "chosen": _response(rng, nw, gw),
                     "rejected": _response(rng, nl, gl)})
    path.write_text("\n".join(json.dumps(r) for r in rows))


def _response(rng: random.Random, n: int, good: bool) -> str:
    return "".join(rng.choice("01245689") for _ in range(n - 1)) + ("7" if good else "3")


def test_odin_decorrelates_the_saved_quality_head_from_length(tmp_path, tiny_cfg, quiet):
    _length_biased_pairs(tmp_path / "pairs.jsonl")
    rng = random.Random(1)  # probes: length and quality drawn independently
    probes = [(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", rng.randint(1, 9), rng.random() < 0.5)
              for _ in range(200)]
    texts = [_response(rng, n, g) for _, n, g in probes]
    lengths = torch.tensor([float(n) for _, n, _ in probes])
    corr = {}
    for debias in ("none", "odin"):
        out = tmp_path / debias
        cfg = tiny_cfg("rm.pairs=file", f'rm.path="{tmp_path / "pairs.jsonl"}"', f"rm.debias={debias}", "rm.steps=60",
                       "rm.lr=3e-3", "rm.warmup_steps=0", "rm.eval_every=0", "checkpoint.every=0", *SMALL,
                       out=str(out))
        summary = rm_train(cfg, console=quiet)
        # the saved model is the quality head alone: one output, loaded as-is by the reward_model reward
        rm = RewardModel(summary["reward_model"])
        assert rm.model.config.num_labels == 1
        corr[debias] = float(pearson(torch.tensor(rm.score([p for p, _, _ in probes], texts)), lengths))
        last = rows_of(out)[-1]
        if debias == "odin":
            assert last["rm/odin_length_head_corr"] > 0.7  # the length head took the length up
            head = load_trainer_state(latest_checkpoint(out / "checkpoints"))["loop"]["length_head"]
            assert head.shape == (1, 32)
    print(f"\ncorrelation of the saved reward with response length on independent probes: {corr}")
    assert corr["none"] > 0.3  # plain BT learns the length shortcut
    assert abs(corr["odin"]) < corr["none"] / 2


# ---- resume ----


def test_resume_equals_an_uninterrupted_run(tmp_path, quiet):
    common = ["rm.debias=odin", "rm.prompts=24", "rm.eval_prompts=8", "rm.batch_size=8", "rm.eval_every=2",
              "rm.warmup_steps=2", *SMALL]
    rm_train(rm_cfg(tmp_path / "full", "rm.steps=5", *common), console=quiet)
    rm_train(rm_cfg(tmp_path / "cut", "rm.steps=3", *common), console=quiet)  # "killed" after step 3
    summary = rm_train(rm_cfg(tmp_path / "cut", "rm.steps=5", *common), resume=True, console=quiet)
    assert summary["steps"] == 5
    full, cut = (load_file(tmp_path / r / "reward_model" / "model.safetensors") for r in ("full", "cut"))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    heads = [load_trainer_state(latest_checkpoint(tmp_path / r / "checkpoints"))["loop"] for r in ("full", "cut")]
    assert torch.equal(heads[0]["length_head"], heads[1]["length_head"]) and heads[0]["pool"] == heads[1]["pool"]
    a, b = rows_of(tmp_path / "full"), rows_of(tmp_path / "cut")
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5]
    assert [x["rm/loss"] for x in a] == [x["rm/loss"] for x in b]


# ---- config and command line ----


@pytest.mark.parametrize(("override", "message"), [
    ("rm.pairs=file", "pairs = 'file' and rm.path go together"),
    ('rm.path="p.jsonl"', "pairs = 'file' and rm.path go together"),
    ('rm.eval_path="v.jsonl"', "rm.eval_path: held-out pairs from a file need pairs = 'file'"),
    ("rm.odin_length_coef=2.0", "rm.odin_length_coef: only debias = 'odin' uses it"),
    ("rm.debias=fimo", "rm.debias.*'none', 'odin' or 'fimi'"),
    ("rm.fimi_every=3", "rm.fimi_every: only debias = 'fimi' uses it"),
    ("rm.margin=-1", "rm.margin.*greater than or equal to 0"),
    ("rm.eval_fraction=1.0", "rm.eval_fraction.*less than 1"),
    ("rm.fields={answer='a'}", r"rm.fields: unknown target\(s\) \['answer'\]"),
    ("rm.stepz=3", "unknown key 'rm.stepz'; valid keys here: .*'steps'"),
])
def test_bad_config_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "recipes" / "rm.toml", [override])


def test_lora_is_refused_before_the_run_directory_is_made(tmp_path, quiet):
    with pytest.raises(ConfigError, match="LoRA is not supported"):
        rm_train(rm_cfg(tmp_path / "run", "model.lora.rank=4"), console=quiet)
    assert not (tmp_path / "run").exists()


def test_the_rm_command(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["rm", "recipes/rm.toml", "--out", str(out), "--max-steps", "2", "rm.prompts=16", "rm.eval_prompts=8",
               *SMALL, *QUIET])
    assert rc == 0 and [x["step"] for x in rows_of(out)] == [1, 2]
    assert (out / "reward_model" / "model.safetensors").exists()
    assert main(["rm", "recipes/rm.toml", "--out", str(tmp_path / "bad"), "rm.debias=length"]) == 2
    assert "rm.debias" in capsys.readouterr().out
