"""Rollout engines behind one interface (``base.RolloutEngine``), built by :func:`make_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.batch import Rollout, concat_rollouts
from posttrain.rollout.hf import HFEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ENGINES = ("hf",)


def make_engine(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutEngine:
    """The rollout engine ``name`` (``rollout.engine``) over the policy ``model``: the one place
    every caller (train, sft, dpo, eval, demo) gets an engine from.

    ``hf`` samples with the policy module itself (``sync`` then only moves the version).
    """
    if name == "hf":
        return HFEngine(model, tokenizer)
    raise ValueError(f"rollout.engine = {name!r} is not one of {list(ENGINES)}")


__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "concat_rollouts", "make_engine"]
