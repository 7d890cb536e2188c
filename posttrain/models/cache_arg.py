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
def _declared_keyword(cls: type) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def with_cache(model: nn.Module, cache: object) -> dict[str, object]:
    """``{keyword: cache}`` for ``model(**inputs, **with_cache(model, cache))``. Wrappers whose
    ``forward`` takes ``**kwargs`` (PEFT's) are looked through (``get_base_model()``, ``.model``) to
    the first module that declares one of the two keywords.
    """
    m: object = model
    for _ in range(4):
        key = _declared_keyword(type(m))
        if key is not None:
            return {key: cache}
        inner = m.get_base_model() if hasattr(m, "get_base_model") else getattr(m, "model", None)
        if not isinstance(inner, nn.Module) or inner is m:
            break
        m = inner
    return {"past_key_values": cache}
