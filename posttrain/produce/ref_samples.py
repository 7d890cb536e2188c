"""Rewards of responses sampled from the frozen reference policy, M per prompt.

The methods that compare the policy with its starting point through reference samples read them:

- PAR (``shapers = [{name = "par", params = {samples = M}}]``, arXiv:2502.18770): the policy's reward
  is centred on the rewards of M reference (SFT) responses, M <= 10 in the authors' code;
- A*-PO (``algorithm.advantage = "a_star"``, arXiv:2505.20686): the optimal value V*(x) =
  beta1 log mean_j exp(r_j / beta1) over N reference samples is the baseline of one online sample.

Both are functions of the reference policy and the prompt alone, so each prompt's M responses are
sampled once, when the prompt is first met, with a seed derived from the run's seed and the prompt
text (not the step or the batch: a resumed run and a run that meets the prompt in another batch
draw the same), scored with the run's reward components and weights, and kept for the rest of the
run. This is the papers' offline stage (A*-PO's ``_process_values`` reads values computed before
training) done lazily: a prompt the run never meets costs nothing.

The same stage done up front: ``posttrain astar-values RECIPE`` draws, through :meth:`ReferenceRewards.for_run`,
exactly these samples for the run's training prompts and writes them to a file (``trainers/astar_values.py``);
a run naming it in ``algorithm.reference_values`` :meth:`~ReferenceRewards.preload` s them and samples only
the prompts the file lacks (``produce/ref_values.py``).
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
from torch import Tensor

from posttrain.config import ProduceSettings
from posttrain.models.chat import encode_example
from posttrain.rollout import HFEngine, RolloutEngine, SamplingParams
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example


class ReferenceRewards:
    """``rewards(examples, m) -> [P, m]``: the weighted rewards of the first ``m`` of each prompt's
    ``samples`` reference responses (module docstring). ``score(examples, rollout)`` is the run's
    scorer (:meth:`ProduceContext.score`); ``weights_K`` the components' weights.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: object, sampling: SamplingParams, samples: int,
                 seed: int, system_prompt: str | None, score: object, weights_K: Tensor) -> None:
        self.engine, self.tokenizer, self.system_prompt = engine, tokenizer, system_prompt
        self.sampling = replace(sampling, n=samples)
        self.seed, self.score, self.weights_K = seed, score, weights_K
        self.cache: dict[str, Tensor] = {}  # prompt -> [samples]
        self.correct: dict[str, Tensor] = {}  # prompt -> bool [samples]: the task's verifier (sampled prompts only)
        self.sampled = 0  # prompts sampled so far (for the log and tests)
        self.loaded = 0  # prompts read from a file of precomputed rewards (preload)
        self._lock = threading.Lock()  # the producer thread and the learner may both ask

    @classmethod
    def for_run(cls, settings: ProduceSettings, start_model: torch.nn.Module, tokenizer: object, score: object,
                samples: int) -> ReferenceRewards:
        """The sampler of a run of ``settings``: the hf engine over the frozen ``start_model``, the run's
        ``[rollout]`` sampling with n = ``samples``, its seed, system prompt and reward weights. The
        training loop and ``posttrain astar-values`` both build it here, so they draw alike.
        """
        r = settings.rollout
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, n=samples, min_new_tokens=r.min_new_tokens)
        return cls(HFEngine(start_model, tokenizer), tokenizer, sampling, samples, settings.seed,
                   settings.task.system_prompt, score, torch.tensor(settings.reward_weights))

    def preload(self, rewards: dict[str, Tensor]) -> None:
        """Take each prompt's ``[samples]`` rewards from ``rewards`` (a file of ``posttrain astar-values``)
        instead of sampling them; prompts it lacks are still sampled when met.
        """
        bad = next((p for p, r in rewards.items() if r.shape != (self.sampling.n,)), None)
        if bad is not None:
            raise ValueError(f"{tuple(rewards[bad].shape)} reference rewards given for a prompt of a sampler that "
                             f"draws {self.sampling.n} per prompt")
        with self._lock:
            self.cache.update({p: r.float() for p, r in rewards.items()})
            self.loaded += len(rewards)

    def __call__(self, examples: list[Example], m: int) -> Tensor:
        """``[P, m]``: each example's first ``m`` reference rewards (sampled now if its prompt is new)."""
        if m > self.sampling.n:
            raise ValueError(f"{m} reference samples asked of a sampler that draws {self.sampling.n} per prompt")
        with self._lock:
            for ex in examples:
                if ex.prompt not in self.cache:
                    self.cache[ex.prompt] = self._sample(ex)
            return torch.stack([self.cache[ex.prompt][:m] for ex in examples])

    def _sample(self, ex: Example) -> Tensor:
        ids = encode_example(self.tokenizer, ex, self.system_prompt)
        rollouts = self.engine.generate([ids], self.sampling, seed=derive_seed(self.seed, "reference", ex.prompt))
        rewards_PGK, _, correct_PG, _, _ = self.score([ex], rollouts)
        self.correct[ex.prompt] = correct_PG[0].bool()
        self.sampled += 1
        return (rewards_PGK.nan_to_num(0.0) * self.weights_K).sum(-1)[0].float()  # a failed score counts 0
