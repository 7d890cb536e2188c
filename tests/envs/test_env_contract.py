"""What every built-in environment promises (posttrain/envs/base.py), checked on each of them."""

from __future__ import annotations

import pytest

from posttrain.envs import ENVS, make_env
from posttrain.envs.base import StepResult
from posttrain.models.tiny import build_char_tokenizer

# (name, params, fits the tiny model's 256 positions)
CASES = [
    ("guess_number", {}, True),
    ("guess_number", {"high": 8, "noise": 0.7}, True),
    ("retry_arith", {}, True),
    ("retry_arith", {"digits": 3, "ops": "+*", "noise": 0.7}, True),
    ("retry_arith", {"reverse": False, "turn_discount": 0.5}, True),
    ("calc_tool", {}, True),
    ("calc_tool", {"digits": 4, "noise": 0.5}, True),
    ("calc_tool", {"syntax": "hermes"}, False),
    ("grid", {}, True),
    ("grid", {"size": 4, "noise": 0.3}, True),
    ("grid", {"size": 4, "holes": 5}, True),
    ("json_tools", {"announce": "brief", "parser": "llama3_json"}, True),
    ("json_tools", {"announce": "brief", "parser": "llama3_json", "results": "text", "noise": 0.5}, False),
    ("json_tools", {"form": "parallel", "parser": "mistral", "noise": 0.5}, False),
    ("json_tools", {"parser": "compact", "tools": ["calculator"], "announce": "brief"}, True),
]
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)]


def _replay(env, example, transcript):
    """Step a fresh episode through the transcript's assistant turns; return the rebuilt transcript,
    the step results and the state key before each turn.
    """
    ep = env.start(example)
    messages = list(ep.reset())
    results, keys = [], []
    for m in transcript[len(messages):]:
        if m["role"] != "assistant":
            continue
        keys.append(ep.state_key())
        res = ep.step(m["content"])
        assert isinstance(res, StepResult)
        messages += [m, *res.messages]
        results.append(res)
        if res.done:
            break
    while messages[-1]["role"] != "assistant":  # a transcript cut at the turn limit ends with the policy
        messages.pop()
    return messages, results, keys


def test_all_registered():
    assert {"guess_number", "retry_arith", "calc_tool", "grid", "code_feedback", "json_tools", "textarena",
            "gym_text"} <= set(ENVS.names())


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted: size, holes, noise"):
        make_env("grid", {"slippery": True})


@pytest.mark.parametrize(("name", "params", "tiny"), CASES, ids=IDS)
def test_examples_are_deterministic(name, params, tiny):
    env = make_env(name, params)
    a, b = env.examples("train", 12, 5), env.examples("train", 12, 5)
    assert a == b
    assert a[:4] == env.examples("train", 4, 5)  # a prefix (sample_split)
    assert a != env.examples("train", 12, 6)
    for ex in a[:4]:
        assert env.start(ex).reset() == env.start(ex).reset()
        assert env.demonstration(ex, 3) == env.demonstration(ex, 3)
        transcript = env.demonstration(ex, 3)
        assert _replay(env, ex, transcript)[0] == _replay(env, ex, transcript)[0]


@pytest.mark.parametrize(("name", "params", "tiny"), [c for c in CASES if c[0] != "guess_number"],
                         ids=[i for i in IDS if not i.startswith("guess")])
def test_splits_are_disjoint(name, params, tiny):
    # (guess_number's prompt is the same for every number: both splits hold every hidden number, by design)
    env = make_env(name, params)
    train = {ex.prompt for ex in env.examples("train", 300, 0)}
    test = {ex.prompt for ex in env.examples("test", 30, 0)}
    assert train and test and not train & test


@pytest.mark.parametrize(("name", "params", "tiny"), CASES, ids=IDS)
def test_alphabet_covers_prompts_replies_and_demonstrations(name, params, tiny):
    env = make_env(name, params)
    assert env.alphabet == "".join(sorted(set(env.alphabet)))
    allowed = set(env.alphabet)
    for i, ex in enumerate(env.examples("train", 30, 1) + env.examples("test", 5, 1)):
        assert set(ex.prompt + ex.answer + ex.demonstration) <= allowed, ex
        for m in env.demonstration(ex, i):
            assert set(m["content"]) <= allowed, m


@pytest.mark.parametrize(("name", "params", "tiny"), CASES, ids=IDS)
def test_demonstrations_replay_and_the_clean_expert_solves(name, params, tiny):
    env = make_env(name, params)
    clean = make_env(name, {**params, "noise": 0.0}) if "noise" in params else env
    for i, ex in enumerate(env.examples("train", 20, 2)):
        for e in (env, clean):
            transcript = e.demonstration(ex, i)
            assert transcript[0]["role"] in ("system", "user") and transcript[-1]["role"] == "assistant"
            assert transcript[: len(e.start(ex).reset())] == e.start(ex).reset()
            assert sum(m["role"] == "assistant" for m in transcript) <= e.max_turns
            rebuilt, results, _ = _replay(e, ex, transcript)
            assert rebuilt == transcript  # the expert's transcript is what the environment answers
        # the noiseless expert solves every episode, with its first action the example's demonstration
        transcript = clean.demonstration(ex, i)
        _, results, _ = _replay(clean, ex, transcript)
        assert results[-1].done and results[-1].info["success"] == 1.0 and results[-1].reward > 0
        assert transcript[len(clean.start(ex).reset())]["content"] == ex.demonstration


@pytest.mark.parametrize(("name", "params", "tiny"), CASES, ids=IDS)
def test_state_keys_collide_for_the_same_actions(name, params, tiny):
    env = make_env(name, params)
    ex = env.examples("train", 1, 3)[0]
    transcript = env.demonstration(ex, 0)
    _, _, keys_a = _replay(env, ex, transcript)
    _, _, keys_b = _replay(env, ex, transcript)
    assert keys_a == keys_b and all(isinstance(k, str) for k in keys_a)
    if len(keys_a) > 1:
        assert keys_a[0] != keys_a[1]  # the situation changed after the first turn


@pytest.mark.parametrize(("name", "params", "tiny"), [c for c in CASES if c[2]], ids=[
    i for i, c in zip(IDS, CASES, strict=True) if c[2]])
def test_demonstrations_fit_the_tiny_model(name, params, tiny):
    env = make_env(name, params)
    tok = build_char_tokenizer(env.alphabet)
    longest = 0
    for i, ex in enumerate(env.examples("train", 40, 4)):
        ids = tok.apply_chat_template(env.demonstration(ex, i), tokenize=True, return_dict=False)
        assert isinstance(ids, list) and len(ids) > len(ex.prompt)
        assert tok.unk_token_id not in ids
        longest = max(longest, len(ids))
    assert longest <= 256, longest


@pytest.mark.parametrize(("name", "params", "tiny"), CASES, ids=IDS)
def test_garbage_actions_never_raise(name, params, tiny):
    env = make_env(name, params)
    ex = env.examples("train", 1, 0)[0]
    for action in ["", " ", "\n", "?" * 500, "<tool_call>{", "=", "!python", "-1", "1" * 5000, "\x00", "é"]:
        ep = env.start(ex)
        ep.reset()
        res = ep.step(action)
        assert isinstance(res, StepResult)
        assert all(isinstance(v, float) for v in res.info.values())


# Adapters of outside games (no expert, so no demonstrations): seeded problems; a garbage action is a move, or
# (a bug of the game) an error naming it, which the driver scores None.
NO_EXPERT = [("textarena", {"game": g}) for g in ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Blackjack-v0")]


@pytest.mark.parametrize(("name", "params"), NO_EXPERT, ids=[p["game"] for _, p in NO_EXPERT])
def test_adapters_are_seeded_and_take_garbage(name, params):
    pytest.importorskip("textarena")
    env = make_env(name, params)
    a = env.examples("train", 6, 5)
    assert a == env.examples("train", 6, 5) and a[:2] == env.examples("train", 2, 5)
    for ex in a[:2]:
        assert env.start(ex).reset() == env.start(ex).reset()
    for action in ["", " ", "\n", "?" * 500, "[", "]]", "-1", "1" * 5000, "\x00", "é"]:
        ep = env.start(a[0])
        ep.reset()
        try:
            res = ep.step(action)
        except RuntimeError as e:  # the game's own bug (GuessTheNumber: int() of 5000 digits) ends it as an error
            assert str(e).startswith(f"textarena game {params['game']!r}") and "raised in step" in str(e)
            continue
        assert isinstance(res, StepResult) and isinstance(ep.state_key(), str)
        assert all(isinstance(v, float) for v in res.info.values())
