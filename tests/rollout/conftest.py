"""Fixtures shared by the rollout tests."""

import pytest

from posttrain.models import TinySpec, build_tiny, encode_chat, load_tokenizer


@pytest.fixture(scope="module")
def arith_tiny(tmp_path_factory):
    """A small random tiny model's directory, its tokenizer and four chat-templated sums (the resubmit tests)."""
    d = build_tiny(tmp_path_factory.mktemp("m"), TinySpec(hidden_size=32, intermediate_size=64, num_layers=2,
                                                          max_positions=64))
    tok = load_tokenizer(str(d))
    prompts = [encode_chat(tok, t) for t in ("12+3=", "7+45=", "1+1=", "30+4=")]
    return d, tok, prompts
