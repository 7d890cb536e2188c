"""``task.name = "json_tools_problems"``: the ``json_tools`` environment's problems and expert transcripts as a task,
for an agent that runs its episodes itself (recipes/agent_openai_tools.toml).

The ``agent`` driver draws prompts from a task and leaves the episode to the agent, so it does not run with
``task.name = "env"`` (that goes with the ``multi_turn`` driver, which runs the environment). This plugin gives
it the environment's problems (``a*b+c*d``, their answers and operands, the same train/test split) under a task
name of its own. Being an :class:`~posttrain.envs.task.EnvTask`, it keeps what the rest of posttrain does with an
environment's problems: ``posttrain sft`` trains the expert's multi-turn transcripts (calls, tool results, the
answer; ``trainers/sft.py``) and evaluation plays episodes in the environment. ``task.params`` are
``json_tools``' own (``posttrain/envs/json_tools.py``).
"""

from __future__ import annotations

from posttrain.envs.task import EnvTask
from posttrain.plugins import register_task

MAX_TOKENS = 270  # an episode's token budget when evaluation plays it in the environment (agent_json_tools.toml's)


@register_task("json_tools_problems")
class JsonToolsProblems(EnvTask):
    """The ``json_tools`` environment built with ``params``; its problems, demonstrations and episodes."""

    def __init__(self, **params: object) -> None:
        task = EnvTask.build("json_tools", dict(params), 0, MAX_TOKENS, 30.0)
        super().__init__(task.env, task.max_turns, task.max_tokens, task.step_timeout_s)
