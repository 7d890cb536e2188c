"""An agent that runs outside posttrain, written with the ``openai`` package (recipes/agent_openai.toml).

posttrain calls ``run(base_url, example)`` once per sample (``rollout.driver = "agent"``); ``base_url`` is the
episode's own OpenAI-compatible address on a server over the policy being trained. The agent asks the question,
reads the draft answer, asks again with the draft in the history (a second chat call whose prompt extends the
first: one segment, both answers trained), and returns its own reward: the share of the expected answer's
characters the final answer gets right in place (1.0 for the exact answer). It knows nothing of posttrain
beyond the example's ``prompt`` and ``answer``.
"""

from __future__ import annotations

from openai import OpenAI


def run(base_url: str, example: object) -> float:
    """Two chat calls: the question, then "=" (check it) with the draft answer in the history."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": example.prompt}]
    draft = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": draft.choices[0].message.content or ""},
                 {"role": "user", "content": "="}]
    final = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    answer, target = (final.choices[0].message.content or "").strip(), example.answer
    return sum(a == b for a, b in zip(answer, target, strict=False)) / max(len(answer), len(target), 1)
