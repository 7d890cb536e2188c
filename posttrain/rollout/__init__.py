"""Rollout engines behind one interface (``base.RolloutEngine``), built by :func:`make_engine` (``factory.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.batch import Rollout, concat_rollouts
from posttrain.rollout.factory import ENGINES, engine_for, make_engine
from posttrain.rollout.hf import HFEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def training_engine(cfg: object, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutEngine:
    """The engine of a training run: :func:`engine_for` in this process, or with ``cluster.backend =
    "ray"`` the rollout worker actors of ``rollout/ray_engine.py`` (the run calls its ``close``). An
    asynchronous run (``rollout.max_staleness > 0``) samples on its producer's engine (the workers, then:
    :func:`ray_workers`) and keeps this one in its own process.
    """
    if cfg.cluster.backend == "local" or cfg.rollout.max_staleness > 0:
        return engine_for(cfg, model, tokenizer)
    return ray_workers(cfg, model, tokenizer)


def ray_workers(cfg: object, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutEngine:
    """The rollout worker actors of ``cluster.backend = "ray"`` over ``model``'s weights (their own copies)."""
    from posttrain.rollout.ray_engine import RayEngine

    ranks = cfg.train.processes if cfg.train.processes > 1 else 0  # learner rank actors share the local Ray
    return RayEngine(model, tokenizer, workers=cfg.cluster.rollout_workers, address=cfg.cluster.address,
                     reserve_cpus=cfg.cluster.rollout_workers + ranks, engine=cfg.rollout.engine,
                     engine_params=cfg.rollout.engine_params, seed=cfg.seed, autocast=cfg.model.autocast)


__all__ = [
    "ENGINES", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "concat_rollouts", "engine_for", "make_engine",
    "ray_workers", "training_engine",
]
