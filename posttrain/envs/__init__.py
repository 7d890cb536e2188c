"""Multi-turn environments and tools (``task.name = "env"``): the contract is ``envs/base.py``."""

from posttrain.envs.base import ENVS, Environment, Episode, Message, StepResult, make_env, register

__all__ = ["ENVS", "Environment", "Episode", "Message", "StepResult", "make_env", "register"]
