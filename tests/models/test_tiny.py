import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from posttrain.models import ModelLoadError, TinySpec, build_tiny, encode_chat, load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(
        tmp_path_factory.mktemp("tiny"), TinySpec(hidden_size=32, intermediate_size=64, num_layers=1)
    )


def test_round_trip_through_auto_classes(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tiny_dir / "model.safetensors").exists()
    # 7 special/role tokens + 13 characters
    assert len(tok) == 7 + 13 == model.config.vocab_size
    assert tok.bos_token and tok.eos_token and tok.pad_token


def test_same_seed_same_weights(tmp_path):
    a = load_model(str(build_tiny(tmp_path / "a", TinySpec(num_layers=1, seed=3))))
    b = load_model(str(build_tiny(tmp_path / "b", TinySpec(num_layers=1, seed=3))))
    for (_, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y)


def test_char_tokenizer_encodes_each_character_and_decodes_back(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    ids = tok("12+345=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7
    assert tok.decode(ids) == "12+345="


def test_chat_template_wraps_user_message(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    ids = encode_chat(tok, "12+34=")
    assert tok.convert_ids_to_tokens(ids) == [
        "<|bos|>",
        "<|user|>",
        "1",
        "2",
        "+",
        "3",
        "4",
        "=",
        "<|assistant|>",
    ]


def test_missing_model_path_has_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))
