"""Logit averaging with a frozen reference (``algorithm.parameterization = "ref_logit_mix"``):
the mixture's numbers, its KV cache shared by both trunks, and its gradient reaching only the policy.
"""

import math

import pytest
import torch

from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer, parameterization
from posttrain.models.ref_mix import RefLogitMix, mix_logits
from posttrain.rollout import HFEngine, SamplingParams


def test_the_catalog_example():
    # z_theta = [2, 0], z_ref = [0, 0], w = 0.5: z_mix = [1, 0], pi_mix = [e / (e + 1), 1 / (e + 1)]
    p = mix_logits(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), 0.5).softmax(-1)
    e = math.e
    torch.testing.assert_close(p, torch.tensor([e / (e + 1), 1 / (e + 1)]), atol=1e-7, rtol=0)
    torch.testing.assert_close(p, torch.tensor([0.731059, 0.268941]), atol=1e-6, rtol=0)
    # w = 0.25: z_mix = 0.75 [2, 0] + 0.25 [4, 0] = [2.5, 0]
    torch.testing.assert_close(mix_logits(torch.tensor([2.0, 0.0]), torch.tensor([4.0, 0.0]), 0.25),
                               torch.tensor([2.5, 0.0]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=40)
    return build_tiny(tmp_path_factory.mktemp("m"), spec)


def moved_mix(d, weight=0.5):
    """(policy, reference, mixture): the policy's weights moved off the start, as after some training."""
    policy, ref = load_model(str(d)), load_model(str(d))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return policy, ref, RefLogitMix(policy, ref, weight)


def test_the_forward_mixes_the_two_models_logits(tiny_dir):
    policy, ref, mix = moved_mix(tiny_dir, 0.5)
    ids = torch.tensor([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]])
    with torch.no_grad():
        want = 0.5 * policy(input_ids=ids).logits + 0.5 * ref(input_ids=ids, use_cache=False).logits
        got = mix(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert (got - policy(input_ids=ids).logits).abs().max() > 0.1  # not the policy alone


def test_sampled_log_probs_equal_the_learners_recomputation_through_the_shared_cache(tiny_dir):
    # the engine's generic path (prefill once, the cache repeated for the group, then decode) and the
    # learner's (prefix shared and gathered, or the full rows) both run the two trunks on ONE cache: the
    # sampler's log-probs and the recomputed ones agree only if each trunk kept its own layers' keys/values
    policy, _, mix = moved_mix(tiny_dir)
    tok = load_tokenizer(str(tiny_dir))
    engine = HFEngine(mix, tok)
    assert not engine.fast  # the mixture runs its own forward
    prompts = [encode_chat(tok, t) for t in ("12+3=", "7+45=", "1+1=")]  # lengths differ: left padding
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, n=4, min_new_tokens=8), seed=0)
    rows = [p for p in prompts for _ in range(4)]
    m = out.loss_mask.bool()
    for share in (True, False):
        with torch.no_grad():
            lp, _ = completion_logprobs(mix, rows, out.token_ids, out.attention_mask, pad_id=engine.pad_id,
                                        share_prefix=share)
        torch.testing.assert_close(lp[m], out.behaviour_logprobs[m], atol=1e-5, rtol=0)
    with torch.no_grad():  # the policy alone is another distribution
        alone, _ = completion_logprobs(policy, rows, out.token_ids, out.attention_mask, pad_id=engine.pad_id)
    assert (alone[m] - out.behaviour_logprobs[m]).abs().max() > 0.05


def test_the_gradient_reaches_the_policy_only_scaled_by_one_minus_w(tiny_dir):
    # z_mix = (1 - w) z_theta + w z_ref with z_ref frozen: d<c, z_mix>/dtheta = (1 - w) d<c, z_theta>/dtheta
    policy, ref, mix = moved_mix(tiny_dir, 0.25)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    c = torch.randn(policy(input_ids=ids).logits.shape, generator=torch.Generator().manual_seed(1))
    (mix(input_ids=ids).logits * c).sum().backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    assert all(p.grad is None for p in ref.parameters())
    policy.zero_grad()
    (policy(input_ids=ids).logits * c).sum().backward()
    for n, p in policy.named_parameters():
        torch.testing.assert_close(got[n], 0.75 * p.grad, atol=2e-5, rtol=1e-4)


def test_the_reference_stays_frozen_in_eval_mode_on_its_own_cache_layers(tiny_dir):
    _, ref, mix = moved_mix(tiny_dir)
    mix.train()
    assert mix.policy.training and not mix.ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert [layer.self_attn.layer_idx for layer in ref.model.layers] == [2, 3]  # after the policy's 0, 1
    assert [layer.self_attn.layer_idx for layer in mix.policy.model.layers] == [0, 1]
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        RefLogitMix(load_model(str(tiny_dir)), load_model(str(tiny_dir)), 1.0)


def test_the_registry_builds_the_reference_only_when_the_entry_needs_one(tiny_dir):
    policy, loads = load_model(str(tiny_dir)), []

    def reference():
        loads.append(1)
        return load_model(str(tiny_dir))

    assert parameterization.REGISTRY.get("plain")(policy, reference) is policy and not loads
    mix = parameterization.REGISTRY.get("ref_logit_mix")(policy, reference, weight=0.5)
    assert isinstance(mix, RefLogitMix) and mix.policy is policy and loads == [1]
    assert parameterization.needs_reference("ref_logit_mix") and not parameterization.needs_reference("plain")


def test_eval_of_a_logit_mix_run_evaluates_the_mixture(tmp_path, quiet):
    # posttrain eval --model RUN reads the run's parameterization and mixes its saved theta with the run's
    # starting model again (what it trained and sampled); a bare model directory cannot say what to mix with
    import shutil

    from posttrain.config import ConfigError, load_config
    from posttrain.evaluation.run import run_eval
    from posttrain.train import rl

    quiet_log = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "eval.every=0"]
    run = tmp_path / "run"
    rl.train(load_config("recipes/ref_logit_mix.toml", [f'out="{run}"', "train.steps=1", *quiet_log]), console=quiet)
    cfg = load_config("recipes/tiny.toml", [f'out="{tmp_path / "eval"}"', "eval.prompts=4", "eval.n=1"])
    assert run_eval(cfg, model=str(run), console=quiet)["parameterization"] == "ref_logit_mix"
    bare = tmp_path / "theta"
    shutil.copytree(sorted((run / "checkpoints").glob("step_*"))[-1], bare)
    assert run_eval(cfg, model=str(bare), console=quiet)["parameterization"] == "plain"  # theta alone
    mix_cfg = load_config("recipes/ref_logit_mix.toml", [f'out="{tmp_path / "eval2"}"'])
    with pytest.raises(ConfigError, match="give --model the run directory"):
        run_eval(mix_cfg, model=str(bare), console=quiet)
