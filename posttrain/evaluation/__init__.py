"""Evaluation of a policy on held-out task prompts, and the sampling and calibration metrics."""

from posttrain.evaluation.accuracy import evaluate
from posttrain.evaluation.metrics import (
    ReliabilityBin,
    auroc,
    brier,
    ece,
    maj_at_k,
    mean_at_k,
    mean_pass_at_k,
    pass_at_k,
    reliability_bins,
)
from posttrain.evaluation.sampled import EvalResult, evaluate_samples

__all__ = [
    "EvalResult",
    "evaluate_samples",
    "ReliabilityBin",
    "auroc",
    "brier",
    "ece",
    "evaluate",
    "maj_at_k",
    "mean_at_k",
    "mean_pass_at_k",
    "pass_at_k",
    "reliability_bins",
]
