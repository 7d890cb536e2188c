"""Multi-turn environments and tools (``task.name = "env"``): the contract is ``envs/base.py``."""

from posttrain.envs.base import ENVS, Environment, Episode, Message, StepResult, make_env, register

__all__ = ["ENVS", "Environment", "Episode", "Message", "StepResult", "make_env", "register"]

# built-in environments (registered on import)
from posttrain.envs import calc_tool as calc_tool  # noqa: E402
from posttrain.envs import code_feedback as code_feedback  # noqa: E402
from posttrain.envs import grid as grid  # noqa: E402
from posttrain.envs import guess_number as guess_number  # noqa: E402
from posttrain.envs import gym_text as gym_text  # noqa: E402
from posttrain.envs import json_tools as json_tools  # noqa: E402
from posttrain.envs import openenv_env as openenv_env  # noqa: E402
from posttrain.envs import retry_arith as retry_arith  # noqa: E402
from posttrain.envs import textarena_env as textarena_env  # noqa: E402
