r"""The progress advantage as a step reward: ``algorithm.step_reward = "progress"``.

An RL-trained policy is an implicit process reward model. Under KL-regularized RL the optimal
policy is pi*(a|s) proportional to pi_ref(a|s) exp(A*(s, a) / beta), so the log-ratio of the trained
policy to its starting point is a (shifted) advantage of each token:

    A(s_t, y_t) = beta * (log pi_RL(y_t | s_t) - log pi_ref(y_t | s_t))

and a step's progress is the sum over its tokens, score_k = beta * sum_{t in step k} log-ratio_t
(the catalog's "progress advantage", 004_f298e9ec572f7f27.txt: 9, from the abstract and the
identity; the paper's exact aggregation is not verified: the sum is ours). It scores steps for the
process-reward shapers (``prm_clip``, ``prm_delta``), best-of-N or failure attribution without a
trained PRM: a step the RL policy likes more than its reference scores positive.

``step_reward_params = {policy = "...", reference = "...", beta = 1.0, separator = "\n"}``: two
causal LMs with the same tokenizer (the policy's is used), loaded once per process (``device``,
``dtype``). The input is the chat prompt (the policy's template, with the generation prompt)
followed by the response; steps end after every ``separator`` as for ``prm``
(:func:`~posttrain.rewards.prm.split_after`), and a step's tokens are those between the previous
step's end and its own (token positions from tokenizing each step's text prefix, exact for
character-level tokenizers, within one merge at a boundary for BPE). Temperature 1: the models'
plain distributions.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from posttrain.models.load import _DTYPES, ModelLoadError, encode_chat, load_model, load_tokenizer
from posttrain.rewards.prm import split_after
from posttrain.rewards.steps import register
from posttrain.rollout.hf import right_pad

POLICY_KEY, REFERENCE_KEY = "progress's params.policy", "progress's params.reference"


def step_progress(logratio_T: Tensor, step_ends: Sequence[int], beta: float = 1.0) -> list[float]:
    """The progress of each step, beta * the sum of its token log-ratios: step k covers tokens
    ``[step_ends[k-1], step_ends[k])`` (the first from 0). ``logratio_T`` is log pi_RL - log pi_ref of
    the response's tokens. Hand example (catalog 3.11): a 2-token step with (pi_RL, pi_ref) = (0.6, 0.3)
    and (0.5, 0.5), beta 1: log 2 + log 1 = 0.693147.
    """
    cum = torch.cat([logratio_T.new_zeros(1), logratio_T.double().cumsum(0)])
    starts = [0, *step_ends[:-1]][: len(step_ends)]
    return [float(beta * (cum[e] - cum[s])) for s, e in zip(starts, step_ends, strict=True)]


class ProgressScorer:
    """The RL policy and its reference, read on the same responses (module docstring)."""

    def __init__(self, policy: str, reference: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        self.tokenizer = load_tokenizer(policy, key=POLICY_KEY)
        self.policy = load_model(policy, dtype, device, key=POLICY_KEY).eval()
        self.reference = load_model(reference, dtype, device, key=REFERENCE_KEY).eval()
        if self.policy.config.vocab_size != self.reference.config.vocab_size:
            raise ModelLoadError(
                f"progress: the policy ({self.policy.config.vocab_size} tokens) and the reference "
                f"({self.reference.config.vocab_size}) do not share a vocabulary"
            )
        self.device = device

    def encode(self, prompt: str, completion: str, separator: str) -> tuple[list[int], int, list[int]]:
        """Token ids of prompt + response, the prompt's length and each step's end (in response tokens)."""
        tok = self.tokenizer
        prompt_ids = encode_chat(tok, prompt)
        response = list(tok(completion, add_special_tokens=False)["input_ids"])
        cuts = split_after(completion, separator)
        ends = [len(tok(completion[:e], add_special_tokens=False)["input_ids"]) for e in cuts]
        return prompt_ids + response, len(prompt_ids), [min(e, len(response)) for e in ends]

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], completions: Sequence[str], separator: str, beta: float, batch_size: int = 16
    ) -> list[list[float]]:
        """Each response's step progress, in order (``[]`` for a response without steps)."""
        out: list[list[float]] = [[] for _ in prompts]
        enc = [self.encode(p, c, separator) for p, c in zip(prompts, completions, strict=True)]
        todo = sorted((i for i, e in enumerate(enc) if e[2]), key=lambda i: len(enc[i][0]))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for b in range(0, len(todo), batch_size):
            rows = todo[b : b + batch_size]
            ids, attn = right_pad([enc[i][0] for i in rows], pad)
            ids, attn = ids.to(self.device), attn.to(self.device)
            lr = _token_logprobs(self.policy, ids, attn) - _token_logprobs(self.reference, ids, attn)
            for j, i in enumerate(rows):
                full, n_prompt, ends = enc[i]
                out[i] = step_progress(lr[j, n_prompt - 1 : len(full) - 1].cpu(), ends, beta)
        return out


def _token_logprobs(model: torch.nn.Module, ids: Tensor, attn: Tensor) -> Tensor:
    """The log-prob log p(ids[t + 1] | ids[: t + 1]) at every position t, ``[B, L - 1]`` (float32)."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


@lru_cache(maxsize=2)
def _load(policy: str, reference: str, device: str, dtype: str) -> ProgressScorer:
    return ProgressScorer(policy, reference, device=device, dtype=dtype)


@register("progress")
def progress(
    prompt: str,
    completion: str,
    *,
    policy: str,
    reference: str,
    beta: float = 1.0,
    separator: str = "\n",
    device: str = "cpu",
    dtype: str = "float32",
    **_: object,
) -> list[float]:
    """Progress advantage of each step: beta * sum over its tokens of log pi_RL / pi_ref (module
    ``posttrain.rewards.progress``). ``policy``: an RL-trained checkpoint; ``reference``: the model it
    started from. beta 1.0 is ours (the identity's beta is the run's KL coefficient, which the scorer
    cannot know). Steps end after each ``separator``. Seed: ``papers/004_f298e9ec572f7f27.txt:9``.
    """
    return _load(policy, reference, device, dtype).score([prompt], [completion], separator, beta)[0]


def _progress_batch(
    prompts: list[str],
    completions: list[str],
    *,
    policy: str,
    reference: str,
    beta: float = 1.0,
    separator: str = "\n",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
    **_: object,
) -> list[list[float]]:
    """``progress`` over a whole list in batched forwards (what ``score_steps`` calls)."""
    return _load(policy, reference, device, dtype).score(prompts, completions, separator, beta, batch_size)


progress.batch = _progress_batch  # type: ignore[attr-defined]
