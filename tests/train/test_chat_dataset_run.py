"""Training, SFT and evaluation on a chat ``messages`` data set (a system message, few-shot turns, the
final user turn) with the tiny model; a template that cannot render the rows fails at set-up.
"""

from __future__ import annotations

import json

import pytest

from posttrain.config import load_config
from posttrain.models.chat import ChatRenderError, encode_example
from posttrain.train.rl import train
from posttrain.trainers.sft import sft

FEW_SHOT = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]


def write_chat(path, n):
    # even rows bring their own system message (it wins); odd rows take task.system_prompt
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, i // 10
            own = [{"role": "system", "content": "Add."}] if i % 2 == 0 else []
            messages = [*own, *FEW_SHOT, {"role": "user", "content": f"{a}+{b}="}]
            f.write(json.dumps({"messages": messages, "answer": str(a + b)}) + "\n")


@pytest.fixture
def chat_cfg(tmp_path):
    def make(*overrides):
        data = tmp_path / "chat.jsonl"
        write_chat(data, 40)
        return load_config(None, [
            f'out="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false",
            'task.name="dataset"', 'task.system_prompt="Sum."',
            f'task.dataset={{path="{data}", fields={{prompt="messages"}}, test_fraction=0.2}}',
            "model.tiny={hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_positions=64}",
            "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=6",
            'reward=[{name="math"}]', "checkpoint.every=0", "log.samples=8", "log.samples_every=1", *overrides,
        ])

    return make


def test_train_two_steps_on_chat_rows_and_log_their_turns(chat_cfg, quiet, tmp_path):
    summary = train(chat_cfg("train.steps=2", "eval.prompts=4"), console=quiet)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
    assert 0.0 <= summary["final"]["pass@1"] <= 1.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2}
    systems = set()
    for s in samples:
        turns = s["messages"]
        assert turns[1:3] == FEW_SHOT and turns[-1] == {"role": "user", "content": s["prompt"]}
        systems.add(turns[0]["content"])
        a, b = s["prompt"].rstrip("=").split("+")
        assert turns[0]["content"] == ("Add." if (int(a) + 10 * int(b)) % 2 == 0 else "Sum.")
    assert systems <= {"Add.", "Sum."} and systems


def test_sft_trains_on_the_rendered_chat(chat_cfg, quiet):
    from transformers import AutoTokenizer

    from posttrain.run.setup import build_task
    from posttrain.trainers.sft import demonstration_rows

    cfg = chat_cfg("sft.steps=2", "sft.demos=8", "sft.eval_prompts=4")
    assert sft(cfg, console=quiet)["steps"] == 2
    tok = AutoTokenizer.from_pretrained(str(cfg.out) + "/base_model")
    task = build_task(cfg)
    pool = task.pools["train"][:3]
    prompts, _, _ = demonstration_rows(cfg, task, tok, pool)
    assert prompts == [encode_example(tok, ex, "Sum.") for ex in pool]
    assert "<|user|>1+2=<|assistant|>3<|eos|>" in tok.decode(prompts[0], skip_special_tokens=False)


def test_a_template_that_drops_the_tools_fails_at_set_up(chat_cfg, quiet, tmp_path):
    tool = '{type="function", function={name="add", parameters={type="object"}}}'
    with pytest.raises(ChatRenderError, match="silently drops tools"):
        train(chat_cfg("train.steps=2", f"task.dataset.tools=[{tool}]"), console=quiet)  # tiny template: no tools
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran
