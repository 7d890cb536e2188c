"""The ``hf`` rollout engine: batched sampling with a KV cache on a Hugging Face causal LM.

Each prompt is prefilled once (the G completions of a group share their prompt: the LLaMA-family
fast path, ``fast_llama.py``, keeps one copy of its K/V; the generic path repeats the HF cache
``n`` times), then tokens are decoded one step at a time for the whole batch until every row has
produced EOS or ``max_new_tokens`` is reached, each drawn exactly from the policy by
``sampling.sample_next``. It runs the policy module itself, so ``sync`` only records the policy
version when it is handed the module's own tensors (and copies them when the engine holds a
separate model).

Where a decode step went for SmolLM2-135M, 8 prompts x 8 completions, 64 new tokens, fp32, one
CPU core (cpu-ms a step, by ablation): before 460 = attention with K/V repeated per query head and
completion 179, MLP 146, sampling (multinomial, two log_softmax) 78, lm_head 42, q/k/v/o 34;
after 196 = MLP 83, attention 39, lm_head 38, q/k/v/o 23, sampling 8, norms + rope 10.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.cache_arg import with_cache
from posttrain.models.precision import compute
from posttrain.rollout import fast_llama
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.batch import Rollout
from posttrain.rollout.sampling import sample_next


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to ``[B, L]``; returns (ids, attention mask)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists to ``[B, L]`` (positions of real tokens do not move); returns (ids,
    attention mask).
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


class HFEngine:
    """Batched KV-cache sampler over a ``PreTrainedModel`` (see module docstring)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fast: bool = True,
                 autocast: torch.dtype | None = None) -> None:
        self.model = model
        self.autocast = autocast  # matmuls in this dtype (model.autocast; models/precision.py), None: as stored
        # the lean LLaMA-family decode path when the architecture allows it (see fast_llama.py)
        self.fast = fast and fast_llama.supports(model)
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.version = 0

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Take policy ``version``: copy ``weights`` into the engine's model unless they already are
        its own tensors (the learner and the engine share the module: then only the version moves).
        """
        own = self.model.state_dict()
        missing = [k for k in weights if k not in own]
        if missing:
            raise KeyError(f"sync: weights the engine's model does not have: {missing[:5]}")
        if not all(own[k].data_ptr() == v.data_ptr() for k, v in weights.items()):
            self.model.load_state_dict(dict(weights), strict=False)
        self.version = int(version)

    interruptible = True  # generate() takes interrupt= (rollout.on_new_weights = "resubmit" | "continue")

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seed: int | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> Rollout:
        """Sample ``sampling.n`` completions per prompt (see :class:`Rollout`). The batch draws from
        one random stream seeded by ``seed`` (``None``: torch's global generator).

        ``interrupt`` is asked after every decode step that leaves rows unfinished; when it returns
        True the batch stops there: the rows still running come back cut (``cut`` True, ``finished``
        False and as long as the batch's widest row, short of ``max_new_tokens``), the others as they
        ended.
        """
        device = next(self.model.parameters()).device
        # the draws happen on the model's device, so the seeded stream lives there too
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        longest = max(len(p) for p in prompts)
        if longest + 1 > self.max_positions:
            raise ValueError(
                f"a prompt has {longest} tokens but the model's context is {self.max_positions} tokens"
            )
        max_new = min(sampling.max_new_tokens, self.max_positions - longest)
        was_training = self.model.training
        self.model.eval()
        try:
            with compute(device, self.autocast):
                return self._generate(prompts, sampling, max_new, generator, interrupt)
        finally:
            self.model.train(was_training)

    def _generate(
        self,
        prompts: list[list[int]],
        sp: SamplingParams,
        max_new: int,
        generator: torch.Generator | None,
        interrupt: Callable[[], bool] | None,
    ) -> Rollout:
        device = next(self.model.parameters()).device
        ids_PL, attn_PL = left_pad(prompts, self.pad_id)
        ids_PL, attn_PL = ids_PL.to(device), attn_PL.to(device)
        width = attn_PL.shape[1]
        if self.fast:
            logits, kv = fast_llama.prefill(self.model, ids_PL, attn_PL, sp.n, max_new)
        else:
            pos_PL = (attn_PL.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache()
            out = self.model(input_ids=ids_PL, attention_mask=attn_PL, position_ids=pos_PL, use_cache=True,
                             logits_to_keep=1, **with_cache(self.model, cache))
            logits = out.logits[:, -1]
            if sp.n > 1:  # the group shares its prompt: prefill once, repeat the cache
                cache.batch_repeat_interleave(sp.n)
                logits = logits.repeat_interleave(sp.n, dim=0)
                attn_PL = attn_PL.repeat_interleave(sp.n, dim=0)
                pos_PL = pos_PL.repeat_interleave(sp.n, dim=0)
            attn = torch.cat([attn_PL, attn_PL.new_ones((attn_PL.shape[0], max_new))], 1)
            next_pos = pos_PL[:, -1] + 1
        n_rows = logits.shape[0]
        tokens_NT = torch.full((n_rows, max_new), self.pad_id, dtype=torch.long, device=device)
        logp_NT = torch.zeros((n_rows, max_new), device=device)
        alive = torch.ones(n_rows, dtype=torch.bool, device=device)
        eos_index = torch.tensor([self.eos_id], device=device)
        steps, stopped = 0, False
        for t in range(max_new):
            # EOS cannot be drawn before min_new_tokens; the log-probs stay the policy's own
            tok, lp = sample_next(logits, sp.temperature, sp.top_k, sp.top_p, generator,
                                  banned=eos_index if t < sp.min_new_tokens else None)
            tokens_NT[:, t] = torch.where(alive, tok, self.pad_id)
            logp_NT[:, t] = torch.where(alive, lp, 0.0)
            steps = t + 1
            alive &= tok != self.eos_id
            if t == max_new - 1 or not bool(alive.any()):
                break
            if interrupt is not None and interrupt():
                stopped = True  # the rows still alive are cut
                break
            if self.fast:
                logits = fast_llama.decode_step(self.model, kv, tokens_NT[:, t], t)
            else:
                out = self.model(input_ids=tokens_NT[:, t : t + 1], attention_mask=attn[:, : width + t + 1],
                                 position_ids=(next_pos + t)[:, None], use_cache=True, **with_cache(self.model, cache))
                logits = out.logits[:, -1]
        tokens_NT, logp_NT = tokens_NT[:, :steps], logp_NT[:, :steps]
        is_eos = tokens_NT == self.eos_id
        # mask: every token up to and including the first EOS
        mask_NT = (is_eos.long().cumsum(1) - is_eos.long()) == 0
        finished = is_eos.any(1)
        texts = self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(tokens_NT, mask_NT & ~is_eos, strict=True)],
            skip_special_tokens=True,
        )
        return Rollout.single_turn(
            [list(p) for p in prompts],
            tokens_NT.cpu(),
            mask_NT.float().cpu(),
            logp_NT.float().cpu(),
            finished.cpu(),
            texts,
            sp.n,
            policy_version=self.version,
            cut=(alive if stopped else torch.zeros_like(alive)).cpu(),
        )
