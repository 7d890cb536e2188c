"""A ``verifiers`` (v1 API) environment as an outside agent of the ``agent`` rollout driver.

A plugin file binds the agent to its taskset, ``run = verifiers_agent.agent(__name__)`` (or to an installed taskset
package: ``agent("my-taskset")``), and ``rollout.driver_params.agent = "my_env.py:run"`` names it. Each episode
builds the verifiers environment of that taskset (``vf.load_environment``: the taskset's own ``Env``, else
``SingleAgentEnv``; the taskset's own ``Harness`` when it exports one), points its model client at the episode's
base URL (``vf.EvalClientConfig(base_url=...)``: every model call of the harness goes through verifiers'
interception server to posttrain's episode server, which records the sampled tokens), runs one rollout
(``Env.run_slot``) and returns the trace's reward (the sum of its task's weighted ``@vf.reward`` methods,
verifiers' rubric).

**Which task.** The rows come from posttrain's task (``task.name``), so the sampler's prompts, the eval and the
data cursor stay posttrain's. The episode plays the taskset's task whose ``prompt`` equals the example's prompt
when there is one; otherwise the taskset's first task with the example's ``prompt``, ``answer`` and same-named
``fields`` written over its data (``Task.with_data``): the taskset gives the task type and its rewards.

**Failures.** An episode verifiers marks failed (its harness raised, a reward raised, a model call failed or
timed out) raises here with verifiers' errors: the driver scores it None, logs the message and the transcript,
and the run goes on (``driver_params.timeout_s`` bounds the whole episode). The agent seat runs in verifiers'
``subprocess`` runtime on this machine unless ``runtime`` says otherwise (the default Prime runtime would need a
tunnel and a login).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from posttrain.plugins import is_file_entry
from posttrain.produce.drivers.agent import _plugin_module

if TYPE_CHECKING:
    from posttrain.tasks.base import Example

# verifiers reads the endpoint's API key from an environment variable; posttrain's episode server needs none.
KEY_VAR = "POSTTRAIN_VERIFIERS_API_KEY"
_IMPORTING = threading.Lock()  # the episodes of a batch run in threads: a taskset file is imported once


def agent(taskset: str, *, runtime: str = "subprocess", model: str = "policy",
          **taskset_args: object) -> Callable[[str, Example], float]:
    """The ``run(base_url, example)`` of the agent driver for a verifiers taskset (module docstring).

    ``taskset``: a verifiers taskset id (an importable module exporting its ``Taskset`` subclass via ``__all__``:
    a plugin file passes its own ``__name__``) or a ``.py`` file (imported as a posttrain plugin);
    ``taskset_args``: further keys of its ``TasksetConfig``; ``runtime``: the agent seat's verifiers runtime type.
    """

    def run(base_url: str, example: Example) -> float:
        """One verifiers rollout of ``example`` against ``base_url``; its trace's reward."""
        return asyncio.run(_episode(base_url, example, taskset, runtime, model, dict(taskset_args)))

    return run


def taskset_id(spec: str) -> str:
    """The verifiers taskset id of ``spec``: a ``.py`` file is imported as a posttrain plugin (once) and named
    by its module, which verifiers' loader then imports by name; any other spec is already an id.
    """
    if not is_file_entry(spec):
        return spec
    with _IMPORTING:
        return _plugin_module(spec)


async def _episode(base_url: str, example: Example, taskset: str, runtime: str, model: str,
                   taskset_args: dict) -> float:
    """Build the environment, run the episode in its serving context, read back the reward."""
    try:
        import verifiers.v1 as vf
        from verifiers.v1.env import RunSlot
    except ImportError as e:
        raise ImportError("the verifiers adapter needs the verifiers package: "
                          "pip install 'posttrain[verifiers]'") from e
    config = vf.resolve_env_config({"taskset": {**taskset_args, "id": taskset_id(taskset)},
                                    "agent": {"runtime": {"type": runtime}}})
    env = vf.load_environment(config)
    task = pick_task(list(env.taskset), example)
    os.environ.setdefault(KEY_VAR, "unused")
    ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR))
    async with env.serving():
        episode = await env.run_slot(RunSlot(task), ctx)
    if not episode.ok or not episode.traces:
        errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "no trace"
        trace_errors = "; ".join(f"{e.type}: {e.message}" for t in episode.traces for e in t.errors)
        raise RuntimeError(f"verifiers episode failed: {errors}{'; ' + trace_errors if trace_errors else ''}")
    return float(sum(t.reward for t in episode.traces))


def pick_task(tasks: list, example: Example) -> object:
    """The task whose prompt is the example's, else the first with the example's prompt, answer and same-named
    fields written over its data; raises ``ValueError`` for an empty taskset.
    """
    if not tasks:
        raise ValueError("rollout.driver_params.agent_params.taskset: the verifiers taskset yields no task")
    for task in tasks:
        if task.data.prompt == example.prompt:
            return task
    template = tasks[0]
    names = set(type(template.data).model_fields)
    update = {k: v for k, v in {**dict(example.fields), "prompt": example.prompt, "answer": example.answer}.items()
              if k in names}
    return template.with_data(**update)
