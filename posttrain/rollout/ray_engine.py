"""Rollouts on Ray actors (``[cluster] backend = "ray"``): K rollout workers, each an actor with its
own copy of the policy and the run's engine (``rollout.engine``: hf, or vllm in the actor's process).

A generation batch is split by prompts into K contiguous parts (all of a prompt's ``n``
completions on one worker); worker k samples its part with a seed derived from the call's seed and
k, so a run is a function of its seed and K. A sync puts the learner's weights in Ray's object
store once and every worker loads them (``full_weights``: a LoRA policy arrives merged). A worker
that dies is dropped with a warning and its part is sampled again on the workers that remain (the
draws then differ from K workers'); when none remains the run stops with a message.

``rollout.on_new_weights = "resubmit" | "continue"`` (``rollout/resubmit.py``) runs on the workers (``interruptible``):
while they decode, ``generate(..., interrupt=)`` asks ``interrupt()`` every ``POLL_S``; once it says
True every worker is told to stop after its current decode step. An hf worker is told by its ``stop``,
which runs in the actor's ``control`` thread beside the ``generate`` in progress; a vllm worker stays a
single-threaded actor (off its main thread vLLM's CPU attention finds another OpenMP thread count than
the one it planned with), so it reads the call to stop from a :class:`StopBoard` actor, at most every
``POLL_S`` between its scheduler steps. Each part's running rows come back flagged ``cut``
(``Rollout.cut``: a flag, since the parts stop at different steps and are padded to one width when they
are joined).

Ray starts locally (``ray.init`` with this machine's CPUs) unless ``cluster.address`` names a
cluster; an address that cannot be reached is refused before Ray tries for a minute.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.batch import Rollout, concat_rollouts

INSTALL_RAY = "pip install 'posttrain[ray]'  (or: pip install ray)"
_LOCAL_CPUS: int | None = None  # the CPUs of the local Ray this process started (None: none, or a cluster)
POLL_S = 0.02  # how often an interruptible generate asks its interrupt() while the workers decode
CONTROL = "control"  # the actors' concurrency group of stop(): a thread of its own beside generate's


class StopBoard:
    """The generate call the workers are to stop (-1: none), read by workers that cannot take a ``stop``
    call while they generate (single-threaded actors: the vllm engine's).
    """

    def __init__(self) -> None:
        self.call = -1

    def stop(self, call: int) -> None:
        """Name ``call`` as the one to stop."""
        self.call = int(call)

    def read(self) -> int:
        """The call named last (-1: none yet)."""
        return self.call


def board_interrupt(board: object, call: int) -> Callable[[], bool]:
    """An ``interrupt`` that is True once ``board`` names ``call``; it asks the board at most every ``POLL_S``."""
    import time

    import ray

    last = [0.0]

    def interrupt() -> bool:
        now = time.monotonic()
        if now - last[0] < POLL_S:
            return False
        last[0] = now
        return ray.get(board.read.remote()) == call

    return interrupt


class EngineWorker:
    """A rollout worker's body (wrapped as a Ray actor): an engine (``hf`` or ``vllm``) over its own copy of
    the policy.
    """

    def __init__(self, config: object, weights: Mapping[str, Tensor], tokenizer: PreTrainedTokenizerBase,
                 engine: str = "hf", engine_params: Mapping[str, object] | None = None, seed: int = 0,
                 autocast: str = "off") -> None:
        from transformers import AutoModelForCausalLM

        from posttrain.models.precision import autocast_dtype
        from posttrain.rollout.factory import make_engine

        self.threads = torch.get_num_threads()  # the process's (an actor's: set by RayWorker)
        model = AutoModelForCausalLM.from_config(config).to(next(iter(weights.values())).dtype)
        model.load_state_dict(dict(weights), strict=False)
        self.engine = make_engine(engine, model, tokenizer, engine_params, seed, autocast_dtype(autocast))
        self.model = model
        self.stopped = -1  # the generate call told to stop (stop(); -1: none)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None,
                 call: int | None = None, board: object | None = None) -> Rollout:
        """The engine's sample of ``prompts``. With a ``call`` number (an interruptible engine) it stops
        after its current decode step once :meth:`stop` (or ``board``, a :class:`StopBoard`) names that
        call, before it began included; its running rows then come back cut.
        """
        torch.set_num_threads(self.threads)  # per thread under OpenMP: a threaded actor's calls run off the main one
        if call is None:
            return self.engine.generate(prompts, sampling, seed=seed)
        stop = board_interrupt(board, call) if board is not None else lambda: self.stopped == call
        return self.engine.generate(prompts, sampling, seed=seed, interrupt=stop)

    def stop(self, call: int) -> None:
        """Stop generate call ``call`` (run in the ``control`` concurrency group, beside it). A number, not
        an event to clear: a stop that comes after its call ended does not stop the next one.
        """
        self.stopped = int(call)

    def sync(self, weights: Mapping[str, Tensor], version: int) -> int:
        """Load ``weights`` (a plain model's, possibly none) as policy ``version``; this process's id.

        The worker's model takes them (the ``hf`` engine samples with it); the engine's own ``sync``
        pushes them into a ``vllm`` engine's copy and resets its prefix cache.
        """
        if weights:
            unexpected = self.model.load_state_dict(dict(weights), strict=False).unexpected_keys
            if unexpected:  # e.g. a LoRA adapter's tensors: ignored, the worker would sample its old policy
                raise ValueError(f"rollout worker: weights that are not a plain model's ({len(unexpected)}, e.g. "
                                 f"{unexpected[0]!r}); a LoRA policy reaches the workers merged")
            self.engine.sync(self.model.state_dict(), int(version))
        self.engine.version = int(version)
        return os.getpid()

    def close(self) -> None:
        """Release the engine (a vllm engine's memory and threads)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def check_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``host:port`` Ray address that does not accept a connection."""
    if not address or address == "auto" or address.startswith("ray://") and ":" not in address[6:]:
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster.address = {address!r}: cannot reach it ({e}); start Ray there "
                          "(`ray start --head`) or leave cluster.address empty for a local Ray") from None


def start_ray(address: str, cpus: int = 0) -> None:
    """Join the cluster at ``address`` or start a local Ray (no dashboard), unless one is running.

    A local Ray offers this machine's CPUs, or ``cpus`` when the run will place more one-CPU actors
    than that (rollout workers and learner ranks then share the cores, as local processes would). A
    local Ray that an earlier run of this process started with fewer CPUs is restarted (runs stop
    their actors when they end).
    """
    global _LOCAL_CPUS
    try:
        import ray
    except ImportError:
        raise ConfigError(f"cluster.backend = 'ray' needs the ray package: {INSTALL_RAY}") from None
    want = max(os.cpu_count() or 1, cpus)
    if ray.is_initialized():
        if address or _LOCAL_CPUS is None or _LOCAL_CPUS >= want:
            return
        ray.shutdown()
    check_address(address)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local single-user cluster
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=want, include_dashboard=False, log_to_driver=False)
        _LOCAL_CPUS = want


def stop_actors(actors: list, method: str, timeout_s: float) -> None:
    """Ask each actor to release what it holds (its ``method``), then kill it; a dead or stuck one is killed anyway."""
    import ray

    for a in actors:
        try:
            ray.get(getattr(a, method).remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 (the kill below ends it either way)
            pass
        ray.kill(a)


def worker_seed(seed: int | None, k: int) -> int | None:
    """Worker ``k``'s seed for a call seeded ``seed`` (``None`` stays unseeded)."""
    return None if seed is None else (seed * 1_000_003 + k) % 2**62


class RayWorker(EngineWorker):
    """An :class:`EngineWorker` as a Ray actor, in a process of its own: it runs on the threads that Ray grants
    the actor (``OMP_NUM_THREADS``, its CPUs). Set here and not in the worker, which a caller may build in its
    own process.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        super().__init__(*args, **kwargs)


class RayEngine:
    """The :class:`~posttrain.rollout.RolloutEngine` of ``cluster.backend = "ray"`` (module docstring)."""

    full_weights = True  # each worker holds a plain model: a LoRA policy is synced merged
    interruptible = True  # generate() takes interrupt= (rollout.on_new_weights = "resubmit" | "continue")

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, workers: int,
                 address: str = "", reserve_cpus: int = 0, engine: str = "hf",
                 engine_params: Mapping[str, object] | None = None, seed: int = 0, autocast: str = "off") -> None:
        start_ray(address, cpus=reserve_cpus)
        import ray

        from posttrain.models.lora import merged_state_dict

        lora = hasattr(model, "peft_config")
        weights = merged_state_dict(model) if lora else model.state_dict()
        # the policy module (what a run hands over: the adapters injected in it) or its PeftModel
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        ref = ray.put({k: v.detach().cpu() for k, v in weights.items()})
        # hf: generate, sync and close one at a time (the default group), stop() in a thread of its own. Other
        # engines stay single-threaded actors: a threaded actor runs its calls off the main thread, where
        # vLLM's CPU attention finds another OpenMP thread count than the one it planned with
        groups = {"concurrency_groups": {CONTROL: 1}} if engine == "hf" else {}
        actor = ray.remote(num_cpus=1, **groups)(RayWorker)
        self.workers = [actor.remote(config, ref, tokenizer, engine, engine_params, seed, autocast)
                        for _ in range(workers)]
        self.pids = ray.get([w.sync.remote(ref, 0) for w in self.workers])  # ready, and where each runs
        self.tokenizer = tokenizer  # rollout.on_new_weights = "continue" decodes a continued row's whole text
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.version = 0
        # generate() takes interrupt= (rollout.on_new_weights = "resubmit" | "continue"): hf workers are told by
        # their stop(), single-threaded (vllm) ones read the call to stop from a board
        self.board = None if engine == "hf" else ray.remote(num_cpus=0)(StopBoard).remote()
        self.calls = 0  # interruptible generate calls so far: the number a worker's stop() names

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None,
                 interrupt: Callable[[], bool] | None = None) -> Rollout:
        """Sample every prompt's ``sampling.n`` completions, the prompts split among the workers.

        ``interrupt`` is asked every ``POLL_S`` while the workers decode; once it
        returns True each worker stops after its current decode step and its running rows come back
        cut (``Rollout.cut``), the others as they ended (module docstring).
        """
        import ray
        from ray.exceptions import RayActorError

        while True:
            if not self.workers:
                raise RuntimeError("every rollout worker died; the run stops here (resume with --resume)")
            parts = [p.tolist() for p in torch.arange(len(prompts)).tensor_split(min(len(self.workers), len(prompts)))]
            if interrupt is None:
                calls = [w.generate.remote([prompts[i] for i in rows], sampling, worker_seed(seed, k))
                         for k, (w, rows) in enumerate(zip(self.workers, parts, strict=False))]
            else:
                self.calls += 1
                calls = [w.generate.remote([prompts[i] for i in rows], sampling, worker_seed(seed, k), self.calls,
                                           self.board)
                         for k, (w, rows) in enumerate(zip(self.workers, parts, strict=False))]
            try:
                done = ray.get(calls) if interrupt is None else self._until_done(calls, self.calls, interrupt)
                return concat_rollouts(done, self.pad_id)
            except RayActorError as e:
                self._drop_dead(e)

    def _until_done(self, calls: list, call: int, interrupt: Callable[[], bool]) -> list[Rollout]:
        """The results of interruptible generate ``call`` (``calls``: one a worker), asking ``interrupt``
        while any runs; when it says True, or a worker dies (the others' samples are then thrown away),
        every worker is told to stop. A worker's death is raised once every call has ended, so the
        survivors are idle when the batch is sampled again.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        results: dict = {}
        pending, stops, died = list(calls), [], None
        while pending:
            if not stops and (died is not None or interrupt()):
                stops = ([self.board.stop.remote(call)] if self.board is not None
                         else [w.stop.options(concurrency_group=CONTROL).remote(call) for w in self.workers])
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except RayActorError as e:
                    died = died or e
        for s in stops:  # answered (or dead) before the caller moves on
            try:
                ray.get(s, timeout=30)
            except (RayActorError, GetTimeoutError):
                pass
        if died is not None:
            raise died
        return [results[ref] for ref in calls]

    def _drop_dead(self, error: Exception) -> None:
        """Remove the workers that no longer answer and say so."""
        import ray
        from ray.exceptions import RayActorError

        alive = []
        for k, w in enumerate(self.workers):
            try:
                ray.get(w.sync.remote({}, self.version), timeout=30)
                alive.append(w)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                warnings.warn(f"rollout worker {k} died ({type(error).__name__}); sampling goes on with "
                              f"{len(self.workers) - 1} worker(s)", RuntimeWarning, stacklevel=3)
        self.workers = alive

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Put ``weights`` in the object store once; every worker loads them as policy ``version``."""
        import ray
        from ray.exceptions import RayActorError

        ref = ray.put({k: v.detach().cpu() for k, v in weights.items()})
        try:
            ray.get([w.sync.remote(ref, version) for w in self.workers])
        except RayActorError as e:  # the survivors may have loaded them already; loading twice is harmless
            self._drop_dead(e)
            ray.get([w.sync.remote(ref, version) for w in self.workers])
        self.version = int(version)

    def close(self) -> None:
        """Stop the workers (Ray itself keeps running for the process's next run)."""
        import ray

        stop_actors(self.workers, "close", timeout_s=30)
        self.workers = []
        if self.board is not None:
            ray.kill(self.board)
            self.board = None
