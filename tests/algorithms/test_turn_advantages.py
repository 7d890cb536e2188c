"""Tests for the turn-level advantage estimators (posttrain.algorithms.advantages.turns).

Worked numbers from the method catalog (3.17, L137, L159, L207, L221) and research-agents.md section 2,
with the arithmetic in comments; invariants (absent turns and context tokens get 0, K = 1 reductions);
loop references written after the authors' code (KernelGYM, verl-agent, HiPER) on random batches.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from posttrain.algorithms import advantages as adv

T = torch.tensor
TURN_ENTRIES = ("trloo", "gigpo", "mars_turn", "uis1", "turn_ppo", "hiper")


def close(x: torch.Tensor, expected: list, atol: float = 1e-4) -> None:
    torch.testing.assert_close(x, T(expected, dtype=x.dtype), atol=atol, rtol=0)


def full(p: int, g: int, k: int) -> torch.Tensor:
    return torch.ones(p, g, k, dtype=torch.bool)


def layout(turn_mask: torch.Tensor, tokens_per_turn: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """turn_ids and mask of packed rows: 2 prompt tokens, then per reached turn k its action tokens
    (turn id k, mask 1) and one environment-reply token (-1, mask 0); padding -1 to the longest row."""
    p, g, k = turn_mask.shape
    t = 2 + k * (tokens_per_turn + 1)
    turn_ids = torch.full((p, g, t), -1, dtype=torch.long)
    for i in range(p):
        for j in range(g):
            pos = 2
            for kk in range(k):
                if turn_mask[i, j, kk]:
                    turn_ids[i, j, pos : pos + tokens_per_turn] = kk
                    pos += tokens_per_turn + 1
    return turn_ids, (turn_ids >= 0).float()


def random_batch(seed: int, p: int = 3, g: int = 4, k: int = 4) -> dict[str, torch.Tensor]:
    """Every turn-level input for episodes of 1..K turns (each group mixes turn counts)."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.randint(1, k + 1, (p, g), generator=gen)
    n[:, 0], n[:, 1] = k, 1  # every group holds a full-length and a one-turn episode
    turn_mask = torch.arange(k) < n.unsqueeze(-1)
    turn_rewards = torch.where(turn_mask, torch.randint(0, 3, (p, g, k), generator=gen).float() / 2, 0.0)
    turn_ids, mask = layout(turn_mask)
    return {
        "rewards": turn_rewards.sum(-1),
        "turn_rewards": turn_rewards,
        "turn_mask": turn_mask,
        "turn_ids": turn_ids,
        "mask": mask,
        "state_ids": torch.where(turn_mask, torch.randint(-1, 4, (p, g, k), generator=gen), -1),
        "agent_ids": torch.randint(0, 2, (p, g, k), generator=gen),
        "expert_match": torch.rand(p, g, k, generator=gen) > 0.3,
        "turn_values": torch.rand(p, g, k + 1, generator=gen),
        "turn_values_low": torch.rand(p, g, k, generator=gen),
        "turn_values_high": torch.rand(p, g, k + 1, generator=gen),
        "switch": torch.rand(p, g, k, generator=gen) > 0.5,
        "subgoal_mask": (torch.rand(p, g, 2 + 3 * k, generator=gen) > 0.5).float(),
    }


def turn_level(name: str, b: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The pure [P, G, K] function(s) behind registry entry ``name``."""
    r, m = b["turn_rewards"], b["turn_mask"]
    if name == "trloo":
        return [adv.trloo_turns(r, m)]
    if name == "gigpo":
        return [adv.gigpo_turns(b["rewards"], r, m, b["state_ids"])]
    if name == "mars_turn":
        return [adv.mars_turns(r, m, b["agent_ids"])]
    if name == "uis1":
        return [adv.uis1_turns(r, m, b["expert_match"])]
    if name == "turn_ppo":
        return list(adv.turn_gae(r, b["turn_values"], m))
    return list(adv.hiper_turns(r, m, b["turn_values_low"], b["turn_values_high"], b["switch"]))


# --------------------------------------------------------------------------- contract and invariants


def test_required_inputs_are_keyword_only_without_defaults():
    # the loop reads REGISTRY.required(name) to know which inputs to provide
    req = {n: set(adv.REGISTRY.required(n)) for n in TURN_ENTRIES}
    base = {"turn_rewards", "turn_mask", "turn_ids", "mask"}
    assert req["trloo"] == base
    assert req["gigpo"] == base | {"state_ids"}
    assert req["mars_turn"] == base | {"agent_ids"}
    assert req["uis1"] == base | {"expert_match"}
    assert req["turn_ppo"] == base | {"turn_values"}
    assert req["hiper"] == base | {"turn_values_low", "turn_values_high", "switch"}
    assert "subgoal_mask" in adv.REGISTRY.params("hiper")


@pytest.mark.parametrize("name", TURN_ENTRIES)
def test_absent_turns_context_and_padding_get_zero(name):
    b = random_batch(0)
    out = adv.compute(name, b["rewards"], **{k: v for k, v in b.items() if k != "rewards"})
    assert out.shape == b["mask"].shape and torch.isfinite(out).all() and not out.requires_grad
    assert (out[b["turn_ids"] < 0] == 0).all()  # prompt, environment replies, padding
    assert (out[b["mask"] == 0] == 0).all()
    for a in turn_level(name, b):
        assert a.shape == b["turn_mask"].shape
        assert (a[~b["turn_mask"]] == 0).all()  # absent turns


@pytest.mark.parametrize("name", TURN_ENTRIES)
def test_token_advantage_is_the_turn_advantage_on_every_sampled_token(name):
    b = random_batch(1)
    out = adv.compute(name, b["rewards"], **{k: v for k, v in b.items() if k not in ("rewards", "subgoal_mask")})
    a = turn_level(name, b)[0]
    on = b["turn_ids"] >= 0
    idx = on.nonzero(as_tuple=True)
    torch.testing.assert_close(out[idx], a[idx[0], idx[1], b["turn_ids"][idx]])


def test_turn_returns_discount_valid_turns_only():
    r = T([[[0.0, 0.0, 1.0, 5.0]]])
    m = T([[[True, True, True, False]]])  # the 5.0 sits on an absent turn: ignored
    # G_2 = 1; G_1 = 0 + 0.9 * 1 = 0.9; G_0 = 0 + 0.9 * 0.9 = 0.81
    close(adv.turn_returns(r, m, 0.9), [[[0.81, 0.9, 1.0, 0.0]]])


def test_turn_returns_reset_cuts_the_chain_as_uis1():
    r = T([[[1.0, 1.0, 1.0]]])
    m = full(1, 1, 3)
    # no reset, gamma 0.5: G_2 = 1; G_1 = 1 + 0.5 = 1.5; G_0 = 1 + 0.75 = 1.75
    close(adv.turn_returns(r, m, 0.5), [[[1.75, 1.5, 1.0]]])
    # turn 1 missed the expert: G_1 = r_1 = 1 and turn 0 sees 0 (UI-S1 sets running_return = 0):
    # G_2 = 1; G_1 = 1; G_0 = 1 + 0.5 * 0 = 1
    close(adv.turn_returns(r, m, 0.5, reset=T([[[False, True, False]]])), [[[1.0, 1.0, 1.0]]])


def test_group_center_modes_and_groups():
    v = T([[1.0, 2.0, 3.0, 10.0]])
    keys = T([[0, 0, 0, 1]])
    m = torch.ones(1, 4, dtype=torch.bool)
    # key 0: mean 2 -> [-1, 0, 1]; key 1 is a singleton -> 0
    close(adv.group_center(v, keys, m), [[-1.0, 0.0, 1.0, 0.0]])
    # leave-one-out: N/(N-1) (v - mean) = 1.5 * [-1, 0, 1]; a singleton keeps its value
    close(adv.group_center(v, keys, m, leave_one_out=True), [[-1.5, 0.0, 1.5, 10.0]])
    # unbiased std of {1, 2, 3} = 1; population std = sqrt(2/3) = 0.816497 -> 1 / 0.816497 = 1.224745
    close(adv.group_center(v, keys, m, std="unbiased"), [[-1.0, 0.0, 1.0, 0.0]])
    close(adv.group_center(v, keys, m, std="population"), [[-1.224745, 0.0, 1.224745, 0.0]])
    # a masked entry is out of the group and gets 0: key 0 = {1, 2}, mean 1.5
    close(adv.group_center(v, keys, T([[True, True, False, True]])), [[-0.5, 0.5, 0.0, 0.0]])
    # the same key in two prompts makes two groups
    close(adv.group_center(T([[1.0, 3.0], [10.0, 20.0]]), T([[7, 7], [7, 7]]), torch.ones(2, 2, dtype=torch.bool)),
          [[-1.0, 1.0], [-5.0, 5.0]])
    with pytest.raises(ValueError, match="leave_one_out"):
        adv.group_center(v, keys, m, leave_one_out=True, std="unbiased")


def test_broadcast_turns_maps_tokens_to_their_turn():
    a = T([[[0.5, -1.0]]])
    turn_ids = T([[[-1, -1, 0, 0, -1, 1, 1, 1, -1]]])
    mask = T([[[0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]]])  # the last turn-1 token is masked out
    close(adv.broadcast_turns(a, turn_ids, mask), [[[0, 0, 0.5, 0.5, 0, -1, -1, 0, 0]]])
    with pytest.raises(ValueError, match="K = 2"):
        adv.broadcast_turns(a, T([[[0, 2]]]), torch.ones(1, 1, 2))


# --------------------------------------------------------------------------- TRLOO


def test_trloo_catalog_3_17():
    # A = [0, 1], B = [0, 0], gamma 1 -> returns A [1, 1], B [0, 0];
    # turn 0 and turn 1 (N = 2): A = 1 - 0 = 1, B = 0 - 1 = -1
    r, m = T([[[0.0, 1.0], [0.0, 0.0]]]), full(1, 2, 2)
    close(adv.trloo_turns(r, m), [[[1.0, 1.0], [-1.0, -1.0]]])
    turn_ids, mask = layout(m)
    out = adv.compute("trloo", r.sum(-1), turn_rewards=r, turn_mask=m, turn_ids=turn_ids, mask=mask)
    close(out[0, 0], [0, 0, 1, 1, 0, 1, 1, 0])  # prompt, turn 0, reply, turn 1, reply
    close(out[0, 1], [0, 0, -1, -1, 0, -1, -1, 0])


def test_trloo_single_turn_equals_rloo():
    # [1, 0, 0, 1]: 1 - (0 + 0 + 1)/3 = 0.666667 and 0 - 2/3 = -0.666667, RLOO's numbers
    rewards = T([[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 1.0]])
    a = adv.trloo_turns(rewards.unsqueeze(-1), full(2, 4, 1))
    close(a[0, :, 0], [0.666667, -0.666667, -0.666667, 0.666667])
    torch.testing.assert_close(a[..., 0], adv.rloo(rewards))


def test_trloo_variable_turn_counts():
    # research-agents.md section 2: A = [0, 1], B = [0] (stopped after one turn), C = [0, 0]; gamma 1
    # returns A [1, 1], B [0], C [0, 0]
    # turn 0 (N = 3): A = 1 - (0 + 0)/2 = 1; B = 0 - (1 + 0)/2 = -0.5; C = 0 - (1 + 0)/2 = -0.5
    # turn 1 (N = 2, B absent): A = 1 - 0 = 1; C = 0 - 1 = -1
    r = T([[[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]])
    m = T([[[True, True], [True, False], [True, True]]])
    close(adv.trloo_turns(r, m), [[[1.0, 1.0], [-0.5, 0.0], [-0.5, -1.0]]])


def test_trloo_lone_episode_at_a_turn_keeps_its_return():
    # only A reaches turn 1 (N = 1): A = G = 1 (KernelGYM: no other sample, baseline 0)
    r, m = T([[[0.0, 1.0], [1.0, 0.0]]]), T([[[True, True], [True, False]]])
    # turn 0: returns A 1, B 1 -> 0, 0
    close(adv.trloo_turns(r, m), [[[0.0, 1.0], [0.0, 0.0]]])


def test_trloo_credits_turns_where_grpo_sees_one_number_per_episode():
    # A earns its reward on turn 0, B on turn 1: equal episode rewards, so GRPO gives both 0.
    # returns A [1, 0], B [1, 1]; turn 0: 1 - 1 = 0 for both; turn 1: A 0 - 1 = -1, B 1 - 0 = 1
    r, m = T([[[1.0, 0.0], [0.0, 1.0]]]), full(1, 2, 2)
    close(adv.grpo(r.sum(-1)), [[0.0, 0.0]])
    close(adv.trloo_turns(r, m), [[[0.0, -1.0], [0.0, 1.0]]])


def trloo_loop(r: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """KernelGYM's compute_multi_turn_rloo_outcome_advantage, on [P, G, K] arrays."""
    p, g, k = r.shape
    ret = torch.zeros_like(r)
    for i in range(p):
        for j in range(g):
            run = 0.0
            for kk in reversed(range(k)):
                run = float(r[i, j, kk]) + gamma * run
                ret[i, j, kk] = run
    by_key = defaultdict(list)
    for i in range(p):
        for j in range(g):
            for kk in range(k):
                if m[i, j, kk]:
                    by_key[i, kk].append(float(ret[i, j, kk]))
    out = torch.zeros_like(r)
    for i in range(p):
        for j in range(g):
            for kk in range(k):
                if m[i, j, kk]:
                    vals = by_key[i, kk]
                    n = len(vals)
                    mean = sum(vals) / n
                    out[i, j, kk] = ret[i, j, kk] * n / (n - 1) - mean * n / (n - 1) if n > 1 else ret[i, j, kk]
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_trloo_matches_the_kernelgym_loop(gamma):
    b = random_batch(2)
    torch.testing.assert_close(
        adv.trloo_turns(b["turn_rewards"], b["turn_mask"], gamma=gamma),
        trloo_loop(b["turn_rewards"], b["turn_mask"], gamma),
    )


# --------------------------------------------------------------------------- GiGPO


def gigpo_example() -> tuple[torch.Tensor, ...]:
    # A visits s0, s1 with rewards [0, 1]; B s0, s2 with [0, 0]; C s0, s1, s3 with [0, 0, 1]
    r = T([[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    m = T([[[True, True, False], [True, True, False], [True, True, True]]])
    states = T([[[0, 1, -1], [0, 2, -1], [0, 1, 3]]])
    return r.sum(-1), r, m, states


def test_gigpo_worked_example_trajectory_weighting():
    rewards, r, m, states = gigpo_example()
    # gamma 0.5 returns: A [0.5, 1], B [0, 0], C [0.25, 0.5, 1]
    # episode term, mean over episodes (1 + 0 + 1)/3 = 2/3: A 0.3333, B -0.6667, C 0.3333
    # step term: anchor s0 = {0.5, 0, 0.25}, mean 0.25 -> A 0.25, B -0.25, C 0;
    #            anchor s1 = {A 1, C 0.5}, mean 0.75 -> A 0.25, C -0.25; s2, s3 singletons -> 0
    # A = [0.3333 + 0.25, 0.3333 + 0.25]; B = [-0.6667 - 0.25, -0.6667]; C = [0.3333, 0.3333 - 0.25, 0.3333]
    a = adv.gigpo_turns(rewards, r, m, states, gamma=0.5)
    close(a, [[[0.5833, 0.5833, 0.0], [-0.9167, -0.6667, 0.0], [0.3333, 0.0833, 0.3333]]])


def test_gigpo_worked_example_steps_weighting():
    rewards, r, m, states = gigpo_example()
    # episode mean over step rows (verl-agent, ROLL): (2 * 1 + 2 * 0 + 3 * 1)/7 = 5/7 = 0.7143
    # A^E = A 0.2857, B -0.7143, C 0.2857; the step term as above
    a = adv.gigpo_turns(rewards, r, m, states, gamma=0.5, episode_weighting="steps")
    close(a, [[[0.5357, 0.5357, 0.0], [-0.9643, -0.7143, 0.0], [0.2857, 0.0357, 0.2857]]])


def test_gigpo_single_turn_distinct_states_is_the_centred_episode_reward():
    rewards = T([[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 1.0]])
    states = torch.arange(8).view(2, 4, 1)  # every state is its own singleton anchor
    a = adv.gigpo_turns(rewards, rewards.unsqueeze(-1), full(2, 4, 1), states)
    torch.testing.assert_close(a[..., 0], adv.dr_grpo(rewards))


def test_gigpo_step_term_separates_actions_from_one_anchor():
    # Both episodes start in s0 and succeed (R = 1), so GRPO gives both 0; A reaches the goal in 2 turns,
    # B in 3. gamma 0.95: G_A0 = 0.95, G_B0 = 0.95^2 = 0.9025, anchor mean 0.92625 -> +0.02375, -0.02375.
    r = T([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    m = T([[[True, True, False], [True, True, True]]])
    states = T([[[0, 1, -1], [0, 2, 3]]])
    close(adv.grpo(r.sum(-1)), [[0.0, 0.0]])
    close(adv.gigpo_turns(r.sum(-1), r, m, states), [[[0.02375, 0.0, 0.0], [-0.02375, 0.0, 0.0]]])
    # without state keys (-1) nothing is grouped: only the episode term (0 here) remains
    close(adv.gigpo_turns(r.sum(-1), r, m, torch.full_like(states, -1)), [[[0.0] * 3, [0.0] * 3]])


def test_gigpo_group_of_one_has_no_episode_term():
    r = T([[[0.0, 1.0]]])
    close(adv.gigpo_turns(r.sum(-1), r, full(1, 1, 2), T([[[0, 1]]])), [[[0.0, 0.0]]])


def gigpo_loop(rewards, r, m, states, gamma, mode, weighting, eps=1e-6):
    """verl-agent's episode_norm_reward / build_step_group / step_norm_reward, one row per reached turn."""
    rows = [(i, j, k) for i in range(r.shape[0]) for j in range(r.shape[1]) for k in range(r.shape[2]) if m[i, j, k]]
    ret = adv.turn_returns(r, m, gamma)
    ep = defaultdict(list)
    for i, j, k in rows:
        if weighting == "steps" or k == 0:  # trajectory: one score per episode
            ep[i].append(float(rewards[i, j]))
    step = defaultdict(list)
    for i, j, k in rows:
        if states[i, j, k] >= 0:
            step[i, int(states[i, j, k])].append(float(ret[i, j, k]))

    def norm(x, vals):
        if len(vals) == 1:
            return 0.0
        mean = sum(vals) / len(vals)
        if mode == "mean_norm":
            return x - mean
        return (x - mean) / (float(torch.tensor(vals).std()) + eps)

    out = torch.zeros_like(r)
    for i, j, k in rows:
        s = int(states[i, j, k])
        a_step = norm(float(ret[i, j, k]), step[i, s]) if s >= 0 else 0.0
        out[i, j, k] = norm(float(rewards[i, j]), ep[i]) + a_step
    return out


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("weighting", ["trajectory", "steps"])
def test_gigpo_matches_the_verl_agent_loop(mode, weighting):
    b = random_batch(3)
    a = adv.gigpo_turns(b["rewards"], b["turn_rewards"], b["turn_mask"], b["state_ids"], mode=mode,
                        episode_weighting=weighting)
    expected = gigpo_loop(b["rewards"], b["turn_rewards"], b["turn_mask"], b["state_ids"], 0.95, mode, weighting)
    torch.testing.assert_close(a, expected)


# --------------------------------------------------------------------------- MARS


def mars_example() -> tuple[torch.Tensor, ...]:
    # one self-play episode; player 0 acts on turns 0, 2, 4 ([0, 0.5, 1]), player 1 on 1, 3 ([0.2, -1.0])
    return T([[[0.0, 0.2, 0.5, -1.0, 1.0]]]), full(1, 1, 5), T([[[0, 1, 0, 1, 0]]])


def test_mars_catalog_l137():
    r, m, agents = mars_example()
    # gamma 0.9 over each player's own turns: player 0: G = [0 + 0.9 * 1.4, 0.5 + 0.9 * 1, 1] = [1.26, 1.40, 1.00],
    # mean 1.22 -> [0.04, 0.18, -0.22]; player 1: [0.2 - 0.9, -1.0] = [-0.70, -1.00], mean -0.85 -> [0.15, -0.15]
    close(adv.mars_turns(r, m, agents, gamma=0.9), [[[0.04, 0.15, 0.18, -0.15, -0.22]]])


def test_mars_mean_std_and_reward_centring():
    r, m, agents = mars_example()
    # player 0 deviations [0.04, 0.18, -0.22]: unbiased var (0.0016 + 0.0324 + 0.0484)/2 = 0.0412, std 0.202978;
    # player 1 deviations [0.15, -0.15]: std 0.212132
    close(adv.mars_turns(r, m, agents, gamma=0.9, norm="mean_std"),
          [[[0.197066, 0.707103, 0.886797, -0.707103, -1.083862]]])
    # center_rewards (gamma 1): player 0 rewards [0, 0.5, 1] - 0.5 = [-0.5, 0, 0.5] -> returns [0, 0.5, 0.5],
    # mean 1/3 -> [-0.3333, 0.1667, 0.1667]; player 1 [0.2, -1] + 0.4 = [0.6, -0.6] -> [0, -0.6] -> [0.3, -0.3]
    close(adv.mars_turns(r, m, agents, center_rewards=True), [[[-0.3333, 0.3, 0.1667, -0.3, 0.1667]]])


def test_mars_scope_batch_pools_prompts_per_agent():
    r = T([[[1.0]], [[0.0]]])  # two prompts, one single-turn episode each, one agent
    agents = torch.zeros(2, 1, 1, dtype=torch.long)
    # batch: mean 0.5 over both prompts -> [0.5, -0.5]; group: each prompt alone -> 0
    close(adv.mars_turns(r, full(2, 1, 1), agents), [[[0.5]], [[-0.5]]])
    close(adv.mars_turns(r, full(2, 1, 1), agents, scope="group"), [[[0.0]], [[0.0]]])


def test_mars_one_agent_is_batch_centred_turn_returns_and_whitening_option():
    b = random_batch(4)
    one = torch.zeros_like(b["agent_ids"])
    ret = adv.turn_returns(b["turn_rewards"], b["turn_mask"])
    expected = torch.where(b["turn_mask"], ret - ret[b["turn_mask"]].mean(), 0.0)
    torch.testing.assert_close(adv.mars_turns(b["turn_rewards"], b["turn_mask"], one), expected)
    kw = {k: v for k, v in b.items() if k != "rewards"}
    out = adv.compute("mars_turn", b["rewards"], **{**kw, "agent_ids": one}, whiten=True)
    tok = out[b["mask"] > 0]
    assert abs(float(tok.mean())) < 1e-5 and abs(float(tok.std()) - 1.0) < 1e-3  # unbiased token whitening


# --------------------------------------------------------------------------- UI-S1


def test_uis1_catalog_l207():
    # gamma 0.5; A: rewards [1, 1], both matched; B: [1, 0], step 1 missed the expert
    # returns: A [1 + 0.5 * 1, 1] = [1.5, 1]; B [1 + 0.5 * 0, 0] = [1, 0]
    # A_step: step 0 {1.5, 1}, mean 1.25 -> [0.25, -0.25]; step 1 {1, 0}, mean 0.5 -> [0.5, -0.5]
    # A_ep: scores [1, 1, 1, 0] (A0, A1, B0, B1), mean 0.75 -> [0.25, 0.25, 0.25, -0.75]
    # A = [0.25 + 0.25, 0.5 + 0.25, -0.25 + 0.25, -0.5 - 0.75] = [0.5, 0.75, 0, -1.25]
    r, m = T([[[1.0, 1.0], [1.0, 0.0]]]), full(1, 2, 2)
    match = T([[[True, True], [True, False]]])
    close(adv.uis1_turns(r, m, match), [[[0.5, 0.75], [0.0, -1.25]]])


def test_uis1_reset_and_variable_turn_counts():
    # A: [1, 1] both matched -> returns [1.5, 1]; B stopped after one turn: [1] -> [1]
    # step 0 {1.5, 1}: [0.25, -0.25]; step 1 {1}: singleton -> 0; A_ep: scores {1, 1, 1}, mean 1 -> 0
    r = T([[[1.0, 1.0], [1.0, 0.0]]])
    m = T([[[True, True], [True, False]]])
    close(adv.uis1_turns(r, m, full(1, 2, 2)), [[[0.25, 0.0], [-0.25, 0.0]]])
    # the same with A's step 1 missed: A's returns [1 + 0.5 * 0, 1] = [1, 1] -> step 0 {1, 1}: 0
    close(adv.uis1_turns(r, m, T([[[True, False], [True, True]]])), [[[0.0, 0.0], [0.0, 0.0]]])


# --------------------------------------------------------------------------- Turn-PPO


def test_turn_ppo_catalog_l159():
    # r = [0, 0, 1], V = [0.3, 0.5, 0.7], terminal (V after = 0), gamma 0.99, lam 0.9 (gamma lam = 0.891)
    # delta_2 = 1 - 0.7 = 0.3 -> A_2 = 0.3
    # delta_1 = 0.99 * 0.7 - 0.5 = 0.193 -> A_1 = 0.193 + 0.891 * 0.3 = 0.4603
    # delta_0 = 0.99 * 0.5 - 0.3 = 0.195 -> A_0 = 0.195 + 0.891 * 0.4603 = 0.6051; returns A + V
    a, ret = adv.turn_gae(T([[[0.0, 0.0, 1.0]]]), T([[[0.3, 0.5, 0.7, 0.0]]]), full(1, 1, 3))
    close(a, [[[0.6051, 0.4603, 0.3]]])
    close(ret, [[[0.9051, 0.9603, 1.0]]])


def test_turn_ppo_variable_turn_counts_read_the_value_after_the_last_turn():
    # episode 2 has 2 turns: r [0, 1], V [0.5, 0.4], V after its last turn (index 2) = 0; index 3 (7.0) unused
    # delta_1 = 1 + 0 - 0.4 = 0.6 -> A_1 = 0.6; delta_0 = 0.99 * 0.4 - 0.5 = -0.104 -> A_0 = -0.104 + 0.891 * 0.6
    r = T([[[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]])
    m = T([[[True, True, True], [True, True, False]]])
    v = T([[[0.3, 0.5, 0.7, 0.0], [0.5, 0.4, 0.0, 7.0]]])
    a, _ = adv.turn_gae(r, v, m)
    close(a, [[[0.6051, 0.4603, 0.3], [0.4306, 0.6, 0.0]]])
    # a cut episode bootstraps on the critic: V after turn 1 = 0.5 -> delta_1 = 1 + 0.495 - 0.4 = 1.095
    a, _ = adv.turn_gae(r, T([[[0.3, 0.5, 0.7, 0.0], [0.5, 0.4, 0.5, 7.0]]]), m)
    close(a[0, 1], [-0.104 + 0.891 * 1.095, 1.095, 0.0])
    with pytest.raises(ValueError, match=r"K \+ 1"):
        adv.turn_gae(r, v[..., :3], m)


def test_turn_starts_find_each_turns_first_sampled_token():
    # turn_ids [-1, 0, 0, -1, -1, 1, 1], K = 3: turn 0 starts at 1, turn 1 at 5, turn 2 absent (position 0)
    pos, present = adv.turn_starts(T([[[-1, 0, 0, -1, -1, 1, 1]]]), 3)
    assert pos.tolist() == [[[1, 5, 0]]] and present.tolist() == [[[True, True, False]]]


def test_turn_start_values_read_the_token_values_at_turn_starts_and_end_terminal():
    # values at tokens [9, 0.2, 0.3, 9, 9, 0.6, 0.7]: V(s_0) = 0.2 (token 1), V(s_1) = 0.6 (token 5),
    # turn 2 absent -> 0, and the entry after the last turn (index K = 3) is 0: the episode ended
    v = adv.turn_start_values(T([[[9.0, 0.2, 0.3, 9.0, 9.0, 0.6, 0.7]]]), T([[[-1, 0, 0, -1, -1, 1, 1]]]), 3)
    close(v, [[[0.2, 0.6, 0.0, 0.0]]])


def test_turn_start_targets_put_each_reached_turns_target_on_its_first_token_only():
    # turn_ids [-1, 0, 0, -1, 1], targets [0.5, 0.9] -> [0, 0.5, 0, 0, 0.9], fit [0, 1, 0, 0, 1]
    tgt, fit = adv.turn_start_targets(T([[[0.5, 0.9]]]), T([[[-1, 0, 0, -1, 1]]]), full(1, 1, 2))
    close(tgt, [[[0.0, 0.5, 0.0, 0.0, 0.9]]])
    close(fit, [[[0.0, 1.0, 0.0, 0.0, 1.0]]])
    # a turn the turn mask drops (an invalid episode) is neither a target nor fit; a turn starting at
    # token 0 keeps its target although the absent turn 2 also points at position 0
    tgt, fit = adv.turn_start_targets(T([[[0.5, 0.9, 0.0]]]), T([[[0, 1, 1]]]), T([[[True, False, False]]]))
    close(tgt, [[[0.5, 0.0, 0.0]]])
    close(fit, [[[1.0, 0.0, 0.0]]])


# --------------------------------------------------------------------------- HiPER


def test_hiper_catalog_l221():
    # 4 turns, gamma = lam = 1, switch at turn 2: segments [0, 1] and [2, 3]; r = [0, 0, 0, 1], done at turn 3
    # V_low = [0.2, 0.4, 0.5, 0.8]; V_high(t0) = 0.3, V_high(t2) = 0.6 (entries 1 and 3, 9.0, are never read)
    # low: A_3 = 1 - 0.8 = 0.2; A_2 = (0.8 - 0.5) + 0.2 = 0.5;
    #      A_1 = 0 + V_high(t2) - 0.4 = 0.2 (segment end: bootstrap on V_high, no carry); A_0 = (0.4 - 0.2) + 0.2 = 0.4
    # high: segment [2, 3]: target 0 + 1 = 1 -> 1 - 0.6 = 0.4; segment [0, 1]: target 0 + 0 + V_high(t2) = 0.6
    #       -> 0.6 - 0.3 + 1 * 1 * 0.4 = 0.7
    r, m = T([[[0.0, 0.0, 0.0, 1.0]]]), full(1, 1, 4)
    low, high = adv.hiper_turns(r, m, T([[[0.2, 0.4, 0.5, 0.8]]]), T([[[0.3, 9.0, 0.6, 9.0, 0.0]]]),
                                T([[[False, False, True, False]]]), lam_seg=1.0)
    close(low, [[[0.4, 0.2, 0.5, 0.2]]])
    close(high, [[[0.7, 0.0, 0.4, 0.0]]])
    # the default lam_seg 0.95: 0.3 + 0.95 * 0.4 = 0.68
    _, high = adv.hiper_turns(r, m, T([[[0.2, 0.4, 0.5, 0.8]]]), T([[[0.3, 9.0, 0.6, 9.0, 0.0]]]),
                              T([[[False, False, True, False]]]))
    close(high, [[[0.68, 0.0, 0.4, 0.0]]])


def hiper_loop(r, m, vl, vh, switch, gamma, lam_turn, lam_seg):
    """HiPER's compute_hae_advantage, per episode; the value after the last turn is vh[n]."""
    low, high = torch.zeros_like(r), torch.zeros_like(r)
    for i in range(r.shape[0]):
        for j in range(r.shape[1]):
            n = int(m[i, j].sum())
            starts = [0] + [k for k in range(1, n) if switch[i, j, k]]
            segs = [(s, (starts[q + 1] - 1) if q + 1 < len(starts) else n - 1) for q, s in enumerate(starts)]
            for s, e in segs:
                nxt = 0.0
                for k in range(e, s - 1, -1):
                    v_next = float(vh[i, j, e + 1]) if k == e else float(vl[i, j, k + 1])
                    carry = gamma * lam_turn * nxt if k < e else 0.0  # no carry across a segment end
                    nxt = float(r[i, j, k]) + gamma * v_next - float(vl[i, j, k]) + carry
                    low[i, j, k] = nxt
            nxt_seg = 0.0
            for s, e in reversed(segs):
                target = sum(gamma**q * float(r[i, j, s + q]) for q in range(e - s + 1))
                target += gamma ** (e - s + 1) * float(vh[i, j, e + 1])
                nxt_seg = target - float(vh[i, j, s]) + gamma ** (e - s + 1) * lam_seg * nxt_seg
                high[i, j, s] = nxt_seg
    return low, high


def test_hiper_matches_the_authors_loop():
    b = random_batch(5)
    args = (b["turn_rewards"], b["turn_mask"], b["turn_values_low"], b["turn_values_high"], b["switch"])
    low, high = adv.hiper_turns(*args, gamma=0.9, lam_turn=0.8, lam_seg=0.7)
    exp_low, exp_high = hiper_loop(*args, 0.9, 0.8, 0.7)
    torch.testing.assert_close(low, exp_low)
    torch.testing.assert_close(high, exp_high)


def test_hiper_high_level_with_a_segment_per_turn_is_turn_ppo():
    b = random_batch(6)
    r, m, v = b["turn_rewards"], b["turn_mask"], b["turn_values"]
    _, high = adv.hiper_turns(r, m, v[..., :-1], v, torch.ones_like(m), gamma=0.99, lam_seg=0.9)
    torch.testing.assert_close(high, adv.turn_gae(r, v, m, gamma=0.99, lam=0.9)[0])


def test_hiper_tokens_subgoal_block_gets_the_high_level_advantage():
    # two turns, switch at turn 1 (two segments); gamma = lam = 1, r = [0, 1],
    # V_low = [0.5, 0.5], V_high = [0.2, 0.4, 0 (terminal)]
    # low: A_1 = 1 - 0.5 = 0.5; A_0 = 0 + V_high(t1) - 0.5 = -0.1
    # high: segment 1: 1 - 0.4 = 0.6; segment 0: 0.4 - 0.2 + 0.6 = 0.8
    r, m = T([[[0.0, 1.0]]]), full(1, 1, 2)
    kw = {"turn_rewards": r, "turn_mask": m, "turn_values_low": T([[[0.5, 0.5]]]),
          "turn_values_high": T([[[0.2, 0.4, 0.0]]]), "switch": T([[[False, True]]]), "lam_seg": 1.0}
    turn_ids, mask = layout(m)  # [-1, -1, 0, 0, -1, 1, 1, -1]
    sub = T([[[0, 0, 1, 0, 0, 1, 0, 0]]]).float()  # the first token of each turn is its subgoal block
    close(adv.compute("hiper", r.sum(-1), turn_ids=turn_ids, mask=mask, **kw), [[[0, 0, -0.1, -0.1, 0, 0.5, 0.5, 0]]])
    out = adv.compute("hiper", r.sum(-1), turn_ids=turn_ids, mask=mask, subgoal_mask=sub, **kw)
    close(out, [[[0, 0, 0.8, -0.1, 0, 0.6, 0.5, 0]]])
    # without the switch turn 1 keeps turn 0's subgoal: its subgoal token gets 0 (no decision was made)
    kw["switch"] = T([[[False, False]]])
    out = adv.compute("hiper", r.sum(-1), turn_ids=turn_ids, mask=mask, subgoal_mask=sub, **kw)
    assert float(out[0, 0, 5]) == 0.0 and float(out[0, 0, 6]) != 0.0


def test_hiper_norm_adv_standardises_each_level():
    b = random_batch(7)
    low, high = adv.hiper_turns(b["turn_rewards"], b["turn_mask"], b["turn_values_low"], b["turn_values_high"],
                                b["switch"], norm_adv=True)
    lo = low[b["turn_mask"]]
    assert abs(float(lo.mean())) < 1e-5 and abs(float(lo.std(unbiased=False)) - 1.0) < 1e-4
