"""``model.autocast = "bfloat16"``: bfloat16 matmuls with fp32 weights, gradients and AdamW, in the
engine's sampling and the learner's update; numbers close to fp32's, and really computed in bf16."""

import json

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.learn.chunked import token_logprobs
from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer, onednn
from posttrain.models.precision import active_dtype, autocast_dtype, compute
from posttrain.rollout import HFEngine, SamplingParams, fast_llama
from posttrain.train import rl

BF16 = torch.bfloat16


def test_the_setting_names_the_dtype_and_the_context_sets_it():
    assert autocast_dtype("off") is None and autocast_dtype("bfloat16") is BF16
    with compute("cpu", BF16):
        assert active_dtype("cpu") is BF16
        assert (torch.ones(2, 3) @ torch.ones(3, 2)).dtype is BF16
    assert active_dtype("cpu") is None
    with compute("cpu", None):
        assert (torch.ones(2, 3) @ torch.ones(3, 2)).dtype is torch.float32


@pytest.mark.parametrize("keep_bytes", [1 << 30, 0])  # probabilities kept for the backward / recomputed there
def test_the_fused_head_runs_its_backward_in_the_forwards_dtype(keep_bytes, monkeypatch):
    # the head's gradient matmuls (dL/dh = G W, dL/dW = G^T h) run in bf16 when the forward did: their result is
    # the fp32 one up to bf16 rounding (~1e-2 relative), not equal to it; the gradients stay fp32 tensors
    from posttrain.learn import fused_head

    monkeypatch.setattr(fused_head, "KEEP_BYTES", keep_bytes)
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(64, 500, bias=False)
    hidden = torch.randn(4, 6, 64, generator=g, requires_grad=True)
    ids = torch.randint(0, 500, (4, 6), generator=g)
    w = torch.randn(4, 6, generator=g)
    grads = {}
    for low in (None, BF16):
        with compute("cpu", low):
            logp, _, _ = token_logprobs(head, hidden, ids, chunk_tokens=7)
            (w * logp).sum().backward()
        grads[low] = (logp.detach(), hidden.grad.clone(), head.weight.grad.clone())
        hidden.grad, head.weight.grad = None, None
    for a, b in zip(grads[BF16], grads[None], strict=True):
        assert a.dtype is torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))
        assert (a - b).abs().max() > 1e-6  # computed in bf16, not fp32


@pytest.mark.parametrize("group_bytes", [500 * 2 * 7, 1 << 30])  # one chunk of 7 rows per group / one group
@pytest.mark.parametrize("bias, tau", [(False, 1.0), (True, 0.7)])
def test_the_fused_heads_grouped_bf16_backward_is_autocasts_own(group_bytes, bias, tau, monkeypatch):
    # under autocast the backward gathers the chunks' logit gradients in bf16 and runs each gradient matmul once
    # per group; the result is what autograd through a plain bf16 linear gives (its own fp32-accumulating
    # matmuls), whether the 24 rows come as 4 groups of 7 or one group
    from posttrain.learn import fused_head

    monkeypatch.setattr(fused_head, "GROUP_BYTES", group_bytes)
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(64, 500, bias=bias)
    hidden = torch.randn(4, 6, 64, generator=g, requires_grad=True)
    ids, w = torch.randint(0, 500, (4, 6), generator=g), torch.randn(4, 6, generator=g)
    with compute("cpu", BF16):
        logp, _, _ = token_logprobs(head, hidden, ids, temperature=tau, chunk_tokens=7)
        (w * logp).sum().backward()
    ours = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    for t in (hidden, *head.parameters()):
        t.grad = None
    with compute("cpu", BF16):  # the reference: autograd through the whole [24, 500] logits
        z = head(hidden).float() / tau
        ref_logp = z.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
        (w * ref_logp).sum().backward()
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-4, atol=1e-4)
    ref = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * float(b.abs().max()))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = TinySpec(hidden_size=64, intermediate_size=128, num_layers=2, max_positions=40)
    return build_tiny(tmp_path_factory.mktemp("m"), spec)


@pytest.mark.parametrize("fast", [True, False])
def test_the_engine_samples_with_bf16_matmuls_close_to_the_learners_recomputation(tiny_dir, fast):
    model, tok = load_model(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    engine = HFEngine(model, tok, fast=fast, autocast=BF16)
    assert engine.fast == fast
    prompts = [encode_chat(tok, t) for t in ("12+3=", "7+45=", "1+1=")]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, n=4, min_new_tokens=8), seed=0)
    assert all(p.dtype is torch.float32 for p in model.parameters())  # sampling cast nothing in place
    rows, m = [p for p in prompts for _ in range(4)], out.loss_mask.bool()
    got = {}
    for low in (BF16, None):
        with torch.no_grad(), compute("cpu", low):
            got[low], _ = completion_logprobs(model, rows, out.token_ids, out.attention_mask, pad_id=engine.pad_id)
    gap_bf16 = (got[BF16][m] - out.behaviour_logprobs[m]).abs()
    gap_fp32 = (got[None][m] - out.behaviour_logprobs[m]).abs()
    print(f"\nsampler vs learner, mean |d log p|: bf16 {gap_bf16.mean():.2e}, fp32 {gap_fp32.mean():.2e}")
    assert gap_bf16.max() < 0.1 and gap_fp32.max() < 0.1
    assert gap_fp32.max() > 1e-5  # the sampler's matmuls were bf16


def test_the_transposed_decode_copy_is_made_in_the_compute_dtype():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    f = fast_llama.linear(lin, True, BF16)
    with torch.no_grad(), compute("cpu", BF16):
        y = f(x)
    assert y.dtype is BF16
    torch.testing.assert_close(y.float(), lin(x).detach(), rtol=0.03, atol=0.03)


@pytest.mark.skipif(onednn.OPS is None, reason="this torch build has no oneDNN weight prepacking")
def test_the_bf16_decode_weights_are_prepacked_and_compute_a_plain_bf16_linear():
    # a bf16 copy of W packed once into oneDNN's layout (not reordered at every call): the same numbers as
    # autocast's linear (W and x cast to bf16, one bf16 matmul), 2-D and 3-D inputs, with and without a bias
    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(16, 8, bias=bias)
        f = fast_llama.linear(lin, True, BF16)
        for x in (torch.randn(5, 16), torch.randn(2, 3, 16)):
            with torch.no_grad(), compute("cpu", BF16):
                want = lin(x)
                got = f(x)
            assert got.dtype is BF16 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_bf16_decode_on_packed_weights_samples_as_the_modules_do(tiny_dir, monkeypatch):
    # enough decode work for the weight copies (forced here): the prepacked bf16 linears draw the same tokens
    # and log-probs as the model's own modules under autocast
    model, tok = load_model(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    prompts = [encode_chat(tok, t) for t in ("12+3=", "7+45=", "1+1=")]
    sp = SamplingParams(max_new_tokens=8, n=4, min_new_tokens=8)
    engine = HFEngine(model, tok, autocast=BF16)
    assert engine.fast
    plain = engine.generate(prompts, sp, seed=0)
    monkeypatch.setattr(fast_llama, "TRANSPOSE_MIN_TOKENS", 1)
    packed = engine.generate(prompts, sp, seed=0)
    assert torch.equal(packed.token_ids, plain.token_ids)
    torch.testing.assert_close(packed.behaviour_logprobs, plain.behaviour_logprobs, rtol=0, atol=1e-3)


def test_a_run_with_bf16_autocast_trains_fp32_weights_and_optimizer(tmp_path, quiet, length_reward):
    cfg = load_config("recipes/tiny.toml", [*length_reward,
        f'out="{tmp_path / "run"}"', "train.steps=3", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=3", "eval.every=0", 'model.autocast="bfloat16"',
    ])
    rl.train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["train/optimizer_steps"] >= 1 for r in rows)
    assert all(abs(r["loss"]) < 1e3 and r["optim/grad_norm"] > 0 for r in rows)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    assert load_model(str(ckpt)).dtype is torch.float32
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    assert state and all(v["exp_avg"].dtype is torch.float32 for v in state.values())


def test_autocast_is_refused_where_it_would_do_nothing():
    with pytest.raises(ConfigError, match="needs model.dtype = 'float32'"):
        load_config("recipes/tiny.toml", ['model.autocast="bfloat16"', 'model.dtype="bfloat16"'])


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_sft_dpo_and_rm_train_under_the_runs_autocast(command, tmp_path, quiet):
    # model.autocast applies to every trainer: the first step's loss (DPO's gradient norm: its loss is log 2 while
    # the policy is the reference) is the fp32 one up to bf16 rounding, not equal to it
    from posttrain.trainers.dpo import dpo_train
    from posttrain.trainers.rm import rm_train
    from posttrain.trainers.sft import sft

    recipe, run, key, steps = {
        "sft": ("tiny.toml", sft, "sft/loss", "sft.steps=1"),
        "dpo": ("dpo.toml", dpo_train, "optim/grad_norm", "dpo.steps=1"),  # its loss is log 2 at the start
        "rm": ("rm.toml", rm_train, "rm/loss", "rm.steps=1"),
    }[command]
    losses = {}
    for autocast in ("off", "bfloat16"):
        out = tmp_path / autocast
        cfg = load_config(f"recipes/{recipe}", [
            f'out="{out}"', steps, "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
            "checkpoint.every=0", f'model.autocast="{autocast}"', "dpo.prompts_per_refresh=16", "dpo.eval_every=0",
            "rm.eval_every=0", "sft.eval_every=100", "sft.eval_prompts=4",
        ])
        run(cfg, console=quiet)
        losses[autocast] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])[key]
    print(f"\n{command} first-step {key}: fp32 {losses['off']:.6f}, bf16 autocast {losses['bfloat16']:.6f}")
    assert losses["bfloat16"] == pytest.approx(losses["off"], rel=0.05, abs=1e-3)
    assert losses["bfloat16"] != losses["off"]
