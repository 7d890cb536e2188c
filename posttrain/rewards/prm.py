r"""A process reward model as a step reward: ``algorithm.step_reward = "prm"``.

``step_reward_params = {path = "...", separator = "\n", device = "cpu", dtype = "float32"}`` loads a
Hugging Face token-classification model once per process (``AutoModelForTokenClassification``,
a local directory or a hub id; a causal LM checkpoint gets a new head) and scores every step of a
response at the step's last token, the way step-level PRMs (Math-Shepherd, PRM800K-style
verifiers) read their per-step labels: the input is the chat prompt (the model's own template,
with the generation prompt) followed by the response; the response is split after every
``separator`` (a step ends with its separator, empty pieces are dropped) and step k's score is
read at the last token of the response's first k steps. One output: sigmoid(logit); two
outputs: softmax probability of label 1 ("good step"). Any other head size is an error.

Token positions come from tokenizing each step's text prefix on its own, which equals the full
tokenization for character-level tokenizers and may differ by a merge at the boundary for BPE.
Like reward models, the PRM is trusted code run in the trainer's process; a step's responses are scored
in batched forwards (`batch_size`, default 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from posttrain.models.load import _DTYPES, ModelLoadError, check_model_path, encode_chat, load_tokenizer
from posttrain.rewards.steps import register
from posttrain.rollout.hf import right_pad

# what load errors name: this reward's parameter, not the policy's model.path
PATH_KEY = "prm's params.path"


def split_after(text: str, separator: str) -> list[int]:
    """End offsets (exclusive) of the steps of ``text``: each step ends after a ``separator`` or at
    the end; steps that are empty or only whitespace are dropped. ``"a,b,"`` with ``","`` -> [2, 4].
    """
    ends, start = [], 0
    while start < len(text):
        cut = text.find(separator, start)
        end = len(text) if cut < 0 else cut + len(separator)
        if text[start:end].replace(separator, "").strip():
            ends.append(end)
        start = end
    return ends


class ProcessRewardModel:
    """A token-classification model read at step ends (module docstring)."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        check_model_path(path, PATH_KEY)
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        self.tokenizer = load_tokenizer(path, key=PATH_KEY)
        try:
            model = AutoModelForTokenClassification.from_pretrained(path, dtype=_DTYPES[dtype])
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not load a token-classification model from {path!r}: {e}") from e
        if model.config.num_labels not in (1, 2):
            raise ModelLoadError(f"{path!r} has {model.config.num_labels} outputs; a PRM has 1 or 2")
        self.model: PreTrainedModel = model.to(device).eval()
        self.device = device

    def positions(self, prompt: str, completion: str, separator: str) -> tuple[list[int], list[int]]:
        """Token ids of prompt + response and the index of each step's last token."""
        tok = self.tokenizer
        prompt_ids = encode_chat(tok, prompt)
        ends = split_after(completion, separator)
        ids = prompt_ids + list(tok(completion, add_special_tokens=False)["input_ids"])
        at = [len(prompt_ids) + len(tok(completion[:e], add_special_tokens=False)["input_ids"]) - 1 for e in ends]
        return ids, [min(a, len(ids) - 1) for a in at]

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], completions: Sequence[str], separator: str, batch_size: int = 16
    ) -> list[list[float]]:
        """Each response's step scores in [0, 1], in order (``[]`` for a response without steps).

        Responses with steps run ``batch_size`` at a time, right-padded (so positions do not move)
        with an attention mask; sorted by length first, for less padding.
        """
        out: list[list[float]] = [[] for _ in prompts]
        encoded = [self.positions(p, c, separator) for p, c in zip(prompts, completions, strict=True)]
        todo = sorted((i for i, (_, at) in enumerate(encoded) if at), key=lambda i: len(encoded[i][0]))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for b in range(0, len(todo), batch_size):
            rows = todo[b : b + batch_size]
            ids, attn = right_pad([encoded[i][0] for i in rows], pad)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits.float()
            for j, i in enumerate(rows):
                at = logits[j, encoded[i][1]]
                probs = torch.sigmoid(at[:, 0]) if at.shape[-1] == 1 else torch.softmax(at, -1)[:, 1]
                out[i] = probs.cpu().tolist()
        return out


@lru_cache(maxsize=4)
def _load(path: str, device: str, dtype: str) -> ProcessRewardModel:
    return ProcessRewardModel(path, device=device, dtype=dtype)


@register("prm")
def prm(
    prompt: str,
    completion: str,
    *,
    path: str,
    separator: str = "\n",
    device: str = "cpu",
    dtype: str = "float32",
    **_: object,
) -> list[float]:
    """A process reward model's score of each step, read at the step's last token (module
    ``posttrain.rewards.prm``): sigmoid of a 1-output head, or P(label 1) of a 2-output head.
    Steps end after each ``separator``. Math-Shepherd (Wang et al. 2023, arXiv:2312.08935) labels
    steps this way; ``prm_clip`` / ``prm_delta`` (arXiv:2410.15115) shape rewards with the scores.
    """
    return _load(path, device, dtype).score([prompt], [completion], separator)[0]


def _prm_batch(
    prompts: list[str],
    completions: list[str],
    *,
    path: str,
    separator: str = "\n",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
    **_: object,
) -> list[list[float]]:
    """``prm`` over a whole list in batched forwards (what ``score_steps`` calls)."""
    return _load(path, device, dtype).score(prompts, completions, separator, batch_size)


prm.batch = _prm_batch  # type: ignore[attr-defined]
