"""Rollout engines behind one interface (``base.RolloutEngine``)."""

from posttrain.rollout.base import Completions, RolloutEngine, SamplingParams
from posttrain.rollout.hf import HFEngine

ENGINES = ("hf",)

__all__ = ["ENGINES", "Completions", "HFEngine", "RolloutEngine", "SamplingParams"]
