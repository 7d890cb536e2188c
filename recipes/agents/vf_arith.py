"""A small ``verifiers`` (v1) environment built in code (recipes/agent_verifiers.toml): no hub download.

The taskset holds a few sums as tasks (the rows posttrain's task supplies replace them: the adapter writes the
example's ``prompt`` and ``answer`` over the first task's data), its task's one ``@vf.reward`` is the share of the
answer's characters the model's last reply gets right in place, and the harness is an in-process chat loop that
asks the question, then asks again with "=" and the draft in the history (two model calls an episode, both
through verifiers' interception server to posttrain's episode server).
"""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI

from posttrain.produce.drivers import verifiers_agent


class ArithData(vf.TaskData):
    """A question and the expected answer."""

    answer: str = ""


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    """One sum, scored on the last reply."""

    @vf.reward(weight=1.0)
    async def chars_right(self, trace: vf.Trace) -> float:
        """The share of the answer's characters right in place (1.0 for the exact answer)."""
        reply, target = trace.last_reply.strip(), self.data.answer
        return sum(a == b for a, b in zip(reply, target, strict=False)) / max(len(reply), len(target), 1)


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    """Three sums built in code."""

    def load(self) -> list[ArithTask]:
        """The tasks (posttrain's examples take the first one's place)."""
        return [ArithTask(ArithData(prompt=f"{a}+{a}", answer=str(2 * a)), self.config.task) for a in (1, 2, 3)]


class TwoCallHarness(vf.Harness[vf.HarnessConfig]):
    """Two chat calls in process: the question, then "=" with the draft answer in the history."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None,
                     ) -> vf.ProgramResult:
        """Every model call goes to ``endpoint`` with ``secret`` (verifiers' interception, which records it)."""
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": data.prompt}]
        draft = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": draft.choices[0].message.content or ""},
                     {"role": "user", "content": "="}]
        final = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6)
        return vf.ProgramResult(0, final.choices[0].message.content or "", "")


__all__ = ["ArithTaskset", "TwoCallHarness"]

# The agent driver's callable: rollout.driver_params.agent = "agents/vf_arith.py:run" (this module is the taskset).
run = verifiers_agent.agent(__name__)
