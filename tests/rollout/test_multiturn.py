"""The multi-turn driver's token bookkeeping, with a scripted engine: masks, turn ids, rewards, stops,
environment failures, and the sampled ids kept where decode-then-encode would change them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from posttrain.envs.base import StepResult
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.chat_delta import ChatDelta, TemplateError
from posttrain.rollout.multiturn import Limits, pack, run_episodes, state_id

TOK = build_char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz ,!?")
LP = -0.25  # every scripted token's behaviour log-prob


class ScriptedEngine:
    """Returns the scripted actions of each round, row by row ('|' at the end: cut without EOS)."""

    def __init__(self, tokenizer, rounds: list[list[str]]) -> None:
        self.tok, self.rounds, self.pad_id, self.version = tokenizer, list(rounds), tokenizer.pad_token_id, 3
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompts, sampling, seed=None):
        actions = self.rounds.pop(0)
        assert len(actions) == len(prompts), (actions, len(prompts))
        self.prompts.append([list(p) for p in prompts])
        rows = []
        for a in actions:
            ids = self.tok(a.rstrip("|"), add_special_tokens=False)["input_ids"] if a.rstrip("|") else []
            rows.append(ids + ([] if a.endswith("|") else [self.tok.eos_token_id]))
        rows = [r[: sampling.max_new_tokens] for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id)
        mask = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1.0
        return Rollout.single_turn(prompts, ids, mask, mask * LP, torch.tensor([self.tok.eos_token_id in r
                                   for r in rows]), [""] * len(rows), 1, self.version)


@dataclass
class Guess:
    """Reply 'no' until the action is the secret; reward 1 and done then. 'boom' raises, 'hang' sleeps."""

    secret: str = "7"
    turns: int = 0

    def reset(self):
        return [{"role": "user", "content": "guess"}]

    def step(self, action):
        self.turns += 1
        if action == "boom":
            raise RuntimeError("environment bug")
        if action == "hang":
            time.sleep(5)
        if action == self.secret:
            return StepResult(reward=1.0, done=True, info={"success": 1.0, "tool_calls": 2.0})
        return StepResult(messages=({"role": "user", "content": "no"},), reward=-0.5 * (action == "x"))

    def state_key(self):
        return f"t{self.turns}"


DEFAULT_LIMITS = Limits(max_turns=3, max_tokens=40)


def run(rounds, n_eps=2, limits=DEFAULT_LIMITS, tok=TOK):
    engine, delta = ScriptedEngine(tok, rounds), ChatDelta(tok)
    eps = [Guess() for _ in range(n_eps)]
    first = [e.reset() for e in eps]
    prompt = delta.prompt_ids(first[0])
    recs = run_episodes(engine, delta, eps, [prompt] * n_eps, first, SamplingParams(max_new_tokens=8), limits,
                        seed_of=lambda r: r)
    return engine, delta, recs, prompt


def ids(text, tok=TOK):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_masks_turn_ids_logprobs_and_rewards_exactly():
    # episode 0: "3" -> no, "x" -> no (-0.5), "7" -> done (1.0); episode 1: "7" -> done at once
    engine, delta, recs, prompt = run([["3", "7"], ["x"], ["7"]])
    eos, ctx = TOK.eos_token_id, ids("<|user|>no<|assistant|>")
    assert delta.context_ids([{"role": "user", "content": "no"}]) == ctx
    assert engine.prompts[1] == [prompt + ids("3") + [eos] + ctx]  # round 2 samples from the ids it has, only ep 0
    assert [r.end for r in recs] == ["done", "done"]
    assert [r.reward for r in recs] == [0.0 - 0.5 + 1.0, 1.0]
    assert recs[0].info == {"success": 1.0, "tool_calls": 2.0}
    rollouts, turns = pack(recs, [prompt], 2, 3, TOK.pad_token_id, version=3)
    row0 = ids("3") + [eos] + ctx + ids("x") + [eos] + ctx + ids("7") + [eos]
    L = len(row0)  # 2 + 4 + 2 + 4 + 2 = 14 (the context: <|user|> n o <|assistant|>)
    assert rollouts.token_ids[0, :L].tolist() == row0 and rollouts.token_ids.shape == (2, L)
    action = [1.0, 1.0] + [0.0] * 4
    assert rollouts.loss_mask[0].tolist() == action + action + [1.0, 1.0]
    assert rollouts.attention_mask[0].tolist() == [1.0] * L
    assert rollouts.turn_ids[0].tolist() == [0, 0, -1, -1, -1, -1, 1, 1, -1, -1, -1, -1, 2, 2]
    assert rollouts.behaviour_logprobs[0].tolist() == [LP * m for m in rollouts.loss_mask[0].tolist()]
    assert rollouts.loss_mask[1].tolist() == [1.0, 1.0] + [0.0] * (L - 2)  # right padding is neither
    assert rollouts.turn_ids[1].tolist() == [0, 0] + [-1] * (L - 2)
    assert rollouts.lengths.tolist() == [6, 2]  # sampled tokens only
    assert rollouts.policy_version.tolist() == [3, 3]
    assert turns.rewards.tolist() == [[[0.0, -0.5, 1.0], [1.0, 0.0, 0.0]]]
    assert turns.mask.tolist() == [[[True, True, True], [True, False, False]]]
    # the state before each turn: t0, t1, t2 (episode 1 only t0, the same key as episode 0's first)
    assert turns.state_ids[0, 0].tolist() == [state_id("t0"), state_id("t1"), state_id("t2")]
    assert turns.state_ids[0, 1].tolist() == [state_id("t0"), -1, -1]
    assert rollouts.texts[0] == "assistant: 3\nuser: no\nassistant: x\nuser: no\nassistant: 7"


def test_max_turns_length_and_budget_end_an_episode_with_their_reason():
    _, _, recs, _ = run([["3", "4"], ["5", "6"], ["8", "9"]])  # never right: 3 turns
    assert [r.end for r in recs] == ["max_turns", "max_turns"] and len(recs[0].turns) == 3
    _, _, recs, _ = run([["3|", "7"]])  # a turn without EOS is cut: the environment never sees it
    assert [r.end for r in recs] == ["length", "done"] and recs[0].reward == 0.0
    # budget 7 after the prompt: "3"+EOS (2) + context (4) leaves 1 token; "45"+EOS is cut to "4"
    _, _, recs, _ = run([["3", "7"], ["45"]], limits=Limits(max_turns=3, max_tokens=7))
    assert recs[0].end == "budget" and recs[0].turns[1].action_ids == ids("4") and recs[0].held == 7
    # budget 5: the reply after turn 0 does not fit with room for one more token
    _, _, recs, _ = run([["3", "7"]], limits=Limits(max_turns=3, max_tokens=6))
    assert recs[0].end == "budget" and len(recs[0].turns) == 1


def test_a_failing_or_hanging_environment_scores_its_episode_none_and_the_rest_go_on():
    t0 = time.monotonic()
    _, _, recs, _ = run([["boom", "hang", "3"], ["7"]], n_eps=3, limits=Limits(3, 40, step_timeout_s=0.5))
    assert time.monotonic() - t0 < 3  # the hung step was abandoned at its deadline, not waited for
    assert [r.end for r in recs] == ["error", "timeout", "done"]
    assert recs[0].reward is None and "RuntimeError: environment bug" in recs[0].error
    assert recs[1].reward is None and recs[2].reward == 1.0


def _merge_heavy_tokenizer() -> PreTrainedTokenizerFast:
    chars = list("abgusertox")
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<u>", "<a>", *chars, "ab"])}
    bpe = models.BPE(vocab=vocab, merges=[("a", "b")], unk_token=None)
    tok = Tokenizer(bpe)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   additional_special_tokens=["<u>", "<a>"])
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<a>{{ m['content'] }}<eos>"
                          "{% else %}<u>{{ m['content'] }}{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<a>{% endif %}")
    return fast


class _ByIds(ScriptedEngine):
    """Samples the ids 'a', 'b' as two tokens (a merge-heavy tokenizer encodes their text as one)."""

    def generate(self, prompts, sampling, seed=None):
        a, b, eos = (self.tok.convert_tokens_to_ids(t) for t in ("a", "b", "<eos>"))
        ids = torch.tensor([[a, b, eos]] * len(prompts))
        mask = torch.ones(len(prompts), 3)
        return Rollout.single_turn(prompts, ids, mask, mask * LP, torch.ones(len(prompts), dtype=torch.bool),
                                   [""] * len(prompts), 1, 0)


def test_sampled_ids_are_kept_where_decode_then_encode_would_change_them():
    tok = _merge_heavy_tokenizer()
    a, b, ab = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "ab"))
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ab]  # re-encoding the text merges the pair
    delta = ChatDelta(tok)
    ep = Guess(secret="zz")
    recs = run_episodes(_ByIds(tok, []), delta, [ep], [delta.prompt_ids(ep.reset())], [ep.reset()],
                        SamplingParams(max_new_tokens=4), Limits(2, 30), seed_of=lambda r: r)
    rollouts, _ = pack(recs, [delta.prompt_ids(ep.reset())], 1, 2, tok.pad_token_id, 0)
    row = rollouts.token_ids[0][rollouts.loss_mask[0] > 0].tolist()
    assert row == [a, b, tok.eos_token_id] * 2  # what was sampled, twice; never [ab]
    assert recs[0].messages[1] == {"role": "assistant", "content": "ab"}  # the environment read the text


def test_chat_delta_puts_template_glue_after_eos_in_the_context_and_rejects_a_rewriting_template():
    chatml = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz\n<|>_")
    chatml.chat_template = ("{% for m in messages %}<|user|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|user|>assistant\n{% endif %}")
    glue = ChatDelta(chatml).context_ids([{"role": "user", "content": "hi"}])
    assert chatml.decode(glue) == "\n<|user|>user\nhi<|eos|>\n<|user|>assistant\n"  # the "\n" after EOS is context
    rewriting = build_char_tokenizer("abc")  # drops every assistant turn but the last (a "think" dropper)
    rewriting.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                               "<|user|>{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        ChatDelta(rewriting)
    no_template = build_char_tokenizer("abc")
    no_template.chat_template = None
    with pytest.raises(TemplateError, match="need a chat template"):
        ChatDelta(no_template)


def test_a_transcript_is_laid_out_exactly_as_the_driver_lays_out_the_same_episode():
    # SFT on an expert transcript must train the row the driver would build had the policy sampled it
    _, delta, recs, prompt = run([["3", "7"], ["x"], ["7"]])
    rollouts, _ = pack(recs, [prompt], 2, 3, TOK.pad_token_id, version=0)
    p, ids_, mask = delta.transcript_ids(recs[0].messages)
    L = len(ids_)
    assert p == prompt
    assert ids_ == rollouts.token_ids[0, :L].tolist() and mask == rollouts.loss_mask[0, :L].tolist()
    with pytest.raises(ValueError, match="at least one assistant turn"):
        delta.transcript_ids([{"role": "user", "content": "guess"}])


def test_turn_advantage_share_counts_the_turns_credit_reaches():
    from posttrain.rollout.multiturn import turn_advantage_share

    turn_ids = torch.tensor([[0, 0, -1, 1, 1, -1], [0, -1, 1, -1, 2, 2]])
    # row 0: turn 0 has 0.5, turn 1 has 0 -> 1 of 2; row 1: turns 0 and 2 nonzero, turn 1 zero -> 2 of 3
    adv = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0, -0.1, -0.1]])
    assert turn_advantage_share(adv, turn_ids) == 3 / 5
    assert turn_advantage_share(torch.tensor([1.0, 0.0]), turn_ids) == 2 / 5  # one number an episode


def test_episode_evaluation_counts_the_share_solved_within_each_turn():
    # three problems, greedy, one episode each: solved at turn 1, solved at turn 3, never solved in 3 turns;
    # solved_within/1 = 1/3, /2 = 1/3, /3 = 2/3 (= mean@1); turns_to_solve = (1 + 3) / 2
    from posttrain.evaluation.episodes import evaluate_episodes
    from posttrain.tasks.base import Example

    class Source:
        max_turns, max_tokens, step_timeout_s = 3, 40, 5.0

        def start(self, example):
            ep = Guess()
            return ep, ep.reset()

    engine = ScriptedEngine(TOK, [["7", "1", "1"], ["2", "2"], ["7", "3"]])
    examples = [Example(prompt=f"p{i}", answer="7", demonstration="7") for i in range(3)]
    m, problems = evaluate_episodes(engine, TOK, Source(), examples, max_new_tokens=8)
    assert m["pass@1"] == pytest.approx(2 / 3) and m["turns_to_solve"] == 2.0
    assert [m[f"solved_within/{t}"] for t in (1, 2, 3)] == pytest.approx([1 / 3, 1 / 3, 2 / 3])
    assert "solved_within/4" not in m
    assert [p["ends"] for p in problems] == [["done"], ["done"], ["max_turns"]]
