"""with_cache: the KV cache goes under the keyword the model's forward declares (transformers 5.17
knows only ``past_key_values`` and silently ignores ``cache=``; 5.25 names it ``cache``)."""

import inspect

from torch import nn
from transformers import LlamaForCausalLM

from posttrain.models.cache_arg import with_cache


class OldStyle(nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


class NewStyle(nn.Module):
    def forward(self, input_ids=None, cache=None, **kwargs):
        return cache


class Wrapper(nn.Module):  # a PEFT-like wrapper: forward(*args, **kwargs), get_base_model()
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        return self.base


def test_keyword_follows_the_forward_signature():
    token = object()
    for cls, key in ((OldStyle, "past_key_values"), (NewStyle, "cache")):
        model = cls()
        assert with_cache(model, token) == {key: token}
        assert model(**with_cache(model, token)) is token  # the cache reaches forward
        assert with_cache(Wrapper(model), token) == {key: token}  # looked through the wrapper


def test_installed_transformers_gets_its_own_keyword():
    params = inspect.signature(LlamaForCausalLM.forward).parameters
    (key,) = with_cache(LlamaForCausalLM.__new__(LlamaForCausalLM), None)
    assert key in params
