"""The keyword under which a Hugging Face model's ``forward`` takes its KV cache.

Recent transformers releases (5.25 here) name it ``cache`` and deprecate ``past_key_values``;
earlier ones (5.17, the release on the GPU machines of this project) know only ``past_key_values``
and swallow an unknown ``cache=`` without a word, so a forward meant to continue a cached prefix
would silently run without it (wrong log-probs, a model that learns nothing). Every call that
passes a cache goes through :func:`with_cache`.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


@functools.cache
def _cache_keyword(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model: nn.Module, cache: object) -> dict[str, object]:
    """``{keyword: cache}`` for ``model(**inputs, **with_cache(model, cache))``; a PEFT wrapper is
    looked through to the model it wraps.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base)): cache}
