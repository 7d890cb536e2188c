"""HINT's hint re-roll in the loop (rollout.hint_reroll): all-wrong groups are sampled again from the
question + preamble + hint and replace the original group; trained on the question (HINT's code) or
on the hinted prompt."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import ConfigError, LearnSettings, ProduceSettings
from posttrain.models.load import encode_chat
from posttrain.models.tiny import build_char_tokenizer
from posttrain.produce.drivers.hint import reroll
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rollout import Rollout, SamplingParams
from posttrain.tasks import ArithmeticTask
from posttrain.train.rl import train


class EchoEngine:
    """Every completion of a prompt is one token: the prompt's length (so a re-roll is visible)."""

    pad_id = 0

    def generate(self, prompts, sampling, seed=None):
        n = sampling.n
        tokens = torch.tensor([[len(p)] for p in prompts for _ in range(n)])
        texts = [str(len(p)) for p in prompts for _ in range(n)]
        ones = torch.ones(len(tokens), 1)
        done = torch.ones(len(tokens), dtype=torch.bool)
        return Rollout.single_turn(prompts, tokens, ones, -0.5 * ones, done, texts, n)


@pytest.mark.parametrize("train_on", ["question", "hinted"])
def test_all_wrong_groups_with_a_hint_are_replaced(train_on, tiny_cfg):
    cfg = tiny_cfg("rollout.driver=hint_reroll", f'rollout.driver_params={{preamble="=", train_prompt="{train_on}"}}')
    task = ArithmeticTask(digits=2)
    examples = [task.make_example(58, "+", 67), task.make_example(12, "+", 34), task.make_example(11, "+", 22)]
    examples[2] = type(examples[2])(examples[2].prompt, examples[2].answer, examples[2].demonstration)  # no hint
    tok = build_char_tokenizer(task.alphabet)
    ids = [encode_chat(tok, ex.prompt) for ex in examples]
    engine, sampling = EchoEngine(), SamplingParams(n=2, max_new_tokens=1)
    rollouts = engine.generate(ids, sampling)
    r_PGK = torch.tensor([[[0.0], [0.0]], [[1.0], [0.0]], [[0.0], [0.0]]])  # groups 0 and 2 all wrong
    valid, ok = torch.ones(3, 2, dtype=torch.bool), r_PGK[..., 0] > 0

    def score(exs, c):  # the re-rolled samples: the first of each group is right
        assert [e.prompt for e in exs] == ["85+76="]  # scored against the plain question
        return torch.tensor([[[1.0], [0.0]]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([[True, False]]), {}, []

    produce_settings = ProduceSettings.of(cfg)
    out = reroll(produce_settings, tok, engine, sampling, examples, ids, rollouts, r_PGK, valid, ok, score,
                 torch.tensor([2.0]), step=0, batch=0)
    hinted = encode_chat(tok, "85+76==11")  # question + "=" + carries "11"
    assert out.rollouts.token_ids[:, 0].tolist() == [len(hinted)] * 2 + [len(ids[1])] * 2 + [len(ids[2])] * 2
    assert out.rewards_PGK[..., 0].tolist() == [[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]]  # weighted, group 0 replaced
    assert out.correct_PG.tolist() == [[True, False], [True, False], [False, False]]
    assert out.train_ids == [hinted if train_on == "hinted" else ids[0], ids[1], ids[2]]
    assert out.metrics == {"selection/hint_rerolls": 1.0, "selection/hint_missing": 1.0,
                           "selection/hint_solved": 1.0, "selection/hint_accuracy": 0.5}
    assert out.discarded_tokens == 2 and r_PGK[0, 0, 0] == 0  # the inputs are not modified


def test_hint_config_errors_name_the_key(tiny_cfg):
    with pytest.raises(ConfigError, match=r"'rollout.hint_preamble' has moved: use rollout.driver_params.preamble"):
        tiny_cfg('rollout.hint_preamble="="')
    with pytest.raises(ConfigError, match=r"task 'countdown' gives none; tasks with hints: \['arithmetic'\]"):
        tiny_cfg("rollout.driver=hint_reroll", 'task.name="countdown"', "task.params={}")
    with pytest.raises(ConfigError, match=r"task.dataset.fields.hint = COLUMN"):
        tiny_cfg("rollout.driver=hint_reroll", 'task.name="dataset"', "task.params={}", 'task.dataset={path="x.jsonl"}')
    with pytest.raises(ConfigError, match=r"rollout.driver_params.train_prompt"):
        tiny_cfg("rollout.driver=hint_reroll", 'rollout.driver_params={train_prompt="hint"}')


def _wrong_on_even(prompt, completion, **_):
    return 0.0 if int(prompt[0]) % 2 == 0 else float(len(completion) % 2)  # even prompts: all wrong


def test_hint_reroll_in_the_loop(tiny_cfg, quiet, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS._entries, "test_wrong_on_even", _wrong_on_even)
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "train.lr=1e-2", 'reward=[{name="test_wrong_on_even"}]',
                   "rollout.driver=hint_reroll", 'rollout.driver_params={preamble="="}', "log.samples_every=1",
                   "log.samples=32")
    train(cfg, console=quiet)
    run = tmp_path / "run"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for step, r in enumerate(metrics, start=1):
        even = len({s["prompt"] for s in samples if s["step"] == step and int(s["prompt"][0]) % 2 == 0})
        assert r["selection/hint_rerolls"] >= even > 0  # every even-prompt group, and odd ones all wrong by chance
        assert r["selection/hint_missing"] == 0 and r["loss"] == r["loss"] and r["train/nonfinite"] == 0
    before = AutoModelForCausalLM.from_pretrained(run / "base_model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000002").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_hinted_prompts_must_fit_the_context(tiny_cfg):
    from posttrain.run.setup import check_context

    task, tok = ArithmeticTask(digits=2), build_char_tokenizer(ArithmeticTask(digits=2).alphabet)
    check_context(tiny_cfg("rollout.driver=hint_reroll", 'rollout.driver_params={preamble="="}'), task, tok, 48)
    with pytest.raises(ConfigError, match="shorten rollout.driver_params.preamble"):  # the paper's preamble: ~100 chars
        check_context(tiny_cfg("rollout.driver=hint_reroll"), task, tok, 48)


@pytest.mark.parametrize("lam", [1.0, 2.0])
def test_aapo_scales_rerolled_groups_loss_by_affinity_to_the_lambda(lam, tiny_cfg, tmp_path):
    # HINT's AAPO (catalog 3.1): loss <- loss * Affinity.detach()^lambda for re-rolled groups only.
    # Two epochs over one batch: in epoch 1 the policy is the one that made the old log-probs (ratio 1,
    # Affinity 1); in epoch 2 it has moved, so the re-rolled group's loss shrinks by Affinity^lambda.
    from posttrain.diagnostics import affinity
    from posttrain.learn.update import policy_update
    from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
    from posttrain.rollout import HFEngine
    from posttrain.run.optim import make_optimizer
    from posttrain.train.loop_state import Phases

    cfg = tiny_cfg("rollout.driver=hint_reroll", "train.epochs=2",
                   f'algorithm.loss_weights=[{{name="aapo", params={{lam={lam}}}}}]')
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5=")]
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=5, n=4),
                                          seed=0)
    rows = [p for p in prompts for _ in range(4)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.9, -0.9, 0.4, -0.4])  # distinct: they identify the rows
    inputs = {"rewards": adv.clone(), "group_ids": torch.tensor([0] * 4 + [1] * 4),
              "hint_rerolled": torch.tensor([True] * 4 + [False] * 4)}  # group 0 was re-rolled
    parts = Phases.from_config(cfg).learn
    calls = []
    loss_fn, aggregate = parts.loss, parts.aggregate

    def loss_spy(logp, old, a, mask, **kw):
        out = loss_fn(logp, old, a, mask, **kw)
        calls.append({"logp": logp.detach(), "old": old, "adv": a, "mask": mask, "loss": out.detach()})
        return out

    def aggregate_spy(loss_NT, mask):
        calls[-1]["scaled"] = loss_NT.detach()
        return aggregate(loss_NT, mask)

    parts = replace(parts, loss=loss_spy, aggregate=aggregate_spy)
    opt = make_optimizer(model, 5e-2, (0.9, 0.99), 0.0)
    metrics = policy_update(model, None, opt, parts, LearnSettings.of(cfg), rows, rollouts, rollouts.loss_mask.float(),
                            adv, inputs,
                            tok.pad_token_id, 0)
    assert len(calls) == 2  # two epochs, one minibatch each
    weights = []
    for c in calls:
        row = torch.tensor([adv.tolist().index(a) for a in c["adv"].tolist()])  # epochs shuffle the rows
        m = c["mask"].bool() & (c["loss"].abs() > 1e-12)
        ratio = torch.where(m, c["scaled"] / torch.where(m, c["loss"], torch.ones_like(c["loss"])), torch.ones_like(m))
        g0, g1 = row < 4, row >= 4
        want = affinity(c["logp"][g0], c["old"][g0], c["mask"][g0], c["adv"][g0], eps=0.2)["affinity"] ** lam
        torch.testing.assert_close(ratio[g0][m[g0]], torch.full_like(ratio[g0][m[g0]], want), atol=1e-5, rtol=1e-5)
        assert (ratio[g1][m[g1]] == 1).all()  # the other group is untouched
        weights.append(want)
    assert weights[0] == pytest.approx(1.0, abs=1e-4)  # on-policy: Affinity 1
    assert weights[1] < 0.999  # the moved policy
    assert metrics["policy/aapo_weight"] == pytest.approx(sum(weights) / 2, abs=1e-4)


def test_aapo_is_a_loss_weight_that_couples_the_rows(tiny_cfg):
    # the driver's old option names its replacement; AAPO is off unless listed; its group weights: no micro-batches
    with pytest.raises(ConfigError, match=r"'rollout.driver_params.affinity_lambda' has moved: use "
                                          r"algorithm.loss_weights = \[\{ name = \"aapo\""):
        tiny_cfg("rollout.driver=hint_reroll", "rollout.driver_params={affinity_lambda=2.0}")
    assert tiny_cfg("rollout.driver=hint_reroll", "train.micro_batch_tokens=64").algorithm.loss_weights == []
    with pytest.raises(ConfigError, match=r"loss_weights\[0\] = 'aapo' couples the rows"):
        tiny_cfg("rollout.driver=hint_reroll", "train.micro_batch_tokens=64", 'algorithm.loss_weights=[{name="aapo"}]')
    with pytest.raises(ConfigError, match=r"'aapo' runs with the driver\(s\) \['hint_reroll'\] only"):
        tiny_cfg('algorithm.loss_weights=[{name="aapo"}]')  # only the re-roll driver marks re-rolled groups
