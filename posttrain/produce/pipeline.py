"""Where a step's batch comes from: produced now (``rollout.max_staleness = 0``, the synchronous loop)
or by a producer thread that keeps generating while the learner updates (``max_staleness = S > 0``).

Asynchronous training with a bounded policy lag, as in AReaL (arXiv:2505.24298, admission
``accepted + running <= (S + version + 1) * B``), verl's one-step-off and fully-async trainers and
prime-rl's ``max_off_policy_steps``: the batch of step ``i`` is sampled with the policy the learner
had after step ``max(0, i - S)``. The producer owns a second engine (over its own copy of the
model and tokenizer) and takes that policy's weights before it starts batch ``i``; the learner
publishes a snapshot of its weights after every step. So at most ``S + 1`` batches are ahead of
the learner, no trained sample is more than ``S`` learner steps old (``offpolicy/staleness_max``),
and, because the lag is fixed rather than "whatever the engine has now", a run is a deterministic
function of its seed: two runs agree, and a resumed run continues the uninterrupted one. The
batches sampled with weights a checkpoint no longer holds (steps ``t .. t + S - 1`` at step ``t``)
go into the checkpoint (``LoopState.pipeline``), so ``kill -9`` and ``--resume`` lose nothing and
train nothing twice. With ``S = 0`` :meth:`RolloutPipeline.take` runs :func:`collect` in the
caller's thread with the run's own engine: the synchronous loop, through the same call.

``rollout.on_new_weights = "resubmit"`` (``posttrain/rollout/resubmit.py``) trades that determinism for a
smaller lag: the producer starts each batch with the newest weights published (at least step
``i - S``'s), and a batch still decoding when newer weights come cuts its unfinished rows and
samples them again with those. Each row's lag is then measured from its own ``policy_version``.
``rollout.on_new_weights = "continue"`` continues the cut rows from where they were cut instead (AReaL's partial
rollouts): nothing sampled is dropped, and a row's lag is that of its first (oldest) token.

The pipeline owns the weight hand-off, so the loop never asks which of the two it runs: after every
learner step :meth:`RolloutPipeline.after_update` gives the new weights to the engine that samples next
(synchronous: the run's engine, at once; asynchronous: published for the producer's engine), and
:meth:`RolloutPipeline.for_eval` returns the run's own engine holding the learner's current weights. The
weights come from a :class:`WeightsSource` (the Learner), in the form each engine takes them.

The learner corrects for the lag with what it already has: old log-probs recomputed at update time
(``algorithm.old_logprobs = "recompute"``, decoupled PPO's proximal policy) and a behaviour
correction between them and the sampler's log-probs (``algorithm.behaviour_correction``: tis,
icepop, seq_mask, mis).
"""

from __future__ import annotations

import copy
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from torch import Tensor

from posttrain.produce.batch import Batch
from posttrain.produce.drivers import ProduceContext
from posttrain.rollout.resubmit import MODES, ResubmittingEngine


class WeightsSource(Protocol):
    """Whoever holds the policy being trained (the Learner); the pipeline hands its weights to the engines."""

    def weights_for(self, engine: object) -> Mapping[str, Tensor]:
        """The policy's weights as ``engine`` takes them at a sync (a LoRA adapter or merged weights, ...)."""
        ...


Collect = Callable[[ProduceContext, int, int, list | None, object], Batch]  # (ctx, step, cursor, shapers, driver)


@dataclass
class Ahead:
    """A batch made ahead of the learner, with the learner step whose weights sampled it."""

    step: int  # the training step it is for
    batch: Batch
    weights_step: int  # learner steps the sampling weights had taken
    idle_s: float  # how long the producer waited for those weights before it started
    row_steps: list[int] | None = None  # per kept row, when rows were sampled by different weights (resubmit, continue)
    counts: dict[str, float] | None = None  # the resubmitting engine's counts for this batch
    token_steps: dict[int, int] | None = None  # learner step -> tokens its weights sampled (resubmit, continue)


class RolloutPipeline:
    """The producer side of the loop (see the module docstring). Its bound on the policy lag is AsyncFlow's
    staleness threshold (seed ``papers/000_99b2b1db2eead048.txt:17``).
    """

    def __init__(self, collect: Collect, ctx: ProduceContext, max_staleness: int, total_steps: int,
                 on_new_weights: str = "finish", home: object | None = None) -> None:
        self.collect, self.ctx, self.S, self.total = collect, ctx, max_staleness, total_steps
        self._home = home if home is not None else ctx.engine  # the run's own engine: it evaluates
        self._home_version: int | None = None  # the policy version it holds (None: not handed any yet)
        self.cuts = on_new_weights in MODES and max_staleness > 0  # rows cut by newer weights: resubmitted or continued
        if self.cuts:
            engine = ResubmittingEngine(ctx.engine, self._newer, self._take_newest, on_new_weights)
            self.ctx = replace(ctx, engine=engine)
        self._using = -1  # the learner step of the weights the producer's engine holds
        self._step_of_version: dict[int, int] = {}  # policy version -> learner step, of the weights synced
        self._cond = threading.Condition()
        self._ready: dict[int, Ahead] = {}
        self._weights: dict[int, tuple[dict[str, Tensor], int]] = {}  # learner step -> (snapshot, version)
        self._published = -1
        self._floor = 0  # the first learner step whose weights exist in this process (the resumed one)
        self._error: BaseException | None = None
        self._stop = False
        self._engine_closed = False
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, collect: Collect, ctx: ProduceContext, max_staleness: int, total_steps: int,
              make_engine: Callable[[object, object], object], on_new_weights: str = "finish",
              model: object | None = None) -> RolloutPipeline:
        """The run's pipeline. With ``max_staleness > 0`` the producer gets its own engine:
        ``make_engine(model_copy, tokenizer_copy)`` over copies of the policy (``model``, by default the
        run's engine's own module: the hf engine's) and the tokenizer; an engine that loads a copy of its
        own (vllm, Ray workers) drops the module copy once built. ``on_new_weights`` is ``rollout.on_new_weights``.
        """
        home = ctx.engine
        if max_staleness > 0:
            model = copy.deepcopy(model if model is not None else ctx.engine.model)
            tokenizer = copy.deepcopy(ctx.tokenizer)
            ctx = replace(ctx, engine=make_engine(model, tokenizer), tokenizer=tokenizer)
        return cls(collect, ctx, max_staleness, total_steps, on_new_weights, home=home)

    @property
    def engine(self) -> object:
        """The engine the batches are sampled with: the run's own with ``max_staleness = 0``, else the
        producer's, so that :meth:`start` gets the weights as that engine takes them (``Learner.weights_for``).
        """
        return self.ctx.engine

    def start(self, step: int, cursor: int, buffered: bytes, source: WeightsSource, version: int) -> None:
        """Begin producing at learner ``step`` (data ``cursor``) from the current weights of ``source`` (the
        Learner; policy ``version``, as :attr:`engine` takes them); ``buffered`` is :meth:`checkpoint_state` of
        the checkpoint being resumed (``b""``: none). Synchronous: the run's engine takes the weights now.
        """
        weights = source.weights_for(self.engine)
        if self.S == 0:
            self._home.sync(weights, version)
            self._home_version = version
            return
        kept: list[Ahead] = pickle.loads(buffered) if buffered else []
        self._ready = {p.step: p for p in kept}
        self._floor = step
        first = step + len(kept)
        cursor += sum(p.batch.consumed for p in kept)
        self.publish(step, weights, version)
        self._thread = threading.Thread(target=self._run, args=(first, cursor), name="posttrain-producer", daemon=True)
        self._thread.start()

    def publish(self, step: int, weights: Mapping[str, Tensor], version: int) -> None:
        """The learner has taken ``step`` steps: its weights (copied now) may sample batch ``step + S``."""
        if self.S == 0:
            return
        snapshot = {k: v.detach().clone() for k, v in weights.items()}
        with self._cond:
            self._weights[step] = (snapshot, version)
            self._published = step
            self._cond.notify_all()

    def after_update(self, source: WeightsSource, step: int, version: int) -> None:
        """The learner has taken ``step`` steps and holds policy ``version``: the engine that samples next
        takes its weights. Synchronous: the run's engine, now, when the version moved (an update without an
        optimizer step leaves it). Asynchronous: they are published (:meth:`publish`) for the producer's
        engine, which takes them before it starts batch ``step + S``.
        """
        if self.S == 0:
            self._hand_home(source, version)
        else:
            self.publish(step, source.weights_for(self.engine), version)

    def for_eval(self, source: WeightsSource, version: int) -> object:
        """The engine that evaluates, holding the learner's policy ``version``: the run's own engine (in an
        asynchronous run it samples nothing else, so it takes the weights only here, when they moved).
        """
        self._hand_home(source, version)
        return self._home

    def _hand_home(self, source: WeightsSource, version: int) -> None:
        """The run's own engine takes ``source``'s weights as policy ``version``, unless it holds them."""
        if version != self._home_version:
            self._home.sync(source.weights_for(self._home), version)
            self._home_version = version

    def take(self, step: int, cursor: int, shaper_states: list | None, driver_state: object) -> tuple[Batch, dict]:
        """The batch of ``step`` and the pipeline's metrics for it (none in the synchronous loop)."""
        if self.S == 0:
            return self.collect(self.ctx, step, cursor, shaper_states, driver_state), {}
        t0 = time.perf_counter()
        got = self._wait(step)
        with self._cond:
            del self._ready[step]
        lags = [step - s for s in got.row_steps] if getattr(got, "row_steps", None) else [step - got.weights_step]
        tokens = getattr(got, "token_steps", None) or {got.weights_step: 1}
        token_lag = sum(n * (step - s) for s, n in tokens.items()) / max(1, sum(tokens.values()))
        return got.batch, {
            "offpolicy/staleness_mean": sum(lags) / len(lags),
            "offpolicy/staleness_max": float(max(lags)),
            # per token: a continued row's newer tokens count with the weights that sampled them
            "offpolicy/token_staleness_mean": token_lag,
            "time/learner_idle_s": time.perf_counter() - t0,
            "time/generator_idle_s": got.idle_s,
            **(getattr(got, "counts", None) or {}),
        }

    def checkpoint_state(self, step: int) -> bytes:
        """What a checkpoint at learner ``step`` must hold: the batches of steps ``step .. step + S - 1``
        (sampled with weights older than the checkpoint's), waiting for any still in the making.
        """
        if self.S == 0:
            return b""
        kept = [self._wait(i) for i in range(step, min(step + self.S, self.total))]
        return pickle.dumps(kept)

    def close(self) -> None:
        """Stop the producer (it finishes the batch it is making; a daemon thread never blocks exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            if not self._thread.is_alive():
                self._close_engine()
            # else the producer is mid-batch: it closes its engine when that batch ends (_run's finally)

    def _close_engine(self) -> None:
        """Close the producer's own engine (Ray workers, vllm), once, from whichever thread gets here first."""
        with self._cond:
            if self._engine_closed:
                return
            self._engine_closed = True
        close = getattr(self.ctx.engine, "close", None)
        if close is not None:
            close()

    def _use(self, step: int) -> tuple[dict[str, Tensor], int]:
        """The weights of learner ``step`` for the producer's engine (older ones are dropped); under the lock."""
        weights, version = self._weights[step]
        for old in [k for k in self._weights if k < step]:
            del self._weights[old]
        self._using = step
        self._step_of_version[version] = step
        return weights, version

    def _newer(self) -> bool:
        """Whether the learner has published weights newer than the producer's (resubmit's interrupt)."""
        return self._published > self._using

    def _take_newest(self) -> tuple[dict[str, Tensor], int]:
        with self._cond:
            return self._use(self._published)

    def _wait(self, step: int) -> Ahead:
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"the rollout producer failed while making a batch: {self._error}") \
                        from self._error
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"the rollout producer is not running; batch {step} will never come")
                self._cond.wait(timeout=1.0)
            return self._ready[step]

    def _run(self, step: int, cursor: int) -> None:
        try:
            while step < self.total:
                # the learner steps of the weights batch `step` samples with; a run resumed from its last
                # checkpoint with more steps has no older weights than the resumed ones (a smaller lag)
                need = max(0, step - self.S, self._floor)
                t0 = time.perf_counter()
                with self._cond:
                    while self._published < need and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    if self.cuts:  # the newest weights there are (at least step `need`'s)
                        need = max(need, self._published)
                    weights, version = self._use(need)
                idle = time.perf_counter() - t0
                self.ctx.engine.sync(weights, version)
                batch = self.collect(self.ctx, step, cursor, None, None)
                ahead = Ahead(step, batch, need, idle)
                if self.cuts:
                    versions = batch.rollouts.policy_version.tolist()
                    ahead.row_steps = [self._step_of_version.get(int(v), need) for v in versions]
                    ahead.counts = self.ctx.engine.pop_counts()
                    ahead.token_steps = {}
                    for v, n in self.ctx.engine.pop_token_versions().items():
                        s = self._step_of_version.get(v, need)
                        ahead.token_steps[s] = ahead.token_steps.get(s, 0) + n
                with self._cond:
                    self._ready[step] = ahead
                    self._cond.notify_all()
                cursor += batch.consumed
                step += 1
        except BaseException as e:  # surfaced to the learner at its next take()
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            if self._stop:  # closed while this batch was still being made: the engine goes with the thread
                self._close_engine()
