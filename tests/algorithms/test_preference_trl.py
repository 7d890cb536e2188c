"""TRL's DPO loss types in the preference registry: worked numbers, TRL as the peer, and 2-step `posttrain dpo` runs.

The peer: TRL 1.16 computes every loss type inside ``DPOTrainer._compute_loss(model, inputs, return_outputs)``
(there is no ``dpo_loss`` method any more). It is called unbound on a stand-in ``self`` carrying the attributes
it reads and a stand-in model whose per-token log-probs are the sequence sums themselves (one completion token
per sequence), with precomputed reference log-probs. It returns only the batch mean, so the per-pair losses
are compared through one-pair batches, and the batch mean and its gradient on a whole random batch; the
batch-coupled ``aot`` / ``aot_unpaired`` (they sort over the batch) through the batch mean and gradient.
"""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import preference
from posttrain.config import ConfigError
from posttrain.trainers.dpo import dpo_train

NEW = ["aot", "aot_unpaired", "apo_down", "apo_zero", "bco_pair", "discopop", "exo_pair", "hinge", "nca_pair",
       "robust", "sppo_hard"]
BATCH_COUPLED = {"aot", "aot_unpaired"}


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def _b(x):
    """A batch from a number (one pair) or a list (one value per pair)."""
    return torch.tensor(x if isinstance(x, list) else [x], dtype=torch.float64)


def _loss(name, cw, cl, rw=0.0, rl=0.0, **params):
    """Per-pair losses as a list; rw / rl broadcast when given as numbers."""
    return preference.compute(name, _b(cw), _b(cl), _b(rw), _b(rl), **params).tolist()


def test_the_new_entries_are_registered():
    assert set(NEW) <= set(preference.names())
    assert all(preference.inputs(n) == [] for n in NEW)  # pure functions of the four sums


# ---- worked numbers: beta = 0.1, m_w = 1, m_l = -1 (h = 2) unless stated; softplus(x) = log(1 + e^x) ----
# softplus(-0.2) = 0.598139, softplus(0.2) = 0.798139, softplus(-0.1) = 0.644397, softplus(0.1) = 0.744397


def test_hinge():
    # max(0, 1 - 0.1 * 2) = 0.8
    assert _loss("hinge", 1.0, -1.0) == pytest.approx([0.8])
    # h = 10 = 1/beta: on the margin, zero loss and zero gradient
    assert _loss("hinge", 5.0, -5.0) == pytest.approx([0.0])
    # policy = reference: 1
    assert _loss("hinge", -3.0, -4.0, -3.0, -4.0) == pytest.approx([1.0])


def test_robust():
    # eps = 0.1: (0.9 * softplus(-0.2) - 0.1 * softplus(0.2)) / (1 - 0.2)
    #          = (0.538325 - 0.079814) / 0.8 = 0.573139
    assert _loss("robust", 1.0, -1.0) == pytest.approx([0.573139], abs=1e-6)
    # eps = 0 is DPO: softplus(-0.2) = 0.598139
    assert _loss("robust", 1.0, -1.0, flip_rate=0.0) == pytest.approx(_loss("dpo", 1.0, -1.0))
    # unbiased: averaged over a label flipped with probability eps it is the clean DPO loss,
    # (1 - eps) L(h) + eps L(-h) = -log s(beta h)
    for h in (2.0, -3.0, 7.0):
        mix = 0.9 * _loss("robust", h, 0.0)[0] + 0.1 * _loss("robust", 0.0, h)[0]
        assert mix == pytest.approx(_loss("dpo", h, 0.0)[0])
    for bad in (0.5, -0.1):
        with pytest.raises(ValueError, match=r"flip_rate must lie in \[0, 0.5\)"):
            _loss("robust", 1.0, -1.0, flip_rate=bad)


def test_exo_pair():
    # q_w = s(0.2) = 0.549834, q_l = 0.450166, eps = 1e-3:
    # 0.549834 * (log 0.549834 - log 0.999) + 0.450166 * (log 0.450166 - log 0.001)
    # = 0.549834 * (-0.598139 + 0.001001) + 0.450166 * (-0.798139 + 6.907755) = -0.328321 + 2.750336 = 2.422015
    assert _loss("exo_pair", 1.0, -1.0) == pytest.approx([2.422015], abs=1e-6)
    # zero at the target q = p: beta h = log((1 - eps) / eps) = log 999 = 6.906755, h = 69.06755
    h = 10 * math.log(999)
    assert _loss("exo_pair", h, 0.0) == pytest.approx([0.0], abs=1e-12)
    # and it pushes back beyond it (reverse KL has a finite minimum, unlike DPO)
    cw = _t(h + 5).requires_grad_(True)
    preference.compute("exo_pair", cw, _t(0.0), _t(0.0), _t(0.0)).sum().backward()
    assert cw.grad.item() > 0
    with pytest.raises(ValueError, match=r"epsilon must lie in \(0, 1\)"):
        _loss("exo_pair", 1.0, -1.0, epsilon=0.0)


def test_nca_pair():
    # r_w = 0.1, r_l = -0.1: softplus(-0.1) + 0.5 softplus(0.1) + 0.5 softplus(-0.1)
    # = 0.644397 + 0.372198 + 0.322198 = 1.338793
    assert _loss("nca_pair", 1.0, -1.0) == pytest.approx([1.338793], abs=1e-6)
    # absolute, not relative: shifting both log-ratios by +1 changes the loss (DPO's would not)
    assert _loss("nca_pair", 2.0, 0.0) != pytest.approx(_loss("nca_pair", 1.0, -1.0))
    # policy = reference: log 2 + 0.5 log 2 + 0.5 log 2 = 2 log 2
    assert _loss("nca_pair", 0.0, 0.0) == pytest.approx([2 * math.log(2)])


def test_bco_pair():
    # delta = 0: -log s(0.1 * 1) - log s(-(0.1 * -1)) = 2 softplus(-0.1) = 2 * 0.644397 = 1.288793
    assert _loss("bco_pair", 1.0, -1.0) == pytest.approx([1.288793], abs=1e-6)
    # delta = 0.1 shifts both logits: -log s(0.1 - 0.1) - log s(-(-0.1 - 0.1)) = log 2 + softplus(-0.2)
    # = 0.693147 + 0.598139 = 1.291286
    assert _loss("bco_pair", 1.0, -1.0, delta=0.1) == pytest.approx([1.291286], abs=1e-6)


def test_sppo_hard():
    # targets +-1/(2 beta) = +-5: (1 - 5)^2 + (-1 + 5)^2 = 16 + 16 = 32
    assert _loss("sppo_hard", 1.0, -1.0) == pytest.approx([32.0])
    # minimum at m_w = 5, m_l = -5 (reference shifts them: logpi = (2, 0), ref = (-3, 5))
    assert _loss("sppo_hard", 2.0, 0.0, -3.0, 5.0) == pytest.approx([0.0])
    # beta = 0.5: targets +-1: (1 - 1)^2 + (-1 + 1)^2 = 0
    assert _loss("sppo_hard", 1.0, -1.0, beta=0.5) == pytest.approx([0.0])


def test_aot_sorts_margins_over_the_batch():
    # policy margins d = logpi(y_w) - logpi(y_l) = [1, 3], reference margins [2, 0]:
    # sorted [1, 3] - sorted [0, 2] = [1, 1] -> softplus(-0.1) each = 0.644397
    out = _loss("aot", [1.0, 3.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0])
    assert out == pytest.approx([0.644397, 0.644397], abs=1e-6)
    # DPO pairs them as given: h = [1 - 2, 3 - 0] = [-1, 3], a different loss
    assert _loss("dpo", [1.0, 3.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0]) != pytest.approx(out)
    # one pair: nothing to sort, it is DPO
    assert _loss("aot", 1.0, -1.0) == pytest.approx(_loss("dpo", 1.0, -1.0))
    # label smoothing 0.1 on Delta = 1: 0.9 softplus(-0.1) + 0.1 softplus(0.1) = 0.579957 + 0.074440 = 0.654397
    out = _loss("aot", [1.0, 3.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0], label_smoothing=0.1)
    assert out == pytest.approx([0.654397, 0.654397], abs=1e-6)


def test_aot_unpaired_sorts_chosen_and_rejected_separately():
    # m_w = [2, -1], m_l = [0, 1]: sorted [-1, 2] - sorted [0, 1] = [-1, 1]
    # -> [softplus(0.1), softplus(-0.1)] = [0.744397, 0.644397]
    out = _loss("aot_unpaired", [2.0, -1.0], [0.0, 1.0])
    assert out == pytest.approx([0.744397, 0.644397], abs=1e-6)
    # pairwise the margins would be [2, -2]
    assert _loss("dpo", [2.0, -1.0], [0.0, 1.0]) == pytest.approx([0.598139, 0.798139], abs=1e-6)


def test_apo_zero_and_apo_down():
    # apo_zero: (1 - s(0.1)) + s(-0.1) = 0.475021 + 0.475021 = 0.950042
    assert _loss("apo_zero", 1.0, -1.0) == pytest.approx([0.950042], abs=1e-6)
    # apo_down: s(0.1) + (1 - s(0.2)) = 0.524979 + 0.450166 = 0.975145
    assert _loss("apo_down", 1.0, -1.0) == pytest.approx([0.975145], abs=1e-6)
    # the anchors, in the gradients at m_w = 1, m_l = -1 (s'(x) = s(x) s(-x): s'(0.1) = 0.249376, s'(0.2) = 0.247517)
    grads = {}
    for name in ("apo_zero", "apo_down"):
        cw, cl = _t(1.0).requires_grad_(True), _t(-1.0).requires_grad_(True)
        preference.compute(name, cw, cl, _t(0.0), _t(0.0)).sum().backward()
        grads[name] = (cw.grad.item(), cl.grad.item())
    # apo_zero: dL/dm_w = -0.1 s'(0.1) = -0.1 * 0.249376 = -0.0249376; dL/dm_l = 0.1 s'(-0.1) = 0.0249376
    assert grads["apo_zero"] == pytest.approx((-0.0249376, 0.0249376), abs=1e-7)
    # apo_down: dL/dm_w = 0.1 s'(0.1) - 0.1 s'(0.2) = 0.0249376 - 0.0247517 = 0.0001859 > 0 (chosen pushed down);
    # dL/dm_l = 0.1 s'(0.2) = 0.0247517 (rejected pushed down more)
    assert grads["apo_down"] == pytest.approx((0.0001859, 0.0247517), abs=1e-7)


def test_discopop():
    # z = 0.2, w = s(0.2 / 0.05) = s(4) = 0.982014:
    # (1 - 0.982014) * softplus(-0.2) + 0.982014 * exp(-0.2) = 0.017986 * 0.598139 + 0.982014 * 0.818731
    # = 0.010758 + 0.804006 = 0.814763
    assert _loss("discopop", 1.0, -1.0) == pytest.approx([0.814763], abs=1e-6)
    # policy = reference: z = 0, w = 1/2: 0.5 log 2 + 0.5 * 1 = 0.846574
    assert _loss("discopop", 0.0, 0.0) == pytest.approx([0.5 * math.log(2) + 0.5])
    # far below zero the weight vanishes and it is DPO's loss: z = -2, w = s(-40) ~ 4e-18
    assert _loss("discopop", -10.0, 10.0) == pytest.approx(_loss("dpo", -10.0, 10.0), rel=1e-12)
    # non-monotone at z = 0: dL/dz = -(1 - w) s(-z) - w e^-z + w (1 - w) / tau (e^-z - softplus(-z))
    # = -0.25 - 0.5 + 0.25 / 0.05 * (1 - log 2) = -0.75 + 1.534264 = 0.784264; dL/dlogpi_w = beta dL/dz = 0.0784264
    cw = _t(0.0).requires_grad_(True)
    preference.compute("discopop", cw, _t(0.0), _t(0.0), _t(0.0)).sum().backward()
    assert cw.grad.item() == pytest.approx(0.0784264, abs=1e-7)


# ---- peer: TRL's own loss code on the same random inputs ----


def _trl_loss(loss_type, cw, cl, rw, rl, *, beta, label_smoothing=0.0, discopop_tau=0.05):
    """TRL's batch-mean loss and its gradient on (chosen, rejected) policy sums, via ``_compute_loss``."""
    from trl.trainer.dpo_trainer import DPOTrainer

    b = cw.shape[0]
    logps = torch.cat([cw, cl]).detach().clone().requires_grad_(True)  # the batch is [chosen; rejected]
    zeros = torch.zeros(2 * b, 1, dtype=logps.dtype)
    outputs = SimpleNamespace(log_probs=logps[:, None], entropy=zeros, mean_logits=zeros,
                              is_top1=zeros.bool())
    accel = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accel, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        args=SimpleNamespace(discopop_tau=discopop_tau), _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
    )
    # one prompt token + one completion token per sequence: the completion's per-token log-prob is the sum
    inputs = {
        "input_ids": torch.zeros(2 * b, 2, dtype=torch.long),
        "attention_mask": torch.ones(2 * b, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[0, 1]] * (2 * b)),
        "ref_chosen_logps": rw,
        "ref_rejected_logps": rl,
    }
    loss = DPOTrainer._compute_loss(fake, lambda **_: outputs, inputs, False)
    loss.backward()
    return loss.detach(), logps.grad


# our parameter name for what TRL calls label_smoothing / discopop_tau, and a value to test it at
PEER_PARAMS = {
    "robust": ("flip_rate", "label_smoothing", 0.2),
    "exo_pair": ("epsilon", "label_smoothing", 0.01),
    "aot": ("label_smoothing", "label_smoothing", 0.1),
    "aot_unpaired": ("label_smoothing", "label_smoothing", 0.1),
    "discopop": ("tau", "discopop_tau", 0.05),
}


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_matches_trl(name, beta):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(10 * NEW.index(name) + int(10 * beta))
    b = 16
    # sequence sums of ~10-token completions; policy near the reference, as in training
    ref = -torch.rand(2, b, generator=g, dtype=torch.float64) * 30
    pol = ref + torch.randn(2, b, generator=g, dtype=torch.float64) * 3
    ours_kw, trl_kw = {"beta": beta}, {"beta": beta}
    if name in PEER_PARAMS:
        ours_name, trl_name, value = PEER_PARAMS[name]
        ours_kw[ours_name], trl_kw[trl_name] = value, value
    if name == "bco_pair":
        ours_kw["delta"] = 0.0  # TRL 1.16 has no reward shift (see the entry's docstring)

    cw, cl = pol[0].clone().requires_grad_(True), pol[1].clone().requires_grad_(True)
    ours_B = preference.compute(name, cw, cl, ref[0], ref[1], **ours_kw)
    ours_B.mean().backward()
    theirs, grad = _trl_loss(name, pol[0], pol[1], ref[0], ref[1], **trl_kw)
    diffs = [(ours_B.mean() - theirs).abs().item(), (cw.grad - grad[:b]).abs().max().item(),
             (cl.grad - grad[b:]).abs().max().item()]
    if name not in BATCH_COUPLED:  # per pair: one-pair batches
        per_pair = torch.stack([_trl_loss(name, pol[0][i:i + 1], pol[1][i:i + 1], ref[0][i:i + 1],
                                          ref[1][i:i + 1], **trl_kw)[0] for i in range(b)])
        diffs.append((ours_B.detach() - per_pair).abs().max().item())
    assert max(diffs) < 1e-5, diffs
    assert torch.isfinite(ours_B).all()


def test_bco_pair_delta_is_a_shift_trl_does_not_apply():
    # with delta != 0 ours departs from TRL 1.16 (which has none): the BCO paper's running-mean shift
    pytest.importorskip("trl")
    cw, cl, rw, rl = _t(-5.0, -7.0), _t(-8.0, -6.0), _t(-6.0, -6.5), _t(-7.0, -7.0)
    theirs, _ = _trl_loss("bco_pair", cw, cl, rw, rl, beta=0.1)
    assert preference.compute("bco_pair", cw, cl, rw, rl).mean().item() == pytest.approx(theirs.item(), abs=1e-12)
    assert preference.compute("bco_pair", cw, cl, rw, rl, delta=0.3).mean().item() != pytest.approx(theirs.item())


# ---- end to end: 2 steps of `posttrain dpo` on the tiny model ----

PAIRS = [{"q": "12+34=", "good": "64", "bad": "55"}, {"q": "51+57=", "good": "801", "bad": "9"},
         {"q": "20+13=", "good": "33", "bad": "34"}]


@pytest.mark.parametrize("name", NEW)
def test_two_step_dpo_run(name, tiny_cfg, quiet, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in PAIRS))
    cfg = tiny_cfg("dpo.pairs=file", f'dpo.path="{path}"', "dpo.fields={prompt='q', chosen='good', rejected='bad'}",
                   f"dpo.loss={name}", "dpo.steps=2", "dpo.warmup_steps=0", "dpo.lr=1e-3", "dpo.batch_size=4",
                   "checkpoint.every=0")
    summary = dpo_train(cfg, console=quiet)
    r = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [x["step"] for x in r] == [1, 2]
    assert all(math.isfinite(x["dpo/loss"]) for x in r)
    # step 1: policy = reference, so every log-ratio is 0 and the loss is the entry's value at zero
    # (hinge 1, robust/aot log 2, sppo_hard 2 * 5^2 = 50, nca/bco 2 log 2, apo 1, discopop 0.846574, ...)
    z = torch.zeros(3)
    assert r[0]["dpo/loss"] == pytest.approx(preference.compute(name, z, z, z, z).mean().item(), abs=1e-4)
    assert abs(r[1]["dpo/chosen_logratio"]) > 1e-4  # the first update moved the policy


def test_config_accepts_the_parameters_and_rejects_bad_values(tiny_cfg):
    assert tiny_cfg("dpo.loss=robust", "dpo.loss_params={flip_rate=0.2, beta=0.05}").dpo.loss == "robust"
    assert tiny_cfg("dpo.loss=discopop", "dpo.loss_params={tau=0.1}").dpo.loss == "discopop"
    with pytest.raises(ConfigError, match=r"flip_rate must lie in \[0, 0.5\); got 0.5"):
        tiny_cfg("dpo.loss=robust", "dpo.loss_params={flip_rate=0.5}")
    with pytest.raises(ConfigError, match=r"epsilon must lie in \(0, 1\); got 0.0"):
        tiny_cfg("dpo.loss=exo_pair", "dpo.loss_params={epsilon=0.0}")
    with pytest.raises(ConfigError, match=r"'bco_pair' has no parameter\(s\) \['label_smoothing'\]"):
        tiny_cfg("dpo.loss=bco_pair", "dpo.loss_params={label_smoothing=0.1}")
