"""Per-token loss weights (``posttrain/algorithms/loss_weights.py``, ``algorithm.loss_weights``): a hand example per
entry, invariants, what distinguishes each, the config (moved keys, did-you-mean), the update (each weight changes
the gradient of the same batch; the once-an-update ones do not change with micro-batching) and a new entry that
needs no edit outside its own file."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain.algorithms import loss_weights
from posttrain.algorithms.loss_weights import compute
from posttrain.algorithms.registry import Traits
from posttrain.config import ConfigError, LearnSettings, load_config

# --- (a) hand-computed examples --------------------------------------------------------------------------------


def test_opsm_hand_example():
    # threshold 0.1; KL_i = mean_t (log mu - log pi) over the response's tokens:
    # row 0: mu [-1, -2], pi [-1.05, -2.05] -> 0.05 <= 0.1: kept (A = -1)
    # row 1: mu [-1, -1], pi [-1.3, -1.3]   -> 0.3 > 0.1 and A = -1: every token 0
    # row 2: as row 1 with A = +1           -> kept (a positive advantage is never masked)
    mu = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]])
    pi = torch.tensor([[-1.05, -2.05], [-1.3, -1.3], [-1.3, -1.3]])
    w = compute("opsm", logprobs=pi, behaviour_logprobs=mu, advantages=torch.tensor([-1.0, -1.0, 1.0]),
                mask=torch.ones(3, 2), threshold=0.1)
    assert w.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


def test_top_entropy_hand_example():
    # trained entropies [0.1, 0.5, 0.9] (0.3 is padding); rho = 0.2: tau = quantile(0.8) = 0.5 + 0.6 (0.9 - 0.5)
    # = 0.74 -> only 0.9 is kept; rho = 0.5: tau = 0.5 -> 0.5 and 0.9
    h, m = torch.tensor([[0.1, 0.5, 0.9, 0.3]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert compute("top_entropy", entropies=h, mask=m).tolist() == [[0.0, 0.0, 1.0, 0.0]]  # rho = 0.2, the paper's
    assert compute("top_entropy", entropies=h, mask=m, rho=0.5).tolist() == [[0.0, 1.0, 1.0, 0.0]]


def _aapo_example(lam: float) -> torch.Tensor:
    # group 0 (re-rolled): one row with rho = pi / pi_old = [1.0, 1.1, 1.3], |A| = 1, eps 0.2 (band [0.8, 1.2]):
    # EUR = 2/3 (1.3 is out of band); UC = std of log rho over {1.0, 1.1} = log(1.1) / 2 = 0.047655;
    # tau = log(1.2) / 2 = 0.091161; Affinity = 2/3 exp(-0.047655 / 0.091161) = 0.395255.
    # group 1 (not re-rolled): rho [1.5, 1.5, 1.5], Affinity 0, but its weight is 1.
    old = torch.full((2, 3), -1.0)
    logp = old + torch.log(torch.tensor([[1.0, 1.1, 1.3], [1.5, 1.5, 1.5]]))
    return compute("aapo", logprobs=logp, old_logprobs=old, advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, 3),
                   group_ids=torch.tensor([0, 1]), hint_rerolled=torch.tensor([True, False]), eps_low=0.2, lam=lam)


def test_aapo_hand_example():
    torch.testing.assert_close(_aapo_example(1.0), torch.tensor([[0.395255] * 3, [1.0] * 3]), atol=1e-6, rtol=0)
    # lambda 2: 0.395255^2 = 0.156227
    torch.testing.assert_close(_aapo_example(2.0), torch.tensor([[0.156227] * 3, [1.0] * 3]), atol=1e-6, rtol=0)
    assert (_aapo_example(0.0) == 1).all()  # lambda 0: AAPO off


# --- (b) invariants ---------------------------------------------------------------------------------------------


def _batch(seed: int, n: int = 12, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, t, generator=g) * 3
    return {
        "behaviour_logprobs": mu, "old_logprobs": mu + 0.05 * torch.randn(n, t, generator=g),
        "logprobs": (mu + 0.3 * torch.randn(n, t, generator=g)).requires_grad_(True),
        "advantages": torch.randn(n, generator=g), "mask": (torch.rand(n, t, generator=g) > 0.25).float(),
        "entropies": torch.rand(n, t, generator=g), "group_ids": torch.arange(n) // 4,
        "hint_rerolled": torch.arange(n) < 8, "rewards": torch.rand(n, generator=g), "eps_low": 0.2, "eps_high": 0.2,
    }


@pytest.mark.parametrize("name", loss_weights.names())
def test_every_entry_gives_finite_non_negative_weights_without_gradient(name):
    for seed in range(4):
        b = _batch(seed)
        assert set(loss_weights.inputs(name)) <= set(loss_weights.INPUTS)  # it reads only what the update offers
        w = compute(name, **{k: b[k] for k in loss_weights.inputs(name)})
        assert w.shape == b["mask"].shape and w.dtype == torch.float32 and not w.requires_grad
        assert torch.isfinite(w).all() and (w >= 0).all()
        if name in ("opsm", "top_entropy", "aapo"):  # masks and Affinity^lambda: at most 1
            assert (w <= 1).all()


def test_registry_declares_inputs_params_and_traits():
    assert {"aapo", "opsm", "top_entropy"} <= set(loss_weights.names())
    assert [loss_weights.params(n) for n in ("aapo", "opsm", "top_entropy")] == [["lam"], ["threshold"], ["rho"]]
    t = loss_weights.REGISTRY.traits
    assert t("opsm").reads_behaviour and not t("top_entropy").replayable
    assert t("aapo").row_coupled and t("aapo").drivers == ("hint_reroll",)
    assert all(t(n).note for n in loss_weights.names() if t(n) != Traits())  # every refusal says why


# --- (c) what distinguishes each -------------------------------------------------------------------------------


def test_opsm_leaves_non_negative_advantage_rows_and_on_policy_rows_untouched():
    for seed in range(5):
        b = _batch(seed)
        b["advantages"][:3] = 0.0
        w = compute("opsm", **{k: b[k] for k in loss_weights.inputs("opsm")}, threshold=1e-3)
        assert (w[b["advantages"] >= 0] == 1).all() and (w[b["advantages"] < 0] == 0).any()
        assert (compute("opsm", logprobs=b["behaviour_logprobs"], behaviour_logprobs=b["behaviour_logprobs"],
                        advantages=b["advantages"], mask=b["mask"], threshold=1e-6) == 1).all()


@pytest.mark.parametrize("rho", [0.1, 0.2, 0.5])
def test_top_entropy_keeps_exactly_the_top_rho_share(rho):
    # 100 trained tokens of distinct entropies (and 20 padding ones with the highest entropies): the (1 - rho)
    # quantile falls between two of them, so exactly rho * 100 tokens are kept, every one above every dropped one
    h = torch.randperm(120).float().reshape(12, 10) / 120
    m = (h < 100 / 120).float()
    w = compute("top_entropy", entropies=h, mask=m, rho=rho)
    assert int(w.sum()) == round(rho * 100) and (w <= m).all()
    assert h[w.bool()].min() > h[(m - w).bool()].max()


def test_aapo_is_one_on_policy_and_below_one_off_policy_on_rerolled_rows_only():
    for seed in range(4):
        b = _batch(seed)
        ins = {k: b[k] for k in loss_weights.inputs("aapo")}
        on = compute("aapo", **{**ins, "logprobs": b["old_logprobs"]})  # pi_theta = pi_old
        torch.testing.assert_close(on, torch.ones_like(on))
        off = compute("aapo", **ins)
        rerolled = b["hint_rerolled"]
        assert (off[~rerolled] == 1).all() and (off[rerolled] < 1).all()
        assert torch.allclose(off, off[:, :1].expand_as(off))  # one weight per row (its group's)


# --- (d) config ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "line"), [
    ("algorithm.off_policy_mask_threshold=0.5",
     'algorithm.loss_weights = [{ name = "opsm", params = { threshold = 0.5 } }]'),
    ("algorithm.top_entropy_quantile=0.2",
     'algorithm.loss_weights = [{ name = "top_entropy", params = { rho = 0.2 } }]'),
    ("rollout.hint_affinity_lambda=1.0", 'algorithm.loss_weights = [{ name = "aapo", params = { lam = 1.0 } }]'),
    ("rollout.driver_params={affinity_lambda=2.0}",
     'algorithm.loss_weights = [{ name = "aapo", params = { lam = 1.0 } }]'),
])
def test_each_old_key_names_its_replacement(override, line, tiny_cfg):
    key = override.split("=")[0] if "{" not in override else "rollout.driver_params.affinity_lambda"
    with pytest.raises(ConfigError) as e:
        tiny_cfg("rollout.driver=hint_reroll", override)
    assert f"'{key}' has moved: use {line}" in str(e.value)


def test_loss_weights_config_is_validated(tiny_cfg):
    cfg = tiny_cfg('algorithm.loss_weights=[{name="top_entropy", params={rho=0.3}}, {name="opsm"}]')
    assert [(s.name, s.params) for s in cfg.algorithm.loss_weights] == [("top_entropy", {"rho": 0.3}), ("opsm", {})]


@pytest.mark.parametrize(("weights", "match"), [
    ('{name="top_entopy"}', r"loss_weights\[0\]: unknown loss weight 'top_entopy'; did you mean 'top_entropy'\?"),
    ('{name="opsm", params={delta=0.5}}', r"no parameter\(s\) \['delta'\]; accepted: \['threshold'\]"),
    ('{name="top_entropy", params={entropies=1}}', r"no parameter\(s\) \['entropies'\]"),  # an input, not a param
    ('{name="top_entropy", params={rho=0}}', r"rho must be in \(0, 1\]"),
    ('{name="opsm", params={threshold=0}}', "threshold must be > 0"),
    ('{name="opsm"}, {name="opsm"}', "'opsm' is listed twice"),
])
def test_loss_weights_config_errors(tiny_cfg, weights, match):
    with pytest.raises(ConfigError, match=match):
        tiny_cfg(f"algorithm.loss_weights=[{weights}]")


def test_the_declared_traits_refuse_what_each_weight_cannot_run_with(tiny_cfg):
    # config/checks.py reads the traits: the three rules these settings had by hand
    with pytest.raises(ConfigError, match=r"'rorecomp' replays stored rows, and algorithm.loss_weights\[0\] = "
                                          r"'top_entropy' keeps per-row state they lose"):
        tiny_cfg('algorithm.loss_weights=[{name="top_entropy"}]', "algorithm.batch_selector=rorecomp")
    with pytest.raises(ConfigError, match=r"'external_mix': its external rows have no sampler log-probs.*"
                                          r"algorithm.loss_weights\[0\] = 'opsm'"):
        tiny_cfg("rollout.driver=external_mix", 'algorithm.loss_weights=[{name="opsm"}]')
    with pytest.raises(ConfigError, match=r"loss_weights\[0\] = 'aapo' couples the rows"):
        tiny_cfg("rollout.driver=hint_reroll", "train.micro_batch_tokens=64", 'algorithm.loss_weights=[{name="aapo"}]')
    with pytest.raises(ConfigError, match=r"'aapo' runs with the driver\(s\) \['hint_reroll'\] only"):
        tiny_cfg('algorithm.loss_weights=[{name="aapo"}]')
    # the weights that read no forward pass run with micro-batches; opsm reads mu of sampled rows only
    tiny_cfg("train.micro_batch_tokens=64", 'algorithm.loss_weights=[{name="top_entropy"}, {name="opsm"}]')


def test_the_entropies_provider_follows_the_required_inputs(tiny_cfg, monkeypatch):
    from posttrain.train.loop_state import Phases

    assert "entropies" not in Phases.from_config(tiny_cfg()).prepare.inputs
    parts = Phases.from_config(tiny_cfg('algorithm.loss_weights=[{name="top_entropy"}]')).prepare
    assert "entropies" in parts.inputs and parts.weight_row_inputs == ("entropies",)

    def test_calm(*, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A test-only weight: 1 / (1 + H) (any entry reading `entropies` gets them, whatever its name)."""
        return mask / (1.0 + entropies)

    _register(monkeypatch, "test_calm", test_calm)
    assert "entropies" in Phases.from_config(tiny_cfg('algorithm.loss_weights=[{name="test_calm"}]')).prepare.inputs


# --- (e) the update ---------------------------------------------------------------------------------------------


def _register(monkeypatch, name, fn, **traits):
    """Register ``fn`` as loss weight ``name`` for one test (the registry is restored after)."""
    monkeypatch.setitem(loss_weights.REGISTRY._entries, name, fn)
    monkeypatch.setitem(loss_weights.REGISTRY._traits, name, Traits(**traits))


@pytest.fixture(scope="module")
def tiny_batch(tmp_path_factory):
    """A tiny model and one sampled batch of 3 prompts x 4 completions."""
    from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
    from posttrain.models.load import encode_chat
    from posttrain.rollout import SamplingParams, make_engine

    d = tmp_path_factory.mktemp("lw") / "m"
    build_tiny(d, TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64, num_layers=2))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, q) for q in ("12+3=", "4+555=", "7+8=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=7, n=4), seed=3)
    return str(d), tok.pad_token_id, r


def _grads(cfg, tiny_batch, budget: int = 0, behaviour_shift: float = 0.0) -> tuple[dict, list[torch.Tensor]]:
    """One update with lr 0 (the weights stay): its metrics and gradients. ``behaviour_shift`` raises the sampler's
    log-probs (a sampler that disagreed with the learner: OPSM's KL and, read as pi_old, AAPO's ratio move).
    """
    from posttrain.learn.update import policy_update
    from posttrain.models import load_model
    from posttrain.train.loop_state import Phases

    path, pad_id, r = tiny_batch
    r = dataclasses.replace(r, behaviour_logprobs=r.behaviour_logprobs + behaviour_shift * r.loss_mask)
    model = load_model(path)
    adv = torch.linspace(-1, 1, 12)
    h = torch.rand(12, r.token_ids.shape[1], generator=torch.Generator().manual_seed(0)) * r.loss_mask
    inputs = {"rewards": (adv > 0).float(), "group_ids": r.group_ids, "hint_rerolled": torch.arange(12) < 8,
              "entropies": h}
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_tokens": budget})})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    settings = LearnSettings.of(cfg)
    metrics = policy_update(model, None, opt, Phases.from_config(cfg).learn, settings, r.row_prompts, r, r.loss_mask,
                            adv, inputs, pad_id, 0)
    return metrics, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("weight", "extra"), [
    ('{name="opsm", params={threshold=0.5}}', ()),
    ('{name="top_entropy"}', ()),
    ('{name="aapo"}', ("rollout.driver=hint_reroll", 'algorithm.old_logprobs="behaviour"')),
])
def test_each_weight_changes_the_update_of_the_same_batch(weight, extra, tiny_cfg, tiny_batch):
    name = weight.split('"')[1]
    base = tiny_cfg("train.grad_clip=1e9", *extra)
    without, g0 = _grads(base, tiny_batch, behaviour_shift=1.0)
    with_w, g1 = _grads(tiny_cfg("train.grad_clip=1e9", *extra, f"algorithm.loss_weights=[{weight}]"), tiny_batch,
                        behaviour_shift=1.0)
    assert f"loss_weight/{name}_mean" in with_w and f"loss_weight/{name}_mean" not in without
    assert with_w[f"loss_weight/{name}_mean"] < 1  # it weighed some trained token below 1
    assert with_w["loss"] != pytest.approx(without["loss"], rel=1e-4)
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(g0, g1, strict=True))
    old_name = {"opsm": "offpolicy/masked_frac", "top_entropy": "policy/entropy_kept_frac",
                "aapo": "policy/aapo_weight"}[name]
    assert old_name in with_w and old_name not in without  # the metrics these weights logged before stay


def test_weights_read_once_an_update_do_not_change_with_micro_batching(tiny_cfg, tiny_batch):
    # top_entropy's quantile is over the update's rows (it reads no forward pass), opsm is per row: split into
    # micro-batches of 1-2 rows, the loss and the gradients are those of one pass
    cfg = tiny_cfg("train.grad_clip=1e9", 'algorithm.loss_weights=[{name="top_entropy"}, {name="opsm"}]')
    one, g_one = _grads(cfg, tiny_batch, budget=0, behaviour_shift=1.0)
    many, g_many = _grads(cfg, tiny_batch, budget=20, behaviour_shift=1.0)
    assert one["loss"] == pytest.approx(many["loss"], abs=1e-6)
    assert one["loss_weight/top_entropy_mean"] == pytest.approx(many["loss_weight/top_entropy_mean"], abs=1e-6)
    for a, b in zip(g_one, g_many, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_new_weight_needs_only_its_entry(tiny_cfg, tiny_batch, monkeypatch):
    # an entry registered anywhere (here: in the test) is configured, bound and applied with no edit to the config,
    # LearnParts or the update: a weight of 1/2 on every token halves the loss and the gradient (token_mean is linear)
    def test_half(*, mask: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        """A test-only weight: ``scale`` on every token."""
        return torch.full_like(mask, scale)

    _register(monkeypatch, "test_half", test_half)
    plain, g0 = _grads(tiny_cfg("train.grad_clip=1e9"), tiny_batch)
    half, g1 = _grads(tiny_cfg("train.grad_clip=1e9", 'algorithm.loss_weights=[{name="test_half"}]'), tiny_batch)
    assert half["loss"] == pytest.approx(plain["loss"] / 2, rel=1e-5)
    assert half["loss_weight/test_half_mean"] == pytest.approx(0.5)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a / 2, atol=1e-7, rtol=1e-4)
    with pytest.raises(ConfigError, match=r"'test_half' has no parameter\(s\) \['scal'\]; accepted: \['scale'\]"):
        tiny_cfg('algorithm.loss_weights=[{name="test_half", params={scal=1}}]')


# --- prob_reweight (Advantage Reweighting, arXiv:2505.12929) ----------------------------------------------------


def test_prob_reweight_hand_example():
    # alpha 0.2: w = 0.2 pi_old + 0.8; pi_old = [0.9, 0.1] -> [0.98, 0.82]; the padded position stays 1
    old = torch.log(torch.tensor([[0.9, 0.1, 0.5]]))
    w = compute("prob_reweight", old_logprobs=old, mask=torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[0.98, 0.82, 1.0]]))
    # alpha 0.3 (the authors' AR-Lopti run): 0.3 * 0.9 + 0.7 = 0.97, 0.3 * 0.1 + 0.7 = 0.73
    w = compute("prob_reweight", old_logprobs=old, mask=torch.ones(1, 3), alpha=0.3)
    torch.testing.assert_close(w, torch.tensor([[0.97, 0.73, 0.85]]))


def test_prob_reweight_damps_low_probability_tokens_and_alpha_zero_is_off():
    # what sets the paper apart: the weight rises with the sampled token's probability, within [1 - alpha, 1],
    # so a low-probability token's gradient (large: d log p / d logits = onehot - p) counts less than before
    probs = torch.linspace(0.01, 0.99, 50)[None]
    w = compute("prob_reweight", old_logprobs=probs.log(), mask=torch.ones_like(probs), alpha=0.4)
    assert (w.diff(dim=-1) > 0).all()
    assert float(w.min()) >= 0.6 - 1e-6 and float(w.max()) <= 1.0
    assert (compute("prob_reweight", old_logprobs=probs.log(), mask=torch.ones_like(probs), alpha=0.0) == 1).all()
    with pytest.raises(ConfigError, match=r"alpha must be in \[0, 1\]"):  # refused before any model loads
        load_config(None, ['algorithm.loss_weights=[{name="prob_reweight", params={alpha=1.5}}]'])


def test_prob_reweight_changes_the_update_of_the_same_batch(tiny_cfg, tiny_batch):
    # on the same batch the weighted update differs, and its mean weight lies in [1 - alpha, 1)
    base, g0 = _grads(tiny_cfg("train.grad_clip=1e9"), tiny_batch)
    cfg = tiny_cfg("train.grad_clip=1e9", 'algorithm.loss_weights=[{name="prob_reweight", params={alpha=0.5}}]')
    weighted, g1 = _grads(cfg, tiny_batch)
    assert 0.5 <= weighted["loss_weight/prob_reweight_mean"] < 1.0
    assert weighted["loss"] != pytest.approx(base["loss"], rel=1e-4)
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(g0, g1, strict=True))
