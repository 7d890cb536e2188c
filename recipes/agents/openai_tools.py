"""An agent that runs outside posttrain and calls tools, written with the ``openai`` package
(recipes/agent_openai_tools.toml).

posttrain calls ``run(base_url, example)`` once per sample (``rollout.driver = "agent"``); ``base_url`` is the
episode's own OpenAI-compatible address on a server over the policy being trained. The agent offers two tools,
``mul`` and ``add``, as JSON schemas (``tools=``), reads the calls the server parsed from the completion
(``message.tool_calls``), runs them itself, sends one ``tool`` message per call back, and asks again, until a
reply without calls (the final answer) or :data:`MAX_CALLS` chat calls. Its reward: 1.0 when the last integer of
the final answer is the example's ``answer``, else 0.0 (also when the history fills the model's context first).
It knows nothing of posttrain beyond the example's ``prompt`` and ``answer``.

The conversation is the one the ``json_tools`` environment shows (``announce = "brief"``), so a policy warmed up
on that environment's demonstrations can act: a system line of the tools' signatures built from the schemas
(``tools: add(a,b) mul(a,b)``), the problem as the user turn, each result as the environment writes it (the
integer as JSON, ``error: ...`` for a call that does not fit the schema).

**The assistant turn sent back.** A chat template that renders ``tool_calls`` (Qwen's, Llama 3.1's) writes the
calls into the prompt itself; the tiny model's template renders only ``content``. So with :data:`ECHO_CALLS` the
agent also writes the calls into ``content`` as the model writes them (Llama 3 JSON, ``; `` between calls, the
server's ``tool_parser = "llama3_json"``): the history then renders to the tokens that were sampled, and every
call extends the episode's one segment. With a template that renders ``tool_calls``, set it to False.

``run_without_tools`` is the same agent offering no tools (no ``tools=``, so nothing is parsed as a call): the
first reply is the answer, the comparison that shows what the tools are worth.
"""

from __future__ import annotations

import json
import re

from openai import BadRequestError, OpenAI

MAX_CALLS = 4  # chat calls an episode (json_tools' max_turns: two tool turns, the answer and a spare)
MAX_TOKENS = 112  # a turn of two calls is about 100 characters
ECHO_CALLS = True  # the template renders only content (module docstring)


def _schema(name: str, doc: str) -> dict:
    props = {k: {"type": "integer", "description": f"the {w} {'factor' if name == 'mul' else 'addend'}"}
             for k, w in (("a", "first"), ("b", "second"))}
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": props, "required": ["a", "b"], "additionalProperties": False}}}


TOOLS = [_schema("add", "Add two integers."), _schema("mul", "Multiply two integers.")]
FUNCTIONS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
KINDS = {str: "string", float: "number", bool: "boolean", list: "array", dict: "object", type(None): "null"}


def system_line(tools: list[dict]) -> str:
    """The tools' signatures in one line, as json_tools' ``announce = "brief"``: ``tools: add(a,b) mul(a,b)``."""
    sigs = [f"{t['function']['name']}({','.join(t['function']['parameters']['properties'])})" for t in tools]
    return f"tools: {' '.join(sigs)}"


def execute(name: str, arguments: str) -> str:
    """One call's result text: the integer as JSON, or ``error: ...`` (unknown tool, arguments off the schema)."""
    if name not in FUNCTIONS:
        return f"error: unknown tool {name[:40]!r}; tools: {', '.join(FUNCTIONS)}"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return "error: the call's arguments string is not valid JSON"
    if not isinstance(args, dict):
        return f"error: {name}: arguments must be an object"
    missing = [k for k in ("a", "b") if k not in args]
    if missing:
        return f"error: {name}: missing required argument(s) {', '.join(missing)}"
    extra = sorted(set(args) - {"a", "b"})
    if extra:
        return f"error: {name}: unexpected argument(s) {', '.join(extra)}"
    for k in ("a", "b"):
        v = args[k]
        if isinstance(v, bool) or not isinstance(v, int):
            return f"error: {name}: argument '{k}' must be integer, got {KINDS.get(type(v), 'value')} {json.dumps(v)}"
        if abs(v) >= 10**12:
            return f"error: {name} raised ValueError: operands must have at most 12 digits"
    return json.dumps(FUNCTIONS[name](args["a"], args["b"]))


def calls_text(calls: list) -> str:
    """The calls as a Llama 3 model writes them: ``{"name": ..., "parameters": {...}}; {...}``."""
    return "; ".join(json.dumps({"name": c.function.name, "parameters": json.loads(c.function.arguments)})
                     for c in calls)


def score(answer: str, target: str) -> float:
    """1.0 when the last integer of ``answer`` is ``target``, else 0.0."""
    numbers = re.findall(r"-?\d+", answer)
    return float(bool(numbers) and len(numbers[-1]) <= 40 and int(numbers[-1]) == int(target))


def episode(base_url: str, example: object, offer_tools: bool = True) -> float:
    """Ask, run the calls the reply makes, send their results, ask again; score the first reply without calls."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    messages: list[dict] = [{"role": "system", "content": system_line(TOOLS)},
                            {"role": "user", "content": example.prompt}]
    extra = {"tools": TOOLS} if offer_tools else {}
    for _ in range(MAX_CALLS):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS, **extra)
        except BadRequestError as e:  # the history has filled the model's context: no answer, as a cut episode
            if e.code == "context_length_exceeded":
                return 0.0
            raise
        message = reply.choices[0].message
        if not message.tool_calls:
            return score(message.content or "", example.answer)
        calls = [c for c in message.tool_calls if c.type == "function"]
        content = calls_text(calls) if ECHO_CALLS else message.content
        messages.append({"role": "assistant", "content": content,
                         "tool_calls": [c.model_dump(exclude_none=True) for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "name": c.function.name,
                      "content": execute(c.function.name, c.function.arguments)} for c in calls]
    return 0.0  # the call budget ran out before an answer


def run(base_url: str, example: object) -> float:
    """The tool-calling episode (module docstring)."""
    return episode(base_url, example, offer_tools=True)


def run_without_tools(base_url: str, example: object) -> float:
    """The same conversation with no tools offered: the first reply is the answer."""
    return episode(base_url, example, offer_tools=False)
