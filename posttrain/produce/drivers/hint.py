"""The ``hint_reroll`` rollout driver: HINT's hint re-roll inside the loop's collection step.

After a generation batch is scored, every group whose rewards are all 0 (:func:`selection.
hint_reroll_mask` on the weighted, unshaped reward sum) and whose example has a hint is sampled
again from ``prompt + preamble + hint`` (:func:`selection.hint_prompt`), scored the
same way, and **replaces** the original group; shaping and the group filter come after, on the
replaced groups. The replaced group is trained on the plain question by default
(``rollout.driver_params.train_prompt = "question"``), as HINT's code does: ``gen_hint_samples`` returns
``policy_prompt_fn(item)``, which is the no-hint ``make_prompt_fn`` in ``rl_hint.py``, and the
generation log-probs are recomputed on that prompt (``compute_gen_logps``; ViviqwerAsd/HINT @
b9e003c, ``lsrl_hint.py``). Here too the PPO ratio's old log-probs are the trainer's on the trained
prompt (recomputed when the update is off-policy, else the detached current ones). The sampler's
log-probs in ``Rollout.behaviour_logprobs`` were taken with the hint in context, so ``policy/affinity``
(sampler vs trainer log-probs) sees the hint's shift for re-rolled groups; in HINT's code the
Affinity is taken against the recomputed no-hint log-probs and does not. ``"hinted"`` trains on
the prompt the group was sampled from instead (on-policy).

Paper: "Don't Tell the Answer, Truly Guide the Reasoning During RL Rollouts" (HINT), arXiv:2510.09388;
seed ``papers/000_99b2b1db2eead048.txt:3`` (catalog 3.1).

AAPO (the loss weight ``aapo`` of ``algorithms/loss_weights.py``: ``algorithm.loss_weights = [{ name = "aapo",
params = { lam = 1.0 } }]``, HINT's ``affinity_lambda`` = 1; listed, not on by default): in the update, each
re-rolled group's per-token loss is multiplied by its Affinity^lambda, detached
(``diagnostics.group_affinity`` over the group's rows of the minibatch, against the PPO ratio's old
log-probs, i.e. the trainer's on the trained prompt, as HINT's ``gen_logps`` recomputed on the
no-hint prompt; token weights |A|; band 1 +- ``eps_low``). On the first minibatch of an on-policy
update the ratio is 1 and the weight is 1 (0 for a group whose advantages are all 0); it bites on
later epochs / minibatches, where the policy has moved. ``policy/aapo_weight`` is the mean weight
of the re-rolled rows that carry a signal (non-zero advantages).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from posttrain.algorithms import selection
from posttrain.config import ProduceSettings
from posttrain.config.base import Section
from posttrain.errors import ConfigError
from posttrain.models.chat import encode_example, with_user_text
from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, register
from posttrain.produce.drivers.single_turn import single_turn
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams, concat_rollouts
from posttrain.seeds import derive_seed
from posttrain.tasks import TASKS
from posttrain.tasks.base import Example, Task

Scorer = Callable[[list[Example], Rollout], tuple[Tensor, Tensor, Tensor, dict[str, float], list[dict]]]


@dataclass
class Rerolled:
    """One generation batch after the re-roll: the re-rolled groups replaced in every tensor."""

    rollouts: Rollout
    rewards_PGK: Tensor  # weighted components
    valid_PG: Tensor
    correct_PG: Tensor
    train_ids: list[list[int]]  # the prompt each group is trained on
    rerolled_P: Tensor  # bool [P]: the group was re-rolled with its hint (AAPO weights its loss)
    metrics: dict[str, float]
    failures: list[dict]
    generate_s: float  # sampling time of the re-roll (the rest of its time is scoring)
    discarded_tokens: int  # tokens of the replaced groups (generated, not in ``rollouts``)


class HintParams(Section):
    """``rollout.driver = "hint_reroll"`` (HINT, arXiv:2510.09388): a group whose rewards are all 0 is
    sampled again from the prompt + ``preamble`` + the example's hint and replaces the original group
    (posttrain/produce/drivers/hint.py); needs a task with hints (arithmetic, or a dataset with
    task.dataset.fields.hint). HINT's AAPO is the loss weight ``aapo`` (``algorithm.loss_weights``).
    """

    preamble: str = Field(
        selection.HINT_PREAMBLE, description="the text between the question and the hint (the paper's by default)"
    )
    train_prompt: Literal["question", "hinted"] = Field(
        "question",
        description="the prompt a re-rolled group is trained on: the question alone, as HINT's code does "
        "(the completions were sampled with the hint, so they are off-policy), or the hinted prompt",
    )


def has_hints(settings: ProduceSettings) -> None:
    """The task gives hints: a dataset maps a hint column, or a built-in task declares ``hints``."""
    ds = settings.task.dataset
    if ds is not None and not ds.fields.get("hint"):
        raise ValueError("rollout.driver: hint_reroll needs hints, and the dataset has none; map a column "
                         "with task.dataset.fields.hint = COLUMN")
    if ds is None and not getattr(TASKS[settings.task.name], "hints", False):
        with_hints = [n for n, t in TASKS.items() if getattr(t, "hints", False)]
        raise ValueError(f"rollout.driver: hint_reroll needs hints; task {settings.task.name!r} gives none; tasks "
                         f"with hints: {with_hints}, or 'dataset' with task.dataset.fields.hint")


def hinted_prompts_fit(
    settings: ProduceSettings, task: Task, tokenizer: object, longest: int, max_positions: int
) -> None:
    """The re-roll's prompts (question + preamble + hint, longer than the questions) leave room for
    ``rollout.max_new_tokens`` in the context.
    """
    sample = task.examples("train", 256, seed=0)  # the questions' sample of run/setup.py's check_context
    hinted = [hinted_example(settings, ex) for ex in sample if ex.hint]
    most = max((len(encode_example(tokenizer, ex, settings.task.system_prompt)) for ex in hinted), default=0)
    if most + settings.rollout.max_new_tokens > max_positions:
        raise ConfigError(
            f"HINT's re-roll prompts (question + rollout.driver_params.preamble + hint) take up to {most} "
            f"tokens; with rollout.max_new_tokens={settings.rollout.max_new_tokens} that exceeds the model's context "
            f"of {max_positions} tokens: shorten rollout.driver_params.preamble"
        )


def hinted_prompt(settings: ProduceSettings, example: Example) -> str:
    """The re-roll's user message: question + ``rollout.driver_params.preamble`` + hint."""
    return selection.hint_prompt(example.prompt, example.hint or "", preamble=settings.rollout.params().preamble)


def hinted_example(settings: ProduceSettings, example: Example) -> Example:
    """``example`` asking the hinted question (a chat row keeps its system message and few-shot turns)."""
    return with_user_text(example, hinted_prompt(settings, example))


@register("hint_reroll", options=HintParams, check=has_hints, fits=hinted_prompts_fit, engines=("hf",),
          note="its re-roll is tested with the hf engine only so far")
def hint_reroll(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """``single_turn``, then HINT's re-roll of the all-wrong groups that have a hint (:func:`reroll`):
    ``accuracy`` and ``reward/<name>/*`` still describe the policy's own samples. Stateless.

    Seeds: HINT, ``papers/000_99b2b1db2eead048.txt:3``; Guide-GRPO's guided re-roll,
    ``papers/004_f298e9ec572f7f27.txt:127`` (with ``algorithm.old_logprobs = "behaviour"``,
    ``recipes/guide_grpo.toml``).
    """
    out, _ = single_turn(ctx, None, step, batch, cursor)
    t0 = time.perf_counter()
    re = reroll(ctx.settings, ctx.tokenizer, ctx.engine, ctx.sampling, out.examples, out.prompt_ids, out.rollouts,
                out.rewards_PGK, out.valid_PG, out.correct_PG, ctx.score, ctx.weights_K, step, batch)
    spent = time.perf_counter() - t0
    return replace(
        out, rollouts=re.rollouts, scored_texts=re.rollouts.texts, rewards_PGK=re.rewards_PGK, valid_PG=re.valid_PG,
        correct_PG=re.correct_PG, prompt_ids=re.train_ids, rerolled_P=re.rerolled_P, metrics=out.metrics | re.metrics,
        failures=out.failures + re.failures, generate_s=out.generate_s + re.generate_s,
        reward_s=out.reward_s + spent - re.generate_s, gen_tokens=out.gen_tokens + re.discarded_tokens,
    ), state


def reroll(
    settings: ProduceSettings,
    tokenizer: object,
    engine: RolloutEngine,
    sampling: SamplingParams,
    examples: list[Example],
    prompt_ids: list[list[int]],
    rollouts: Rollout,
    rewards_PGK: Tensor,
    valid_PG: Tensor,
    correct_PG: Tensor,
    score: Scorer,
    weights_K: Tensor,
    step: int,
    batch: int,
) -> Rerolled:
    """Re-roll the all-wrong groups of one scored generation batch that have a hint (module docstring).

    Sampling is seeded from ``(seed, "hint", step, batch)``, so a resumed run re-rolls the same way.
    Metrics: ``selection/hint_rerolls`` (groups re-rolled), ``selection/hint_missing`` (all-wrong
    groups without a hint), ``selection/hint_solved`` (re-rolled groups with a correct sample) and
    ``selection/hint_accuracy`` (the verifier's mean over the re-rolled samples; 0 when none).
    """
    wrong_P = selection.hint_reroll_mask(rewards_PGK.sum(-1))
    groups = [p for p in range(len(examples)) if wrong_P[p] and examples[p].hint]
    metrics = {
        "selection/hint_rerolls": float(len(groups)),
        "selection/hint_missing": float(int(wrong_P.sum()) - len(groups)),
        "selection/hint_solved": 0.0,
        "selection/hint_accuracy": 0.0,
    }
    if not groups:
        no = torch.zeros(len(examples), dtype=torch.bool)
        return Rerolled(rollouts, rewards_PGK, valid_PG, correct_PG, prompt_ids, no, metrics, [], 0.0, 0)
    t0 = time.perf_counter()
    hinted = [encode_example(tokenizer, hinted_example(settings, examples[p]), settings.task.system_prompt)
              for p in groups]
    new = engine.generate(hinted, sampling, seed=derive_seed(settings.seed, "hint", step, batch))
    generate_s = time.perf_counter() - t0
    new_PGK, new_valid, new_ok, _, failures = score([examples[p] for p in groups], new)
    metrics["selection/hint_solved"] = float(new_ok.any(dim=1).sum())
    metrics["selection/hint_accuracy"] = float(new_ok.float().mean())
    rewards_PGK, valid_PG, correct_PG = rewards_PGK.clone(), valid_PG.clone(), correct_PG.clone()
    rewards_PGK[groups] = new_PGK * weights_K
    valid_PG[groups] = new_valid
    correct_PG[groups] = new_ok
    slot = {p: j for j, p in enumerate(groups)}
    pieces = [new.select_groups([slot[p]]) if p in slot else rollouts.select_groups([p]) for p in range(len(examples))]
    train_ids = list(prompt_ids)
    if settings.rollout.params().train_prompt == "hinted":
        for p, j in slot.items():
            train_ids[p] = hinted[j]
    return Rerolled(
        rollouts=concat_rollouts(pieces, engine.pad_id),
        rewards_PGK=rewards_PGK,
        valid_PG=valid_PG,
        correct_PG=correct_PG,
        train_ids=train_ids,
        rerolled_P=torch.tensor([p in slot for p in range(len(examples))]),
        metrics=metrics,
        failures=failures,
        generate_s=generate_s,
        discarded_tokens=int(rollouts.attention_mask.view(len(examples), -1)[groups].sum()),
    )
