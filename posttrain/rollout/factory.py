"""The one factory of rollout engines: :func:`make_engine` by name, :func:`engine_for` by a run's config.

Kept apart from the package's ``__init__`` so that the Ray rollout workers (``ray_engine.py``), which the
package builds, can build their own engine without importing the package back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from posttrain.models.precision import autocast_dtype
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.hf import HFEngine

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ENGINES = ("hf", "vllm")


def make_engine(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    params: Mapping[str, object] | None = None,
    seed: int = 0,
    autocast: torch.dtype | None = None,
) -> RolloutEngine:
    """The rollout engine ``name`` (``rollout.engine``, its ``rollout.engine_params``) over the policy
    ``model``: the one place every caller (train, sft, dpo, eval, demo) gets an engine from.

    ``hf`` samples with the policy module itself (``sync`` then only moves the version); ``vllm``
    loads a copy of the weights as they are now and takes new ones at every ``sync``. ``autocast``:
    the hf engine's matmul dtype (``model.autocast``); vLLM keeps its own dtype.
    """
    if name == "hf":
        return HFEngine(model, tokenizer, autocast=autocast)
    if name == "vllm":
        from posttrain.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, seed=seed, **dict(params or {}))
    raise ValueError(f"rollout.engine = {name!r} is not one of {list(ENGINES)}")


def engine_for(cfg: object, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutEngine:
    """:func:`make_engine` as a run's config asks: ``rollout.engine``, its ``engine_params``, ``seed``."""
    return make_engine(cfg.rollout.engine, model, tokenizer, cfg.rollout.engine_params, cfg.seed,
                       autocast_dtype(cfg.model.autocast))
