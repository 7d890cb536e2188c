"""Rollout engines behind one interface (``base.RolloutEngine``), built by :func:`make_engine`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from posttrain.models.precision import autocast_dtype
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.batch import Rollout, concat_rollouts
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
