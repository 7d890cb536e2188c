"""json_tools: several JSON tool calls a turn, hostile calls, every call format, the template's choices
(posttrain/envs/json_tools.py).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from posttrain.envs import make_env
from posttrain.envs.json_tools import COUNTERS, TOOLS, register_tool
from posttrain.envs.tool_parsers import format_calls
from posttrain.envs.tool_schema import tool
from posttrain.models.tiny import PRINTABLE, build_char_tokenizer
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.tasks.base import Example

CHAIN = Example("(12+34)*56", "2576", "", {"operands": [12, 34, 56]})  # 12+34 = 46, 46*56 = 2576
PARALLEL = Example("12*34+56*78", "4776", "", {"operands": [12, 34, 56, 78]})  # 408 + 4368 = 4776
RELEASE = threading.Event()  # lets the hanging tool's abandoned thread go at the end


def _hermes(*calls):
    return format_calls("hermes", [(n, a) for n, a in calls])


def _counts(**nonzero):
    return {k: float(nonzero.get(k, 0)) for k in COUNTERS}


if "test_boom" not in TOOLS:
    @register_tool
    @tool
    def test_boom(x: int) -> int:
        """A tool with a bug."""
        raise KeyError(f"bug {x}")

    @register_tool
    @tool
    def test_hang(x: int) -> int:
        """A tool that never answers."""
        RELEASE.wait(60)
        return x


def test_several_calls_in_one_turn_run_in_order():
    env = make_env("json_tools", {"form": "parallel"})
    ep = env.start(PARALLEL)
    first = ep.reset()
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == "12*34+56*78"
    assert '"name": "mul"' in first[0]["content"] and "<tool_call>" in first[0]["content"]
    res = ep.step("I multiply both.\n" + _hermes(("mul", {"a": 12, "b": 34}), ("mul", {"a": 56, "b": 78})))
    assert [(m["role"], m["name"], m["content"]) for m in res.messages] == [("tool", "mul", "408"),
                                                                         ("tool", "mul", "4368")]
    assert (res.reward, res.done, dict(res.info)) == (0.0, False, {"success": 0.0, **_counts(tool_calls=2)})
    res = ep.step(_hermes(("add", {"a": 408, "b": 4368})))
    assert res.messages[0]["content"] == "4776"
    first_turn = "I multiply both.\n" + _hermes(("mul", {"a": 12, "b": 34}), ("mul", {"a": 56, "b": 78}))
    second_turn = _hermes(("add", {"a": 408, "b": 4368}))
    assert ep.state_key() == f"12*34+56*78|{first_turn}>408|4368|{second_turn}>4776"
    res = ep.step("The answer is 4776.")
    assert (res.messages, res.reward, res.done, dict(res.info)) == ((), 1.0, True, {"success": 1.0})


@pytest.mark.parametrize(("action", "reply", "kind"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}</tool_call>', "error: the call is not valid JSON",
     "tool_invalid_json"),
    ("<tool_call>add(12, 34)</tool_call>", "error: the call is not valid JSON", "tool_invalid_json"),
    ('<tool_call>{"tool": "add"}</tool_call>', 'error: a call must be a JSON object with a string "name"',
     "tool_invalid_json"),
    (_hermes(("sub", {"a": 1, "b": 2})), "error: unknown tool 'sub'; tools: add, mul, test_boom, test_hang",
     "tool_unknown"),
    (_hermes(("add", {"a": "12", "b": 34})), "error: add: argument 'a' must be integer, got string \"12\"",
     "tool_bad_args"),
    (_hermes(("add", {"a": 12})), "error: add: missing required argument(s) b", "tool_bad_args"),
    (_hermes(("add", {"a": 12, "b": 34, "c": 1})), "error: add: unknown argument(s) c; expected a, b",
     "tool_bad_args"),
    ('<tool_call>{"name": "add", "arguments": [12, 34]}</tool_call>',
     "error: add: arguments must be a JSON object, got array", "tool_bad_args"),
    (_hermes(("mul", {"a": 10**13, "b": 2})), "error: mul raised ValueError: operands must have at most 12 digits",
     "tool_raised"),
    (_hermes(("test_boom", {"x": 1})), "error: test_boom raised KeyError: 'bug 1'", "tool_raised"),
])
def test_a_malformed_call_is_an_error_result_counted_and_the_episode_goes_on(action, reply, kind):
    env = make_env("json_tools", {"tools": ["add", "mul", "test_boom", "test_hang"], "tool_error_penalty": 0.1})
    ep = env.start(CHAIN)
    ep.reset()
    res = ep.step(action)
    assert [m["content"] for m in res.messages] == [reply]
    assert (res.reward, res.done) == (pytest.approx(-0.1), False)
    assert dict(res.info) == {"success": 0.0, **_counts(tool_calls=1, tool_errors=1, **{kind: 1})}
    assert ep.step(_hermes(("add", {"a": 12, "b": 34}))).messages[0]["content"] == "46"  # it goes on


def test_fifty_calls_in_one_turn_run_the_first_max_calls_and_refuse_the_rest():
    env = make_env("json_tools", {"max_calls": 4})
    ep = env.start(CHAIN)
    ep.reset()
    t0 = time.monotonic()
    res = ep.step(_hermes(*[("add", {"a": i, "b": 1}) for i in range(50)]))
    assert time.monotonic() - t0 < 1.0
    assert [m["content"] for m in res.messages] == ["1", "2", "3", "4",
                                                    "error: 46 call(s) past the limit of 4 a turn were not run"]
    assert dict(res.info) == {"success": 0.0, **_counts(tool_calls=4, tool_errors=1, tool_too_many=1)}


def test_a_hanging_tool_times_out_and_the_other_calls_of_the_turn_still_run():
    env = make_env("json_tools", {"tools": ["add", "mul", "test_hang"], "tool_timeout_s": 0.2})
    ep = env.start(CHAIN)
    ep.reset()
    t0 = time.monotonic()
    res = ep.step(_hermes(("test_hang", {"x": 1}), ("add", {"a": 12, "b": 34})))
    assert time.monotonic() - t0 < 2.0  # under the driver's step_timeout_s (10 s): the episode is not lost
    assert [m["content"] for m in res.messages] == ["error: test_hang timed out after 0.2s", "46"]
    assert dict(res.info) == {"success": 0.0, **_counts(tool_calls=2, tool_errors=1, tool_timeouts=1)}


@pytest.mark.parametrize(("answer", "reward", "info"), [
    ("2576", 1.0, {"success": 1.0}),
    ("The result is 2,576? No: 2576.", 1.0, {"success": 1.0}),  # the last integer
    ("02576", 1.0, {"success": 1.0}),
    ("2577", 0.0, {"success": 0.0}),
    ("-2576", 0.0, {"success": 0.0}),
    ("I do not know", 0.0, {"success": 0.0, "format_errors": 1.0}),
    ("9" * 5000, 0.0, {"success": 0.0, "format_errors": 1.0}),
    ("", 0.0, {"success": 0.0, "format_errors": 1.0}),
])
def test_a_turn_without_a_call_is_the_answer(answer, reward, info):
    ep = make_env("json_tools", {}).start(CHAIN)
    ep.reset()
    res = ep.step(answer)
    assert (res.messages, res.reward, res.done, dict(res.info)) == ((), reward, True, info)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "any"])
@pytest.mark.parametrize("form", ["chain", "parallel"])
def test_the_expert_solves_in_every_call_format(parser, form):
    env = make_env("json_tools", {"parser": parser, "form": form, "noise": 1.0})
    for ex in env.examples("train", 3, 0):
        transcript = env.demonstration(ex, 0)
        ep = env.start(ex)
        assert transcript[:2] == ep.reset()
        actions = [m["content"] for m in transcript if m["role"] == "assistant"]
        assert len(actions) == 4  # the bad call (a string operand), two tool turns, the answer
        results = [ep.step(a) for a in actions]
        assert results[0].info["tool_bad_args"] == 1.0
        assert [r.done for r in results] == [False, False, False, True] and results[-1].reward == 1.0
        assert actions[-1] == ex.answer
        # chain: bad add, add, mul; parallel: (bad mul, mul), (mul, mul), add
        assert sum(r.info.get("tool_calls", 0) for r in results) == (3 if form == "chain" else 5)


def test_the_compact_form_with_the_calculator():
    env = make_env("json_tools", {"parser": "compact", "tools": ["calculator"], "announce": "brief"})
    assert env.start(CHAIN).reset()[0] == {"role": "system", "content": "tools: calculator(expression)"}
    assert [m["content"] for m in env.demonstration(CHAIN, 0)][2:] == ["=12+34", "46", "=46*56", "2576", "2576"]
    ep = env.start(CHAIN)
    ep.reset()
    assert ep.step("=12/0").messages[0]["content"] == "error: division by zero"


@pytest.mark.parametrize(("params", "message"), [
    ({"parser": "openai"}, "parser = 'openai'; expected any, compact, hermes, llama3_json, mistral"),
    ({"tools": ["add"]}, "add and mul, or calculator"),
    ({"tools": ["add", "mul", "nope"]}, "tools = \\['add', 'mul', 'nope'\\]; expected names among"),
    ({"parser": "compact"}, "compact writes one calculator call a turn"),
    ({"form": "tree"}, "form = 'tree'; expected chain or parallel"),
    ({"results": "xml"}, "results = 'xml'"),
    ({"max_calls": 0}, "max_calls >= 1"),
])
def test_bad_parameters_name_the_key_and_the_choices(params, message):
    with pytest.raises(ValueError, match=message):
        make_env("json_tools", params)


QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
             "{% elif m.role == 'assistant' %}A:{{ m.content }}{{ eos_token }}{% else %}U:{{ m.content }}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}A:{% endif %}{# <tool_call> #}")
NO_TOOL_ROLE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                "{% if m.role == 'assistant' %}A:{{ m.content }}{{ eos_token }}{% else %}U:{{ m.content }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}A:{% endif %}{# [TOOL_CALLS] #}")


def _tokenizer(template):
    tok = build_char_tokenizer(PRINTABLE + "\n")
    tok.chat_template = template
    return tok


def test_bind_tokenizer_picks_the_format_and_the_result_role_from_the_template():
    env = make_env("json_tools", {"parser": "any", "form": "parallel"})
    env.bind_tokenizer(_tokenizer(QWEN_LIKE))
    assert (env.parser, env.result_role) == ("hermes", "tool")
    env = make_env("json_tools", {"parser": "any", "form": "parallel"})
    env.bind_tokenizer(_tokenizer(NO_TOOL_ROLE))
    assert (env.parser, env.result_role) == ("mistral", "text")
    transcript = env.demonstration(PARALLEL, 0)
    assert transcript[3] == {"role": "user", "content": '<tool_response>{"name": "mul", "content": "408"}'
                             '</tool_response>\n<tool_response>{"name": "mul", "content": "4368"}</tool_response>'}
    assert transcript[-1] == {"role": "assistant", "content": "4776"}
    # the SFT layout of the transcript: assistant turns trained, the text results context
    tok = _tokenizer(NO_TOOL_ROLE)
    prompt, ids, mask = ChatDelta(tok, roles=("user",)).transcript_ids(transcript)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m > 0], skip_special_tokens=True)
    assert trained == "".join(m["content"] for m in transcript if m["role"] == "assistant")
    assert "<tool_response>" in tok.decode([i for i, m in zip(ids, mask, strict=True) if m == 0])


def test_tool_results_through_a_templates_tool_role_in_an_sft_transcript():
    env = make_env("json_tools", {"form": "parallel"})
    tok = _tokenizer(QWEN_LIKE)
    transcript = env.demonstration(PARALLEL, 0)
    prompt, ids, mask = ChatDelta(tok).transcript_ids(transcript)
    context = tok.decode([i for i, m in zip(ids, mask, strict=True) if m == 0])
    assert "<tool_response>408</tool_response><tool_response>4368</tool_response>A:" in context


def test_schemas_announced_are_the_tools_schemas():
    env = make_env("json_tools", {"parser": "llama3_json"})
    system = env.start(CHAIN).reset()[0]["content"]
    listed = [json.loads(line) for line in system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
    assert listed == [TOOLS["add"].schema(), TOOLS["mul"].schema()] == env.tool_schemas()
    assert '"parameters": <object>' in system


def teardown_module():
    RELEASE.set()


def test_with_the_tools_taken_away_every_call_is_an_error_and_the_answer_is_still_scored():
    env = make_env("json_tools", {"form": "parallel", "available": False})
    ep = env.start(PARALLEL)
    first = ep.reset()
    assert first == make_env("json_tools", {"form": "parallel"}).start(PARALLEL).reset()  # the same first messages
    res = ep.step(_hermes(("mul", {"a": 12, "b": 34}), ("mul", {"a": 56, "b": 78})))
    assert [m["content"] for m in res.messages] == ["error: no tools", "error: no tools"]  # 408 and 4368 not given
    assert res.info["tool_calls"] == 2.0 and res.info["tool_errors"] == 2.0 and not res.done
    assert set(res.info) == {"success", *COUNTERS}
    assert ep.step("4776").reward == 1.0  # a policy that computes 408 + 4368 itself still scores
