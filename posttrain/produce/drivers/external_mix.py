"""The ``external_mix`` rollout driver: each group mixes on-policy samples with the example's demonstration.

RL-PLUS (arXiv:2508.00222; catalog 3.10) trains on groups in which ``n_external`` of the G rows are an
external solution, the task example's ``demonstration`` (the gold completion SFT trains on), and the other
G - n_external are the policy's own samples. The authors' released run (YihongDong/RL-PLUS @ eb4aa4d4e2,
``exp_scripts/train_RL-PLUS.sh``: ``rollout.n = 8``, ``n_prefix = 1``, ``min_prefix_ratio = max_prefix_ratio
= 1.0``; ``rlplus_vllm_rollout.py``) puts the whole target in place of one of the n samples, so a group keeps
its G rows: here too the engine samples G - n_external completions per prompt and the demonstration fills
the last n_external rows of the group, ``[P, G]`` as everywhere else.

- The demonstration is tokenized as a completion: its tokens (no special tokens) + EOS, cut at
  ``rollout.max_new_tokens`` (then it is unfinished, as a truncated sample is), with every token attended to
  and trained on. An empty demonstration carries no tokens to learn: its row is invalid (out of the update).
- It is scored by the run's reward components like every sample. ``accuracy`` and ``reward/<name>/*``
  describe the policy's own samples only; ``external/accuracy`` is the verifier's mean over the
  demonstrations and ``external/rows`` their count.
- Its behaviour log-probs are unknown (no sampler drew it): ``Rollout.behaviour_logprobs`` holds 0 there,
  a placeholder nothing may read. The loss's pi_old is the learner's policy before the update, recomputed
  (``algorithm.old_logprobs = "recompute"``; the current log-probs detached on an on-policy update), as
  the authors' trainer recomputes ``old_log_prob`` over the whole batch; the config refuses the options
  that would read the sampler's log-probs (``old_logprobs = "behaviour"``, a behaviour correction, OPSM).
- ``Batch.external_PG`` (bool ``[P, G]``) marks the rows; it reaches the advantage estimator as the
  input ``external [P, G]`` (``prepare/providers.py``) and the loss as the row input ``external [N]``.
- Its ``policy_version`` is the engine's (the policy whose pi_old the learner recomputes).

Options: ``rollout.driver_params.n_external`` (:class:`ExternalMixParams`). Stateless.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from posttrain.config.base import Section
from posttrain.models.chat import encode_example
from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register
from posttrain.rollout import Rollout
from posttrain.rollout.batch import join_groups
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example

if TYPE_CHECKING:
    from posttrain.config import ProduceSettings


class ExternalMixParams(Section):
    """``rollout.driver = "external_mix"`` (RL-PLUS, arXiv:2508.00222): the last ``n_external`` rows of each
    group are the example's demonstration (tokens + EOS) in place of samples; the engine samples the other
    G - n_external (posttrain/produce/drivers/external_mix.py).
    """

    n_external: int = Field(
        1, ge=1, description="rows of each group filled with the demonstration (the authors' n_prefix = 1)"
    )


def leaves_samples(settings: ProduceSettings) -> None:
    """A group keeps at least one on-policy sample beside its ``n_external`` demonstration rows."""
    k = settings.rollout.params().n_external
    if settings.rollout.group_size <= k:
        raise ValueError(f"rollout.group_size: {settings.rollout.group_size} leaves no on-policy sample beside "
                         f"rollout.driver_params.n_external = {k}; use a group of at least {k + 1}")


@register("external_mix", options=ExternalMixParams, check=leaves_samples, external_rows=True, replayable=False,
          engines=("hf",), note="its demonstration rows have no sampler log-probs and carry an `external` flag; "
          "tested with the hf engine only so far")
def external_mix(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """P stream prompts; G - n_external samples each plus n_external copies of the example's demonstration
    (module docstring), scored. Stateless.
    """
    settings = ctx.settings
    P, G = settings.rollout.prompts_per_step, ctx.sampling.n
    k = int(settings.rollout.params().n_external)
    examples = draw_prompts(ctx.task, P, settings.seed, cursor)
    t0 = time.perf_counter()
    prompt_ids = [encode_example(ctx.tokenizer, ex, settings.task.system_prompt) for ex in examples]
    own = ctx.engine.generate(prompt_ids, replace(ctx.sampling, n=G - k),
                              seed=derive_seed(settings.seed, "sample", step, batch))
    ext = demonstration_rollout(ctx.tokenizer, prompt_ids, examples, k, ctx.sampling.max_new_tokens,
                                ctx.engine.pad_id, int(getattr(ctx.engine, "version", 0)))
    t1 = time.perf_counter()
    own_PGK, own_valid, own_ok, metrics, failures = ctx.score(examples, own)
    ext_PGK, ext_valid, ext_ok, ext_metrics, ext_failures = ctx.score(examples, ext)
    ext_valid = ext_valid & (ext.loss_mask.sum(-1) > 0).view(P, k)
    for fails, n, first in ((failures, G - k, 0), (ext_failures, k, G - k)):  # row indices in the mixed batch
        for f in fails:
            if "index" in f:
                f["index"] = (f["index"] // n) * G + first + f["index"] % n
    metrics = metrics | {"external/accuracy": ext_metrics["accuracy"], "external/rows": float(P * k)}
    rollouts = mix_groups(own, ext, ctx.engine.pad_id)
    rewards_PGK = torch.cat([own_PGK, ext_PGK], dim=1)
    return Batch(
        examples=examples,
        prompt_ids=prompt_ids,
        rollouts=rollouts,
        scored_texts=rollouts.texts,
        rewards_PGK=rewards_PGK * ctx.weights_K,
        valid_PG=torch.cat([own_valid, ext_valid], dim=1),
        correct_PG=torch.cat([own_ok, ext_ok], dim=1),
        rerolled_P=torch.zeros(P, dtype=torch.bool),
        metrics=metrics,
        failures=failures + ext_failures,
        consumed=P,
        generate_s=t1 - t0,
        reward_s=time.perf_counter() - t1,
        gen_tokens=own.num_tokens,
        external_PG=torch.cat([torch.zeros(P, G - k, dtype=torch.bool), torch.ones(P, k, dtype=torch.bool)], dim=1),
    ), state


def demonstration_rollout(
    tokenizer: object,
    prompt_ids: list[list[int]],
    examples: list[Example],
    n: int,
    max_new_tokens: int,
    pad_id: int,
    version: int,
) -> Rollout:
    """Each example's demonstration as ``n`` completions of its prompt: its tokens + EOS, cut at
    ``max_new_tokens`` (unfinished then); behaviour log-probs 0 (unknown: no sampler drew them).
    """
    eos = int(tokenizer.eos_token_id)
    rows = []
    for ex in examples:
        ids = list(tokenizer(ex.demonstration, add_special_tokens=False)["input_ids"]) if ex.demonstration else []
        rows.append((ids + [eos])[:max_new_tokens] if ids else [])
    width = max(1, *(len(r) for r in rows))
    tokens_PT = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask_PT = torch.zeros(len(rows), width)
    for p, r in enumerate(rows):
        tokens_PT[p, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask_PT[p, : len(r)] = 1.0
    finished_P = torch.tensor([bool(r) and r[-1] == eos for r in rows])
    texts = tokenizer.batch_decode([[t for t in r if t != eos] for r in rows], skip_special_tokens=True)
    rep = torch.arange(len(rows)).repeat_interleave(n)
    return Rollout.single_turn(
        [list(p) for p in prompt_ids], tokens_PT[rep], mask_PT[rep], torch.zeros(len(rep), width),
        finished_P[rep], [texts[i] for i in rep.tolist()], n, policy_version=version,
    )


def mix_groups(a: Rollout, b: Rollout, pad_id: int) -> Rollout:
    """Group p of the result is group p of ``a`` followed by group p of ``b`` (same prompts): n = a.n + b.n,
    right-padded to one width.
    """
    return join_groups([a, b], pad_id)
