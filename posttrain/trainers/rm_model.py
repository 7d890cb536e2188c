"""The model side of ``posttrain rm``: a causal LM turned into a one-output sequence classifier, and
its last-token features and scores computed exactly as the ``reward_model`` reward reads them.

A reward model here is an ``AutoModelForSequenceClassification`` with ``num_labels = 1``: the base
transformer of the policy plus a linear ``score`` head (no bias) read at the last token of
``prompt + completion``. Built from the policy-style base at ``model.path`` (or the tiny model) by
:func:`as_reward_model`: same config, the base's weights, a fresh head. Saved with ``save_pretrained``
it loads unchanged through ``[[reward]] name = "reward_model"`` (``posttrain/rewards/reward_model.py``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from posttrain.models.load import ModelLoadError
from posttrain.rollout.hf import right_pad
from posttrain.trainers.dpo_pairs import TokenPair


def as_reward_model(causal: PreTrainedModel, pad_token_id: int) -> PreTrainedModel:
    """A one-output sequence classifier holding ``causal``'s transformer weights and a new ``score`` head.

    ``AutoModelForSequenceClassification.from_config`` on a copy of the config (``num_labels = 1``,
    ``pad_token_id`` set: the head is read at the rightmost non-pad token), then the causal LM's state
    dict loaded non-strictly: every weight of the transformer must be found (the LM head is dropped) and
    only the head, a linear ``score``, may be new (drawn by the architecture's own init from the global
    RNG, which ``seed_everything`` seeded).

    Raises:
        ModelLoadError: the architecture has no sequence-classification class, or the weights do not
            line up (another base-model prefix).

    """
    config = copy.deepcopy(causal.config)
    config.num_labels, config.pad_token_id = 1, pad_token_id
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    config.architectures = None
    try:
        rm = AutoModelForSequenceClassification.from_config(config, dtype=causal.dtype)
    except ValueError as e:
        raise ModelLoadError(f"model.path: {type(causal).__name__} has no sequence-classification class ({e}); "
                             "posttrain rm needs an architecture AutoModelForSequenceClassification knows") from e
    missing, unexpected = rm.load_state_dict(causal.state_dict(), strict=False)
    head = {n for n, _ in rm.named_parameters() if not n.startswith(rm.base_model_prefix + ".")}
    if set(missing) - head or not isinstance(getattr(rm, "score", None), torch.nn.Linear):
        raise ModelLoadError(f"model.path: the policy's weights do not fit {type(rm).__name__} "
                             f"(missing {sorted(set(missing) - head)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return rm.to(causal.device)


def load_reward_model(path: str, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """A checkpoint of ``posttrain rm`` (a one-output sequence classifier) in ``dtype`` on ``device``."""
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the reward model checkpoint {path!r}: {e}") from e
    return model.to(device)


def pair_rows(pairs: list[TokenPair], eos_id: int) -> tuple[list[list[int]], Tensor]:
    """The 2B token rows of B pairs (chosen rows, then rejected rows) and their completion lengths ``[2B]``.

    A row is prompt + completion, with EOS appended to a completion that lacks it (a sampled completion cut
    at ``max_new_tokens``): the ``reward_model`` reward encodes (prompt, completion) through the chat
    template, which closes the assistant turn with EOS, so the score is read at the same token.
    Lengths count completion tokens, EOS included.
    """
    completions = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    completions = [c if c and c[-1] == eos_id else [*c, eos_id] for c in completions]
    rows = [p.prompt + c for p, c in zip(pairs + pairs, completions, strict=True)]
    return rows, torch.tensor([len(c) for c in completions], dtype=torch.float32)


def last_token_features(model: PreTrainedModel, rows: list[list[int]]) -> Tensor:
    """The final hidden state at the token where the model's own head is read: ``[N, H]``.

    Rows are right-padded; the position is the rightmost non-pad token, the rule of transformers'
    ``GenericForSequenceClassification.forward``, so ``model.score(features)`` equals ``model(...).logits``
    (the head is linear and applied per position) and a training score equals the ``reward_model`` score.
    """
    pad = int(model.config.pad_token_id)
    ids_NT, attn_NT = right_pad(rows, pad)
    ids_NT, attn_NT = ids_NT.to(model.device), attn_NT.to(model.device)
    hidden_NTH = getattr(model, model.base_model_prefix)(input_ids=ids_NT, attention_mask=attn_NT).last_hidden_state
    positions_T = torch.arange(ids_NT.shape[1], device=ids_NT.device)
    last_N = (positions_T * (ids_NT != pad)).argmax(-1)
    return hidden_NTH[torch.arange(len(rows), device=ids_NT.device), last_N]


@torch.no_grad()
def score_rows(model: PreTrainedModel, rows: list[list[int]], chunk: int) -> Tensor:
    """Scores ``[N]`` (float32, on the CPU) of ``rows`` in eval mode, ``chunk`` rows per forward pass."""
    was_training = model.training
    model.eval()
    out = [model.score(last_token_features(model, rows[i : i + chunk]))[:, 0] for i in range(0, len(rows), chunk)]
    model.train(was_training)
    return torch.cat(out).float().cpu()
