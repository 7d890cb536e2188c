"""LoRA through peft (posttrain/models/lora.py): the adapter is the only trainable part, the
reference is the same module with the adapter off, the engine samples the adapted policy, and the
adapter saves, loads and merges exactly."""

import pytest
import torch

pytest.importorskip("peft")

from posttrain.config.model import LoraSettings
from posttrain.errors import ConfigError  # noqa: E402
from posttrain.learn.logprobs import completion_logits, completion_logprobs  # noqa: E402
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer  # noqa: E402
from posttrain.models.load import load_merged  # noqa: E402
from posttrain.models.lora import (  # noqa: E402
    AdapterDisabled,
    adapter_state_dict,
    apply_lora,
    engine_weights,
    export_merged,
    linear_module_names,
    load_adapter,
    merged_state_dict,
)
from posttrain.rollout import SamplingParams, make_engine  # noqa: E402
from posttrain.run.optim import make_optimizer  # noqa: E402

LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=48, seed=1)
    return build_tiny(tmp_path_factory.mktemp("tiny"), spec)


@pytest.fixture
def policy(tiny_dir):
    """(base module with the adapter injected, its PeftModel, tokenizer, the base weights before)."""
    model = load_model(str(tiny_dir))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = apply_lora(model, LORA, str(tiny_dir))
    return model, peft_model, load_tokenizer(str(tiny_dir)), before


def batch(tok):
    """Two prompts x two completions each (rows of a group share their prompt)."""
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "5+67=")]
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]]
    ids = torch.tensor([tok(s, add_special_tokens=False)["input_ids"] for s in ("64", "65", "27", "90")])
    return rows, ids, torch.ones(ids.shape)


def logp(model, tok):
    rows, ids, mask = batch(tok)
    with torch.no_grad():
        return completion_logprobs(model, rows, ids, mask, pad_id=tok.pad_token_id)[0]


def one_step(model, tok, lr=5e-2):
    """One AdamW step on -log pi of the batch (any loss with a gradient)."""
    opt = make_optimizer(model, lr, (0.9, 0.99), 0.0)
    rows, ids, mask = batch(tok)
    model.train()
    lp, _ = completion_logprobs(model, rows, ids, mask, pad_id=tok.pad_token_id)
    (-lp.sum()).backward()
    opt.step()
    return opt


def test_adapter_on_every_projection_and_only_it_trains(policy):
    model, peft_model, tok, before = policy
    assert peft_model.get_base_model() is model  # injected in place: the policy module carries the adapters
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 2 * 7 * 2
    opt = one_step(model, tok)
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    after = model.state_dict()
    for k, v in before.items():  # the base weights did not move (the LoRA layer renames them base_layer)
        name = k if k in after else k.replace(".weight", ".base_layer.weight")
        assert torch.equal(after[name], v), k


def test_reference_is_the_base_with_the_adapter_off(policy, tiny_dir):
    model, peft_model, tok, _ = policy
    ref = AdapterDisabled(peft_model)
    plain = load_model(str(tiny_dir))
    at_init = logp(model, tok)
    # B = 0 at init: the policy is the base, and the reference equals it exactly
    assert torch.equal(logp(ref, tok), at_init)
    assert torch.allclose(logp(plain, tok), at_init, atol=1e-6)
    one_step(model, tok)
    moved = logp(model, tok)
    assert not torch.allclose(moved, at_init, atol=1e-4)  # the adapter changed the policy
    assert torch.equal(logp(ref, tok), at_init)  # the reference did not move
    # the reference's whole-logits path (model(...)) too, and the adapter is back on afterwards
    rows, ids, mask = batch(tok)
    base_logits = completion_logits(ref, rows, ids, mask, pad_id=tok.pad_token_id)
    assert torch.allclose(base_logits, completion_logits(plain, rows, ids, mask, pad_id=tok.pad_token_id), atol=1e-5)
    assert model.training and torch.equal(logp(model, tok), moved)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_engine_samples_the_adapted_policy_and_sync_moves_only_the_version(policy):
    model, _, tok, _ = policy
    one_step(model, tok)
    engine = make_engine("hf", model, tok)
    weights = adapter_state_dict(model)
    assert weights and all(".lora_" in k for k in weights)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    engine.sync(weights, 3)  # the engine runs the same module: nothing to copy
    assert engine.version == 3 and {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "5+67=")]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, n=2), seed=0)
    rows = [p for p in prompts for _ in range(2)]
    with torch.no_grad():
        lp, _ = completion_logprobs(model, rows, out.token_ids, out.attention_mask, pad_id=tok.pad_token_id)
    m = out.loss_mask.bool()
    # the sampler's log-probs are the adapted policy's (its decode path runs the LoRA layers)
    assert torch.allclose(out.behaviour_logprobs[m], lp[m], atol=1e-4)


def test_adapter_saves_loads_and_merges(policy, tiny_dir, tmp_path):
    model, peft_model, tok, _ = policy
    one_step(model, tok)
    peft_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the adapter only
    other = apply_lora(load_model(str(tiny_dir)), LORA, str(tiny_dir))
    load_adapter(other, tmp_path / "ckpt")
    a, b = adapter_state_dict(model), adapter_state_dict(other.get_base_model())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = logp(model, tok)
    assert torch.allclose(logp(load_merged(tmp_path / "ckpt"), tok), want, atol=1e-5)
    out = export_merged(peft_model, tok, tmp_path / "merged")
    merged = load_model(str(out))
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())  # a plain HF model
    assert torch.allclose(logp(merged, tok), want, atol=1e-5)


def test_the_merged_state_dict_is_a_plain_model_of_the_adapted_policy_and_leaves_the_module_alone(policy,
                                                                                                   tiny_dir):
    # what a vLLM engine gets at every sync of a LoRA run: the base model's keys, W + (alpha / r) B A
    model, peft_model, tok, before = policy
    one_step(model, tok)  # B is no longer 0: the adapted policy differs from the base
    own = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(peft_model)
    assert merged.keys() == before.keys()  # every weight of the plain model, no adapter or base_layer names
    plain = load_model(str(tiny_dir))
    plain.load_state_dict(merged)
    want = logp(model, tok)
    assert torch.allclose(logp(plain, tok), want, atol=1e-5)
    assert not torch.allclose(logp(load_model(str(tiny_dir)), tok), want, atol=1e-3)  # the adapter matters
    after = model.state_dict()
    assert all(torch.equal(own[k], after[k]) for k in own)  # no merge / unmerge rounding left in the module

    class FullCopy:  # an engine with its own plain copy (vLLM) vs one over the policy module (hf)
        full_weights = True

    assert engine_weights(peft_model, FullCopy()).keys() == before.keys()
    assert engine_weights(model, FullCopy()).keys() == before.keys()  # the module the run trains, too
    hf = make_engine("hf", model, tok)
    assert engine_weights(model, hf).keys() == adapter_state_dict(model).keys()
    hf.sync(engine_weights(model, hf), 1)  # names the engine's module has


def test_an_adapter_that_does_not_fit_is_a_config_error(policy, tiny_dir, tmp_path):
    _, peft_model, _, _ = policy
    peft_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    other = apply_lora(load_model(str(tiny_dir)), LoraSettings(rank=8), str(tiny_dir))
    with pytest.raises(ConfigError, match="does not fit model.lora"):
        load_adapter(other, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="holds no LoRA adapter"):
        load_adapter(other, tmp_path)


def test_unknown_target_module_lists_the_models_linear_modules(tiny_dir):
    model = load_model(str(tiny_dir))
    assert linear_module_names(model) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['c_attn'\].*'q_proj'"):
        apply_lora(model, LoraSettings(rank=4, target_modules=["q_proj", "c_attn"]))
