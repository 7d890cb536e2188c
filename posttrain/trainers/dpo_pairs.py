"""Preference pairs for ``posttrain dpo``: read from a file, or built from a task by sampling.

A :class:`TokenPair` holds token ids: the encoded prompt (chat template, system prompt) and the
chosen and rejected completions, each ending with EOS when it finished (text from a file always
gets EOS appended; a sampled completion truncated at ``max_new_tokens`` has none).

Task pairs (:func:`task_pairs`), for a machine with no preference data: sample G completions of
the current policy per train prompt and verify them with the task. A prompt with at least one
incorrect sample gives one pair: rejected = its first incorrect sample, chosen = its first
correct sample, or the task's demonstration when no sample is correct (so a weak policy still
gets pairs; the log counts these as ``dpo/demo_chosen``). Prompts whose samples are all correct
give no pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from posttrain.data.fields import as_text, map_record
from posttrain.data.readers import read_records
from posttrain.models.chat import encode_example
from posttrain.models.load import encode_chat
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.tasks.base import Example, Task

PAIR_TARGETS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class TokenPair:
    """One preference pair as token ids (see the module docstring)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def read_pairs(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    fields: dict[str, str] | None = None,
    format: str | None = None,  # noqa: A002 - the natural name in configs
    system_prompt: str | None = None,
) -> list[TokenPair]:
    """Read ``prompt`` / ``chosen`` / ``rejected`` text columns (renamed by ``fields``) into pairs.

    Any format :func:`~posttrain.data.readers.read_records` reads; a missing column is a
    ``DataError`` naming it. Rollout are tokenized without special tokens, plus EOS.
    """
    columns = {t: (fields or {}).get(t, t) for t in PAIR_TARGETS}
    eos = [int(tokenizer.eos_token_id)]
    pairs = []
    for i, record in enumerate(read_records(path, format=format)):
        where = f"{path} row {i + 1}"
        row = {t: as_text(v, t, where) for t, v in map_record(record, columns, {}, where).items()}
        prompt = encode_chat(tokenizer, row["prompt"], system_prompt)
        chosen, rejected = (
            list(tokenizer(row[t], add_special_tokens=False)["input_ids"]) + eos for t in ("chosen", "rejected")
        )
        pairs.append(TokenPair(prompt, chosen, rejected))
    return pairs


def task_pairs(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    system_prompt: str | None = None,
    seed: int | None = None,
) -> tuple[list[TokenPair], dict[str, float]]:
    """Pairs from ``group_size`` samples of the policy per example (rule in the module docstring).

    Returns the pairs and statistics: ``dpo/pair_prompts`` (fraction of examples that gave a
    pair), ``dpo/demo_chosen`` (fraction of pairs whose chosen is the demonstration) and
    ``dpo/sample_accuracy`` (fraction of samples verified).
    """
    prompts = [encode_example(tokenizer, ex, system_prompt) for ex in examples]
    rollouts = engine.generate(
        prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=group_size),
        seed=seed,
    )
    eos = [int(tokenizer.eos_token_id)]
    pairs, demo, correct = [], 0, 0
    for i, ex in enumerate(examples):
        rows = range(i * group_size, (i + 1) * group_size)
        ok = {r: task.verify(rollouts.texts[r], ex) >= 1.0 for r in rows}
        correct += sum(ok.values())
        bad = [r for r in rows if not ok[r]]
        if not bad:
            continue
        good = [r for r in rows if ok[r]]
        ids = [rollouts.token_ids[r][rollouts.loss_mask[r] > 0].tolist() for r in (good[:1] + bad[:1])]
        if not good:
            demo += 1
            ids = [list(tokenizer(ex.demonstration, add_special_tokens=False)["input_ids"]) + eos, *ids]
        pairs.append(TokenPair(prompts[i], ids[0], ids[1]))
    stats = {
        "dpo/pair_prompts": len(pairs) / max(len(examples), 1),
        "dpo/demo_chosen": demo / max(len(pairs), 1),
        "dpo/sample_accuracy": correct / max(len(examples) * group_size, 1),
    }
    return pairs, stats
