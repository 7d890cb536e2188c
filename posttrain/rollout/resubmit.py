"""``rollout.partial = "resubmit"``: a batch in flight when newer weights arrive is cut there, and its
unfinished rows are sampled again, from their prompts, with the newer weights.

With ``rollout.max_staleness = S > 0`` the producer samples the batch of step ``i`` with the policy
of step ``i - S`` (``posttrain/train/pipeline.py``); the learner may finish a step while that batch
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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from torch import Tensor

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.batch import Rollout, put_rows


def cut_rows(r: Rollout) -> list[int]:
    """The rows an interrupted ``generate`` left running: those it flagged ``cut``. A flag, not "unfinished
    and as wide as the batch": the parts of a Ray batch stop at different steps (or run to
    ``max_new_tokens``, truncating rows) and are padded to one width when they are joined.
    """
    return r.cut.nonzero().flatten().tolist()


class ResubmittingEngine:
    """An interruptible engine (``interruptible = True``) that resubmits its cut rows (module docstring).

    ``newer()`` says whether weights newer than the engine's have been published; ``take()`` returns
    the newest ``(weights, version)``, which the engine then syncs. Everything else is the engine's.
    """

    def __init__(self, engine: object, newer: Callable[[], bool],
                 take: Callable[[], tuple[Mapping[str, Tensor], int]]) -> None:
        if not getattr(engine, "interruptible", False):
            raise ValueError(f"rollout.partial = 'resubmit' needs an engine that can stop mid-batch; "
                             f"{type(engine).__name__} cannot (the hf engine can, in this process or on Ray workers)")
        self.engine, self.newer, self.take = engine, newer, take
        self.resubmitted = 0  # rows sampled again since the last pop_counts()
        self.dropped_tokens = 0  # tokens those rows had sampled before they were cut

    def __getattr__(self, name: str) -> object:  # pad_id, version, model, tokenizer, close, ...
        if name == "engine":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """The engine's own ``sync``."""
        self.engine.sync(weights, version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """``engine.generate``, with the rows cut by newer weights sampled again with them."""
        fired = False

        def interrupt() -> bool:
            nonlocal fired
            fired = fired or self.newer()
            return fired

        out = self.engine.generate(prompts, sampling, seed, interrupt=interrupt)
        todo = cut_rows(out)
        rounds = 0
        while todo:
            rounds += 1
            self.resubmitted += len(todo)
            self.dropped_tokens += int(out.lengths[todo].sum())
            weights, version = self.take()
            self.engine.sync(weights, version)
            fired = False
            again = None if seed is None else (seed * 1_000_003 + rounds) % 2**62
            redo = self.engine.generate([out.row_prompts[i] for i in todo], replace(sampling, n=1), again,
                                        interrupt=interrupt)
            out = put_rows(out, todo, redo, self.engine.pad_id)
            todo = [todo[j] for j in cut_rows(redo)]
        return out

    def pop_counts(self) -> dict[str, float]:
        """The rows resubmitted and the tokens dropped since the last call (then zeroed)."""
        counts = {"rollout/resubmitted": float(self.resubmitted), "rollout/dropped_tokens": float(self.dropped_tokens)}
        self.resubmitted = self.dropped_tokens = 0
        return counts
