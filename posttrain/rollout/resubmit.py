"""``rollout.on_new_weights = "resubmit" | "continue"``: a batch in flight when newer weights arrive is cut there,
and its unfinished rows are sampled again from their prompts (``resubmit``) or continued from where they
were cut (``continue``), with the newer weights.

With ``rollout.max_staleness = S > 0`` the producer samples the batch of step ``i`` with the policy
of step ``i - S`` (``posttrain/produce/pipeline.py``); the learner may finish a step while that batch
is still decoding. ``"finish"`` (the default) completes the batch with the weights it started with,
so a run is a deterministic function of its seed. ``"resubmit"`` is AReaL's interruptible
generation (arXiv:2505.24298, section 4) in its discard form: the engine stops after its current
decode step (the ``interrupt=`` hook of ``HFEngine.generate``, and of ``VLLMEngine.generate``, which
stops between scheduler steps; with ``cluster.backend = "ray"`` ``RayEngine.generate`` has each rollout
worker's hf engine stop so), the rows that had ended keep what
they sampled, the rows still running are dropped (their tokens are counted as waste) and sampled
again from their prompts with the newest weights, which may be cut again. Every row is sampled by
one policy from its first token to its last, so its ``policy_version`` and behaviour log-probs stay
exact (AReaL instead continues a cut row with the new weights, which mixes policies inside a row);
the lag of a resubmitted row is smaller, at the price of the dropped tokens and of a run that
depends on timing (two runs with one seed can differ; a resume loses nothing but is not exact).

``"continue"`` is AReaL's own form (its rollout client resubmits prompt + accumulated tokens after an
abort): a cut row keeps the tokens it had, and the prompt with them is sent to the engine again, with
the newer weights, for the rest of its token budget (``max_new_tokens`` and ``min_new_tokens`` less
what it has). Nothing sampled is dropped. Each token's behaviour log-prob is that of the policy that
drew it, so the behaviour correction and ``algorithm.old_logprobs = "behaviour"`` stay exact per
token; the row's ``policy_version`` stays that of its *first* token (its oldest policy), so the
staleness bound (``offpolicy/staleness_max <= S``) holds for every token of it, as AReaL bounds a
trajectory by its oldest version. A row can be cut and continued again; its text is decoded from all
its tokens. Timing decides where rows are cut, so runs depend on timing as with ``resubmit``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import Tensor

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.batch import Rollout, put_rows

MODES = ("resubmit", "continue")


def cut_rows(r: Rollout) -> list[int]:
    """The rows an interrupted ``generate`` left running: those it flagged ``cut``. A flag, not "unfinished
    and as wide as the batch": the parts of a Ray batch stop at different steps (or run to
    ``max_new_tokens``, truncating rows) and are padded to one width when they are joined.
    """
    return r.cut.nonzero().flatten().tolist()


class ResubmittingEngine:
    """An interruptible engine (``interruptible = True``) that resubmits its cut rows (module docstring).

    ``newer()`` says whether weights newer than the engine's have been published; ``take()`` returns
    the newest ``(weights, version)``, which the engine then syncs. ``mode`` is ``"resubmit"`` (cut
    rows are sampled again from their prompts) or ``"continue"`` (from where they were cut).
    Everything else is the engine's.
    """

    def __init__(self, engine: object, newer: Callable[[], bool],
                 take: Callable[[], tuple[Mapping[str, Tensor], int]], mode: str = "resubmit") -> None:
        if mode not in MODES:
            raise ValueError(f"ResubmittingEngine: mode must be one of {MODES}, got {mode!r}")
        if not getattr(engine, "interruptible", False):
            raise ValueError(f"rollout.on_new_weights = '{mode}' needs an engine that can stop mid-batch; "
                             f"{type(engine).__name__} cannot (the hf and vllm engines can, in this process or on "
                             "Ray workers)")
        self.engine, self.newer, self.take, self.mode = engine, newer, take, mode
        self.resubmitted = 0  # rows sampled again (resubmit) or continued (continue) since the last pop_counts()
        self.cut_tokens = 0  # tokens those rows had sampled before they were cut: dropped or kept, by mode
        self.token_versions: Counter[int] = Counter()  # policy version -> tokens it sampled, of the rows returned
        self._tails: dict[int, list[tuple[int, int]]] = {}  # row -> (version, tokens) of each continuation

    def __getattr__(self, name: str) -> object:  # pad_id, version, model, tokenizer, close, ...
        if name == "engine":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """The engine's own ``sync``."""
        self.engine.sync(weights, version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """``engine.generate``, with the rows cut by newer weights sampled again (``resubmit``) or continued
        (``continue``) with them, until no row is cut.
        """
        fired = False

        def interrupt() -> bool:
            nonlocal fired
            fired = fired or self.newer()
            return fired

        out = self.engine.generate(prompts, sampling, seed, interrupt=interrupt)
        todo = cut_rows(out)
        rounds, self._tails = 0, {}
        while todo:
            rounds += 1
            self.resubmitted += len(todo)
            self.cut_tokens += int(out.lengths[todo].sum())
            weights, version = self.take()
            self.engine.sync(weights, version)
            fired = False
            again = None if seed is None else (seed * 1_000_003 + rounds) % 2**62
            if self.mode == "continue":
                out, todo = self._continue(out, todo, sampling, again, interrupt)
                continue
            redo = self.engine.generate([out.row_prompts[i] for i in todo], replace(sampling, n=1), again,
                                        interrupt=interrupt)
            out = put_rows(out, todo, redo, self.engine.pad_id)
            todo = [todo[j] for j in cut_rows(redo)]
        self._count_versions(out)
        return out

    def _count_versions(self, out: Rollout) -> None:
        """Add the tokens of ``out`` to :attr:`token_versions` by the policy version that sampled each: a row's
        own version, less the continuations (``_tails``) sampled by newer ones.
        """
        for i, (version, length) in enumerate(zip(out.policy_version.tolist(), out.lengths.tolist(), strict=True)):
            tails = self._tails.get(i, [])
            self.token_versions[int(version)] += int(length) - sum(n for _, n in tails)
            for v, n in tails:
                self.token_versions[v] += n

    def _continue(self, out: Rollout, todo: list[int], sampling: SamplingParams, seed: int | None,
                  interrupt: Callable[[], bool]) -> tuple[Rollout, list[int]]:
        """``out`` with its cut rows ``todo`` continued by the engine's current weights, and the rows cut
        again. Rows of one length share a call (their budgets are equal); the calls' seeds differ.
        """
        lengths = out.lengths
        still: list[int] = []
        for k, width in enumerate(sorted({int(lengths[i]) for i in todo})):
            rows = [i for i in todo if int(lengths[i]) == width]
            left = replace(sampling, n=1, max_new_tokens=sampling.max_new_tokens - width,
                           min_new_tokens=max(0, sampling.min_new_tokens - width))
            heads = [out.row_prompts[i] + out.token_ids[i, :width].tolist() for i in rows]
            tail = self.engine.generate(heads, left, None if seed is None else seed + k, interrupt=interrupt)
            out = put_rows(out, rows, joined(out, rows, width, tail, self.engine), self.engine.pad_id)
            for j, i in enumerate(rows):
                self._tails.setdefault(i, []).append((int(tail.policy_version[j]), int(tail.lengths[j])))
            still += [rows[j] for j in cut_rows(tail)]
        return out, sorted(still)

    def pop_counts(self) -> dict[str, float]:
        """The rows resubmitted or continued and the tokens dropped or kept since the last call (then zeroed)."""
        rows, tokens = (("rollout/continued", "rollout/kept_tokens") if self.mode == "continue"
                        else ("rollout/resubmitted", "rollout/dropped_tokens"))
        counts = {rows: float(self.resubmitted), tokens: float(self.cut_tokens)}
        self.resubmitted = self.cut_tokens = 0
        return counts

    def pop_token_versions(self) -> dict[int, int]:
        """The tokens of the rows returned since the last call, by the policy version that sampled them (then
        zeroed): one version per row with ``resubmit``, a row's older head and newer continuations with
        ``continue``.
        """
        got, self.token_versions = dict(self.token_versions), Counter()
        return got


def joined(out: Rollout, rows: list[int], width: int, tail: Rollout, engine: object) -> Rollout:
    """The rows ``rows`` of ``out`` (each ``width`` tokens long, cut) followed by ``tail``'s rows (their
    continuations, one each): tokens, masks and behaviour log-probs side by side, ``finished`` and ``cut``
    the tail's, ``policy_version`` the head's (the row's oldest policy), texts decoded from every token.
    """
    idx = torch.tensor(rows, dtype=torch.long)
    tokens = torch.cat([out.token_ids[idx, :width], tail.token_ids], 1)
    mask = torch.cat([out.attention_mask[idx, :width], tail.attention_mask], 1)
    logps = torch.cat([out.behaviour_logprobs[idx, :width], tail.behaviour_logprobs], 1)
    eos = int(engine.eos_id)
    texts = engine.tokenizer.batch_decode(
        [[t for t, m in zip(row.tolist(), keep.tolist(), strict=True) if m > 0 and t != eos]
         for row, keep in zip(tokens, mask, strict=True)],
        skip_special_tokens=True,
    )
    part = Rollout.single_turn([out.row_prompts[i] for i in rows], tokens, mask, logps, tail.finished, texts,
                               1, cut=tail.cut)
    part.policy_version = out.policy_version[idx].clone()
    return part
