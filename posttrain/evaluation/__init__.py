"""Evaluation of a policy on held-out task prompts."""

from posttrain.evaluation.accuracy import evaluate

__all__ = ["evaluate"]
