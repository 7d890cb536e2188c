"""One thread owns the engine; requests that arrive together and sample alike share one ``generate`` call.

The HTTP threads submit :class:`Job` s and wait on their future. The engine thread takes the oldest job,
then, when that job may share a batch (:attr:`Job.batchable`), gathers for ``wait_s`` more seconds every
queued job with the same sampling key (``max_tokens``, ``temperature``, ``top_p``, ``n``) up to
``max_rows`` rows, and runs them as one ``engine.generate``. A job that cannot share runs alone:

- a job with a ``seed``: the engine draws a whole batch from one random stream, so only a call of its own
  gives the tokens that ``engine.generate([prompt], sampling, seed)`` gives (what a client's seed promises);
- a job whose prompt plus ``max_tokens`` overruns the context: the engine cuts a batch's completions to
  what its longest prompt leaves, which would shorten the other jobs' completions.

Jobs with another key wait, in arrival order, for the next round. A batch without a seed draws one from the
server's own stream (``seed`` of :class:`Batcher`), so a server's answers are reproducible run to run when
the requests arrive alike.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.serve.protocol import Sample


@dataclass
class Job:
    """Prompts to sample (``n`` completions each, prompt-major) and the future their samples go to."""

    prompts: list[list[int]]
    sampling: SamplingParams
    seed: int | None
    batchable: bool
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        """What jobs must share to share a batch: the engine samples a batch with one ``SamplingParams``."""
        s = self.sampling
        return (s.max_new_tokens, s.temperature, s.top_p, s.n)

    @property
    def rows(self) -> int:
        """Sequences the job adds to a batch."""
        return len(self.prompts) * self.sampling.n


class Batcher:
    """The engine thread (module docstring). ``submit`` from any thread; ``close`` stops it."""

    def __init__(self, engine: RolloutEngine, *, wait_s: float = 0.005, max_rows: int = 64, seed: int = 0,
                 max_queue: int = 1024) -> None:
        self.engine, self.wait_s, self.max_rows = engine, wait_s, max_rows
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.waiting: deque[Job] = deque()  # taken from the queue, another key: next round
        self.rng = random.Random(seed)
        self.calls = 0  # engine.generate calls made (tests, logs and GET /health read it)
        self.rows = 0  # sequences those calls sampled: rows / calls is the mean batch
        self.thread = threading.Thread(target=self._loop, name="posttrain-serve-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        """Queue ``job``; raises ``queue.Full`` when ``max_queue`` jobs already wait (the server answers 503)."""
        self.queue.put_nowait(job)
        return job.future

    def close(self) -> None:
        """Stop the engine thread after the jobs already queued."""
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _next(self, timeout: float | None) -> Job | None:
        """The next job: a waiting one first, else from the queue (``None`` at close or timeout)."""
        if self.waiting:
            return self.waiting.popleft()
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _gather(self, first: Job) -> tuple[list[Job], bool]:
        """``first`` and the jobs that share its batch; whether the close sentinel was met."""
        batch, rows, closing = [first], first.rows, False
        if not first.batchable:
            return batch, closing
        keep: deque[Job] = deque()
        while self.waiting:  # jobs already taken that match, in arrival order
            j = self.waiting.popleft()
            if j.batchable and j.key == first.key and rows + j.rows <= self.max_rows:
                batch.append(j)
                rows += j.rows
            else:
                keep.append(j)
        deadline = time.monotonic() + self.wait_s
        while rows < self.max_rows and (left := deadline - time.monotonic()) > 0:
            try:
                j = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if j is None:
                closing = True
                break
            if j.batchable and j.key == first.key and rows + j.rows <= self.max_rows:
                batch.append(j)
                rows += j.rows
            else:
                keep.append(j)
        self.waiting.extendleft(reversed(keep))
        return batch, closing

    def _loop(self) -> None:
        while True:
            first = self._next(None)
            if first is None:
                while self.waiting:  # close: finish what was taken
                    self._run([self.waiting.popleft()])
                return
            batch, closing = self._gather(first)
            self._run(batch)
            if closing:
                self.queue.put(None)

    def _run(self, batch: list[Job]) -> None:
        """One ``engine.generate`` for ``batch``; each job's future gets its own rows (or the error)."""
        live = [j for j in batch if j.future.set_running_or_notify_cancel()]
        if not live:
            return
        prompts = [p for j in live for p in j.prompts]
        seed = live[0].seed if live[0].seed is not None else self.rng.randrange(2**62)
        try:
            self.calls += 1
            self.rows += sum(j.rows for j in live)
            out = self.engine.generate(prompts, live[0].sampling, seed=seed)
            samples = []
            for row in range(out.token_ids.shape[0]):
                keep = out.loss_mask[row] > 0
                samples.append(Sample(out.token_ids[row][keep].tolist(), out.behaviour_logprobs[row][keep].tolist(),
                                      bool(out.finished[row])))
        except Exception as e:  # noqa: BLE001 - the error goes to the waiting requests; the thread lives on
            for j in live:
                j.future.set_exception(e)
            return
        start = 0
        for j in live:
            j.future.set_result(samples[start:start + j.rows])
            start += j.rows


__all__ = ["Batcher", "Job"]
