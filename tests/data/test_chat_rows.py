"""Chat rows of a data set (data/chat.py) and their rendering (models/chat.py): messages with a system
message and few-shot turns, tools, chat-template kwargs, the set-up check, and string prompts unchanged.
"""

from __future__ import annotations

import json

import pytest

from posttrain.data import DatasetSpec, load_task
from posttrain.data.readers import DataError
from posttrain.models.chat import ChatRenderError, check_chat_examples, encode_example, example_messages, with_user_text
from posttrain.models.load import encode_chat
from posttrain.models.tiny import CHAT_TEMPLATE, PRINTABLE, build_char_tokenizer
from posttrain.tasks import make_task
from posttrain.tasks.base import Example

SYSTEM = {"role": "system", "content": "Add."}
FEW_SHOT = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]

# The tiny template plus tools (their names, in a system block) and a thinking switch.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "{% endif %}{% if enable_thinking is defined and not enable_thinking %}<|system|>no_think{% endif %}"
    + CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
)
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a+b",
                                              "parameters": {"type": "object", "properties": {}}}}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def chat_rows(n):
    return [{"messages": [SYSTEM, *FEW_SHOT, {"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i),
             "level": i % 3} for i in range(n)]


@pytest.fixture
def tok():
    return build_char_tokenizer(PRINTABLE)


def test_string_prompts_encode_byte_identically(tmp_path, tok):
    # every existing task goes through encode_chat exactly as before: same ids, with or without a system prompt
    task = make_task("arithmetic", digits=2, ops="+")
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "tools_used": "no"} for i in range(20)]
    data = load_task(DatasetSpec(path=write_jsonl(tmp_path / "s.jsonl", rows), test_fraction=0.2))
    examples = task.examples("train", 8, seed=0) + data.pools["train"]
    assert all(ex.messages is None and ex.tools is None and ex.chat_template_kwargs is None for ex in examples)
    plain = build_char_tokenizer(PRINTABLE)
    plain.chat_template = None  # a base model: the raw-text fallback
    for t in (tok, plain):
        for system in (None, "Be brief."):
            assert [encode_example(t, ex, system) for ex in examples] == [
                encode_chat(t, ex.prompt, system) for ex in examples]
    # and the ids are the template's text, character by character (nothing else was added)
    ids = encode_example(tok, examples[0], "S")
    assert tok.decode(ids, skip_special_tokens=False) == f"<|bos|><|system|>S<|user|>{examples[0].prompt}<|assistant|>"


def test_messages_rows_load_and_render_every_turn(tmp_path, tok):
    task = load_task(DatasetSpec(path=write_jsonl(tmp_path / "c.jsonl", chat_rows(30)),
                                 fields={"prompt": "messages", "level": "level"},
                                 test_fraction=0.2))
    ex = task.pools["train"][0]
    i = int(ex.answer) // 2
    assert ex.prompt == f"{i}+{i}=" and ex.messages[:3] == [SYSTEM, *FEW_SHOT]
    assert ex.fields == {"level": i % 3}  # the row's other fields reach the rewards as before
    text = tok.decode(encode_example(tok, ex, "ignored: the row has a system message"), skip_special_tokens=False)
    assert text == f"<|bos|><|system|>Add.<|user|>1+2=<|assistant|>3<|eos|><|user|>{i}+{i}=<|assistant|>"
    # task.system_prompt goes in front of rows without a system message of their own
    bare = Example(ex.prompt, ex.answer, ex.demonstration, messages=[*FEW_SHOT, {"role": "user", "content": "5+5="}])
    assert example_messages(bare, "Sys")[0] == {"role": "system", "content": "Sys"}
    assert set("Add.") <= set(task.alphabet)  # a char tokenizer built for the task spells the system message
    assert check_chat_examples(tok, task.pools, None) == 8 + min(8, len(task.pools["test"]))


def test_hinted_question_keeps_the_turns(tok):
    ex = Example("4+4=", "8", "8", messages=[SYSTEM, *FEW_SHOT, {"role": "user", "content": "4+4="}])
    hinted = with_user_text(ex, "4+4= (hint: 8-0)")
    assert hinted.prompt == "4+4= (hint: 8-0)" and hinted.messages[:3] == [SYSTEM, *FEW_SHOT]
    assert hinted.messages[-1] == {"role": "user", "content": "4+4= (hint: 8-0)"}
    assert ex.messages[-1]["content"] == "4+4="  # the original example is unchanged


def test_tools_and_template_kwargs_reach_the_template(tmp_path, tok):
    tok.chat_template = TOOLS_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1),
             **({"tools": json.dumps([ADD_TOOL])} if i % 2 else {})} for i in range(10)]
    sub = {**ADD_TOOL, "function": {**ADD_TOOL["function"], "name": "sub"}}
    task = load_task(DatasetSpec(path=write_jsonl(tmp_path / "t.jsonl", rows), test_fraction=0.0, tools=[sub],
                                 chat_template_kwargs={"enable_thinking": False}))
    by_q = {ex.prompt: ex for ex in task.pools["train"]}
    own, default = by_q["1+1="], by_q["2+1="]
    assert [t["function"]["name"] for t in own.tools] == ["add"]  # the row's tools replace the default
    assert own.chat_template_kwargs == {"enable_thinking": False}  # the data set's kwargs apply to every row
    text = tok.decode(encode_example(tok, own), skip_special_tokens=False)
    assert text == "<|bos|><|system|>tools: add<|system|>no_think<|user|>1+1=<|assistant|>"
    assert "tools: sub" in tok.decode(encode_example(tok, default), skip_special_tokens=False)
    assert check_chat_examples(tok, task.pools) == 8


def test_a_template_that_drops_the_tools_is_an_error(tok):
    ex = Example("1+1=", "2", "2", messages=[{"role": "user", "content": "1+1="}], tools=[ADD_TOOL])
    with pytest.raises(ChatRenderError, match=r"train example 0 .*'1\+1='.*silently drops tools"):
        check_chat_examples(tok, {"train": [ex]})  # the tiny template has no tools block


def test_a_template_that_drops_few_shot_turns_is_an_error(tok):
    tok.chat_template = "{{ bos_token }}<|user|>{{ messages[-1]['content'] }}<|assistant|>"  # the last turn only
    ex = Example("7+7=", "14", "14", messages=[SYSTEM, *FEW_SHOT, {"role": "user", "content": "7+7="}])
    with pytest.raises(ChatRenderError, match="drops system turn 0, user turn 1, assistant turn 2"):
        check_chat_examples(tok, {"test": [ex]})


def test_a_template_that_raises_or_is_missing_is_an_error_at_set_up(tok):
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    ok = Example("1+1=", "2", "2", messages=[{"role": "user", "content": "1+1="}])
    bad = Example("2+2=", "4", "4", messages=[SYSTEM, {"role": "user", "content": "2+2="}])
    with pytest.raises(ChatRenderError, match=r"train example 1 .*'2\+2='.*System role not supported"):
        check_chat_examples(tok, {"train": [ok, bad]})
    tok.chat_template = None
    with pytest.raises(ChatRenderError, match="no chat template"):
        encode_example(tok, ok)
    # string prompts keep the raw-text fallback: nothing to check
    assert check_chat_examples(tok, {"train": [Example("1+1=", "2", "2")]}) == 0


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"messages": [], "answer": "1"}, "non-empty list of messages"),
        ({"messages": [{"content": "hi"}], "answer": "1"}, "message 0 must be an object with a string 'role'"),
        ({"messages": [{"role": "system", "content": "s"}], "answer": "1"}, "need a final user turn"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"},
         "end with an assistant turn"),
        ({"messages": [{"role": "user", "content": "q"}], "answer": "1", "tools": "not json"}, "not JSON"),
        ({"messages": [{"role": "user", "content": "q"}], "answer": "1", "chat_template_kwargs": {"tokenize": True}},
         "may not set"),
    ],
)
def test_malformed_chat_rows_name_the_row(tmp_path, row, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError, match=match) as err:
        load_task(DatasetSpec(path=path, fields={"prompt": "messages"}))
    assert "bad.jsonl record 0" in str(err.value)


def test_dataset_level_kwargs_refuse_posttrains_own_arguments():
    with pytest.raises(ValueError, match="may not set"):
        DatasetSpec(path="x.jsonl", chat_template_kwargs={"add_generation_prompt": False})
