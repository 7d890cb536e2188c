import pytest
import torch
from transformers import LlamaForCausalLM

from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.rollout import HFEngine, SamplingParams, fast_llama
from posttrain.rollout.sampling import filter_logits


def gqa_model(d):
    """The tiny model's shape with grouped-query attention (4 query heads share 2 K/V heads) and tied
    embeddings, as SmolLM2 (9 query heads over 3 K/V heads).
    """
    cfg = load_model(str(d)).config
    cfg.num_key_value_heads, cfg.tie_word_embeddings = 2, True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["fast", "generic", "fast-gqa", "generic-gqa"])
def engine(request, tmp_path_factory):
    d = build_tiny(
        tmp_path_factory.mktemp("m"),
        TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=40),
    )
    model = gqa_model(d) if request.param.endswith("gqa") else load_model(str(d))
    eng = HFEngine(model, load_tokenizer(str(d)), fast=request.param.startswith("fast"))
    assert eng.fast == request.param.startswith("fast")
    return eng


def prompts(engine, texts=("12+3=", "7+45=", "1+1=")):
    # different lengths exercise left padding
    return [encode_chat(engine.tokenizer, t) for t in texts]


def test_shapes_and_group_layout(engine):
    c = engine.generate(
        prompts(engine), SamplingParams(max_new_tokens=6, n=4), seed=0
    )
    assert c.token_ids.shape[0] == 12 and c.token_ids.shape[1] <= 6
    assert c.loss_mask.shape == c.behaviour_logprobs.shape == c.token_ids.shape
    assert len(c.texts) == 12 and c.n == 4
    assert (c.behaviour_logprobs <= 0).all()
    assert (c.behaviour_logprobs[c.loss_mask == 0] == 0).all()


def test_mask_stops_after_eos(engine):
    c = engine.generate(
        prompts(engine), SamplingParams(max_new_tokens=12, n=8), seed=1
    )
    eos = engine.eos_id
    for row, m, done in zip(c.token_ids, c.loss_mask, c.finished, strict=True):
        n = int(m.sum())
        assert (m[:n] == 1).all() and (m[n:] == 0).all()  # a prefix
        if done:
            assert row[n - 1] == eos and (row[: n - 1] != eos).all()  # EOS is the last masked token
        else:
            assert n == c.token_ids.shape[1] and (row != eos).all()


def test_logprobs_equal_teacher_forced_forward(engine):
    p = prompts(engine)
    c = engine.generate(
        p, SamplingParams(max_new_tokens=8, n=3, temperature=0.8), seed=2
    )
    rows = [x for x in p for _ in range(3)]
    with torch.no_grad():
        lp, _ = completion_logprobs(
            engine.model, rows, c.token_ids, c.loss_mask, pad_id=engine.pad_id, temperature=0.8
        )
    torch.testing.assert_close(lp * c.loss_mask, c.behaviour_logprobs * c.loss_mask, atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_equals_top_k_1(engine):
    p = prompts(engine)
    a = engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0))
    b = engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0))
    k1 = engine.generate(
        p, SamplingParams(max_new_tokens=6, top_k=1), seed=5
    )
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.token_ids, k1.token_ids)


def test_greedy_matches_model_generate(engine):
    p = prompts(engine, ("12+3=",))
    ours = engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0))
    ref = engine.model.generate(
        torch.tensor(p),
        do_sample=False,
        max_new_tokens=6,
        eos_token_id=engine.eos_id,
        pad_token_id=engine.pad_id,
    )[0, len(p[0]) :]
    n = int(ours.loss_mask[0].sum())
    assert ours.token_ids[0, :n].tolist() == ref[:n].tolist()


def test_seeded_sampling_is_reproducible(engine):
    sp = SamplingParams(max_new_tokens=6, n=4)
    a = engine.generate(prompts(engine), sp, seed=7)
    b = engine.generate(prompts(engine), sp, seed=7)
    assert torch.equal(a.token_ids, b.token_ids)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, top_k=0, top_p=0.8).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = filter_logits(logits, top_k=3, top_p=1.0).isfinite()[0].tolist()
    assert kept == [True, True, True, False]


def test_prompt_longer_than_context_is_a_clear_error(engine):
    long = [engine.tokenizer.bos_token_id] * 60
    with pytest.raises(ValueError, match="context"):
        engine.generate([long], SamplingParams(max_new_tokens=4))


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_shared_prefix_logprobs_and_grads_equal_unshared(engine):
    p = prompts(engine)
    c = engine.generate(p, SamplingParams(max_new_tokens=7, n=4), seed=3)
    rows = [x for x in p for _ in range(4)]
    model = engine.model
    results = []
    for share in (True, False):
        model.zero_grad()
        lp, ent = completion_logprobs(
            model, rows, c.token_ids, c.loss_mask, pad_id=engine.pad_id, with_entropy=True, share_prefix=share
        )
        (lp * c.loss_mask).sum().backward()
        results.append((lp.detach() * c.loss_mask, ent * c.loss_mask, [q.grad.clone() for q in model.parameters()]))
    (a, ea, ga), (b, eb, gb) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(ea, eb, atol=1e-5, rtol=0)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_min_new_tokens_delays_eos_and_keeps_policy_logprobs(engine):
    p = prompts(engine)
    sp = SamplingParams(max_new_tokens=8, n=4, min_new_tokens=8)
    c = engine.generate(p, sp, seed=4)
    assert c.token_ids.shape[1] == 8 and (c.loss_mask == 1).all()
    assert not (c.token_ids == engine.eos_id).any()
    rows = [x for x in p for _ in range(4)]
    with torch.no_grad():
        lp, _ = completion_logprobs(engine.model, rows, c.token_ids, c.loss_mask, pad_id=engine.pad_id)
    torch.testing.assert_close(lp, c.behaviour_logprobs, atol=1e-4, rtol=0)


def test_fast_and_generic_paths_agree(engine):
    other = HFEngine(engine.model, engine.tokenizer, fast=not engine.fast)
    p = prompts(engine)
    a = engine.generate(p, SamplingParams(max_new_tokens=8, temperature=0.0, n=2))
    b = other.generate(p, SamplingParams(max_new_tokens=8, temperature=0.0, n=2))
    assert torch.equal(a.token_ids, b.token_ids)
    torch.testing.assert_close(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-4, rtol=0)


def test_fast_linear_equals_the_module():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8)
    for bias in (True, False):
        lin = torch.nn.Linear(8, 6, bias=bias)
        assert fast_llama.linear(lin, True) is not lin
        torch.testing.assert_close(fast_llama.linear(lin, True)(x), lin(x))
        assert fast_llama.linear(lin, False) is lin
    # a module with a hook (or any other module, e.g. a LoRA-wrapped layer) is called as it is
    lin.register_forward_hook(lambda mod, args, out: out * 2)
    assert fast_llama.linear(lin, True) is lin


def test_fast_path_with_transposed_weights_equals_teacher_forced(engine, monkeypatch):
    # the tiny tests decode too few tokens for the transposed copies: force them
    if not engine.fast:
        pytest.skip("fast path only")
    monkeypatch.setattr(fast_llama, "TRANSPOSE_MIN_TOKENS", 1)
    p = prompts(engine)
    c = engine.generate(p, SamplingParams(max_new_tokens=8, n=3, temperature=0.8), seed=2)
    rows = [x for x in p for _ in range(3)]
    with torch.no_grad():
        lp, _ = completion_logprobs(engine.model, rows, c.token_ids, c.loss_mask, pad_id=engine.pad_id,
                                    temperature=0.8)
    torch.testing.assert_close(lp * c.loss_mask, c.behaviour_logprobs * c.loss_mask, atol=1e-4, rtol=0)


def test_fast_path_runs_lora_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    d = build_tiny(tmp_path, TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=40))
    model = peft.get_peft_model(
        load_model(str(d)), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    ).get_base_model()
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter): make it change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    fast = HFEngine(model, load_tokenizer(str(d)))
    assert fast.fast
    p = prompts(fast)
    c = fast.generate(p, SamplingParams(max_new_tokens=6, n=2), seed=0)
    rows = [x for x in p for _ in range(2)]
    with torch.no_grad():
        lp, _ = completion_logprobs(model, rows, c.token_ids, c.loss_mask, pad_id=fast.pad_id)
    torch.testing.assert_close(lp * c.loss_mask, c.behaviour_logprobs * c.loss_mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
@pytest.mark.parametrize("copies", [True, False])
def test_fast_path_on_qwen2_and_mistral_equals_teacher_forced(arch, copies, tmp_path, monkeypatch):
    # qwen2 has q/k/v biases (stacked into the fused q|k|v copy, the query's scaled with its rows);
    # both with grouped-query attention; with ``copies`` every linear runs on a weight copy with the
    # norms' weights folded in, without them the modules are called
    from transformers import AutoConfig, AutoModelForCausalLM

    d = build_tiny(tmp_path, TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=40))
    tok = load_tokenizer(str(d))
    cfg = AutoConfig.for_model(arch, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, tie_word_embeddings=arch == "qwen2", sliding_window=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():  # nonzero biases and norm weights, so that folding them is tested
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    monkeypatch.setattr(fast_llama, "TRANSPOSE_MIN_TOKENS", 1 if copies else 1 << 30)
    eng = HFEngine(model, tok)
    assert eng.fast
    p = prompts(eng)
    c = eng.generate(p, SamplingParams(max_new_tokens=8, n=3, temperature=0.8), seed=2)
    rows = [x for x in p for _ in range(3)]
    with torch.no_grad():
        lp, _ = completion_logprobs(model, rows, c.token_ids, c.loss_mask, pad_id=eng.pad_id, temperature=0.8)
    torch.testing.assert_close(lp * c.loss_mask, c.behaviour_logprobs * c.loss_mask, atol=1e-4, rtol=0)


def test_fused_linears_with_folded_scales_equal_the_modules():
    torch.manual_seed(0)
    x = torch.randn(5, 1, 8)
    mods = [torch.nn.Linear(8, 6, bias=True), torch.nn.Linear(8, 2, bias=False), torch.nn.Linear(8, 3, bias=True)]
    cols, scales = torch.rand(8) + 0.5, [0.125, 1.0, 3.0]
    want = torch.cat([m(x * cols) * s for m, s in zip(mods, scales, strict=True)], -1)
    torch.testing.assert_close(fast_llama.fused(mods, True, None, cols, scales)(x), want)
    # in bf16 (prepacked where this torch has it): the same within bf16 rounding
    torch.testing.assert_close(fast_llama.fused(mods, True, torch.bfloat16, cols, scales)(x).float(), want,
                               atol=0.05, rtol=0.02)
    # without copies the modules are called as they are (no folding: the caller keeps its norm weight)
    torch.testing.assert_close(fast_llama.fused(mods, False)(x), torch.cat([m(x) for m in mods], -1))
    assert not fast_llama.copies(mods, False) and fast_llama.copies(mods, True)


def test_a_folded_rms_norm_times_its_weight_is_the_module():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(4, 8) * 3
    torch.testing.assert_close(fast_llama.unit_norm(norm)(x) * norm.weight, norm(x))
    assert fast_llama.unit_norm(torch.nn.LayerNorm(8)) is None  # only the RMSNorms it knows
