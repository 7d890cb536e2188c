"""Reward models: a Hugging Face sequence-classification model scores (prompt, completion) pairs.

``[[reward]] name = "reward_model"`` with ``params = {path = "...", device = "cpu", batch_size = 32}``
loads the model once per process (``AutoModelForSequenceClassification``, a local directory or a
hub id) and scores a whole batch at once: the conversation ``[user: prompt, assistant: completion]``
goes through the reward model's own chat template (plain ``prompt + completion`` for a tokenizer
without one), batches are formed by length, and the reward is the model's single output at the
last non-pad token. The reward model is trusted code running posttrain's own forward pass, so it
runs in the trainer's process (on ``device``, which may differ from the policy's), not in the
reward workers; an exception still scores the batch ``None`` and the run goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.load import _DTYPES, ModelLoadError, check_model_path, load_tokenizer
from posttrain.rewards.registry import register
from posttrain.rollout.hf import right_pad

# what load errors name: this reward's parameter, not the policy's model.path
PATH_KEY = "reward_model's params.path"


class RewardModel:
    """A sequence-classification reward model with batched scoring.

    Args:
        path: model directory or hub id.
        device: where the model runs (``"cpu"``, ``"cuda:1"``, ...).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        batch_size: pairs per forward pass.
        max_length: pairs longer than this many tokens are cut from the left (keeping the
            completion's end, where the score is read); default the model's context.

    """

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        max_length: int | None = None,
    ) -> None:
        check_model_path(path, PATH_KEY)
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(path, key=PATH_KEY)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_DTYPES[dtype])
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not load a sequence-classification model from {path!r}: {e}") from e
        if model.config.num_labels != 1:
            raise ModelLoadError(f"{path!r} has {model.config.num_labels} outputs; a reward model has 1")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model: PreTrainedModel = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None)

    def encode(self, prompt: str, completion: str) -> list[int]:
        """Token ids of one (prompt, completion) conversation, cut from the left to ``max_length``."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = tok.apply_chat_template(messages, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tok(prompt + completion, add_special_tokens=True)["input_ids"])
        return ids[-self.max_length :] if self.max_length else ids

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Scores of each pair, in order; batches are formed by sorted length (less padding)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        out = [0.0] * len(encoded)
        pad = self.model.config.pad_token_id
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            ids, attn = right_pad([encoded[i] for i in idx], pad)  # the score is read at the last real token
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
            last = attn.sum(1) - 1
            values = logits.float().cpu()[torch.arange(len(idx)), last, 0] if logits.dim() == 3 else logits[:, 0]
            for row, i in enumerate(idx):
                out[i] = float(values[row])
        return out


@lru_cache(maxsize=4)
def cached_reward_model(
    path: str, device: str = "cpu", dtype: str = "float32", batch_size: int = 32, max_length: int | None = None
) -> RewardModel:
    """One :class:`RewardModel` per (path, device, dtype, batch_size, max_length) in this process."""
    return RewardModel(path, device=device, dtype=dtype, batch_size=batch_size, max_length=max_length)


@register("reward_model")
def reward_model_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    path: str,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 32,
    max_length: int | None = None,
    scale: float = 1.0,
    **_: object,
) -> list[float]:
    """``scale * RM(prompt, completion)`` for a whole batch (a batched reward: lists in, list out).

    The RM is loaded on first use and kept for the process's life (:func:`cached_reward_model`).
    """
    rm = cached_reward_model(path, device, dtype, batch_size, max_length)
    return [scale * v for v in rm.score(prompts, completions)]


reward_model_reward.batched = True  # type: ignore[attr-defined]
