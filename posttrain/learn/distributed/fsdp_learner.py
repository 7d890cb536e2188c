"""The sharded learner (``train.processes = M > 1``): M spawned ranks update the policy (and PPO's critic)
with FSDP2 (``learn/distributed/fsdp.py``) while this process, the driver, runs the rest of the loop
with a full copy of the policy (what the engine samples, what the inputs and diagnostics read) in shared
memory, into which rank 0 writes the new weights after every update.

The driver's optimizer is never stepped: it carries the learning-rate schedule (sent to the ranks
with every batch) and stands for the ranks' optimizer in checkpoints (:class:`RankOptimizer`
gathers and scatters its state in the one-process format, so a checkpoint resumes at any M). A
rank that dies or raises stops the run with the rank's error; the last checkpoint resumes it.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import warnings
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp
from rich.console import Console

from posttrain.config import LearnSettings
from posttrain.errors import ConfigError, RankError
from posttrain.learn.critic import Critic
from posttrain.learn.distributed.fsdp import dumps, loads, rank_main
from posttrain.learn.learner import Learner, Prepared
from posttrain.learn.parts import LearnParts
from posttrain.produce.batch import Batch

if TYPE_CHECKING:
    from posttrain.learn.distributed.ray_learner import RayRankGroup


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_processes(processes: int, device: str) -> None:
    """Refuse more ranks than the machine has GPUs (on cuda) or CPU cores."""
    if device.startswith("cuda"):
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = usable_cores(), "CPU cores"
    if processes > have:
        raise ConfigError(f"train.processes = {processes}: this machine has {have} {what}; "
                          f"use train.processes <= {have}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """The spawned ranks and their queues: every command goes to every rank, rank 0 answers."""

    def __init__(self, world: int, setup: dict, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                 timeout_s: float = 3600.0, critic: torch.nn.Module | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        blob, port = dumps(setup), _free_port()
        # the models travel as shared memory (torch.multiprocessing), the rest as bytes
        self.procs = [ctx.Process(target=rank_main,
                                  args=(r, world, port, blob, model, ref_model, critic, self.inboxes[r],
                                        self.outbox),
                                  daemon=True, name=f"posttrain-rank{r}") for r in range(world)]
        for p in self.procs:
            p.start()
        for _ in range(world):
            self._wait("start")

    def _wait(self, what: str) -> object:
        """The next message from a rank; a dead rank or a rank's exception raises :class:`RankError`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                kind, rank, body = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    self._fail(what, "")
                if time.monotonic() > deadline:
                    self._fail(what, f"the learner ranks gave no answer in {self.timeout_s:.0f} s")
                continue
            if kind == "error":
                self._fail(what, f"learner rank {rank} raised {body.strip().splitlines()[-1]}", body)
            return body

    def _fail(self, what: str, cause: str, details: str = "") -> None:
        """Stop every rank and raise :class:`RankError`: the rank that died (a survivor's error is
        then only its peer's disappearance), else ``cause``; how to resume.
        """
        time.sleep(1.0)  # a rank that lost its peer reports first; let the dead one's exit code land
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive() and p.exitcode != 0]
        self.close()
        if dead:
            cause = f"learner rank {dead[0][0]} exited with code {dead[0][1]}"
        elif details:
            cause = f"{cause}\n{details}"
        raise RankError(f"{cause} during {what}; the run stops here (resume from its last checkpoint with --resume)")

    def call(self, command: str, payload: object = None) -> object:
        """Run ``command`` on every rank; rank 0's result."""
        data = dumps(payload) if payload is not None else None
        for box in self.inboxes:
            box.put((command, data))
        return loads(self._wait(command))

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for box, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                box.put(("stop", None))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


class RankOptimizer:
    """Stands for the ranks' sharded optimizer where the loop checkpoints and restores one:
    ``state_dict`` gathers the full state, ``load_state_dict`` scatters it; ``param_groups`` are the
    driver's (the schedule moves their learning rates).
    """

    def __init__(self, local: torch.optim.Optimizer, ranks: RankGroup | RayRankGroup, prefix: str = "") -> None:
        self.local, self.ranks, self.prefix = local, ranks, prefix  # prefix "critic_": the critic's optimizer

    @property
    def param_groups(self) -> list[dict]:
        """The driver's parameter groups (their learning rates are sent with every batch)."""
        return self.local.param_groups

    def state_dict(self) -> dict:
        """The ranks' optimizer state, gathered in the one-process format, with the driver's parameter
        groups: the schedule's learning rate for the next step (a rank's groups hold the last step's).
        """
        return {"state": self.ranks.call(f"{self.prefix}optimizer_state")["state"],
                "param_groups": self.local.state_dict()["param_groups"]}

    def load_state_dict(self, sd: dict) -> None:
        """Scatter a one-process optimizer state to the ranks' shards."""
        self.ranks.call(f"{self.prefix}load_optimizer_state", sd)
        self.local.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})


class ShardedLearner(Learner):
    """A :class:`~posttrain.learn.learner.Learner` whose update and other forward passes (entropies, prompt and
    reference log-probs, values) run on ``train.processes`` FSDP2 ranks, each rank taking its share of the
    micro-batches of the one-process learner's plan.
    """

    @classmethod
    def start(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        parts: LearnParts,
        settings: LearnSettings,
        pad_id: int,
        ref_model: torch.nn.Module | None,
        critic: Critic | None,
        console: Console,
    ) -> ShardedLearner:
        """Spawn the ranks with copies of the policy (and reference) and wait until each has sharded them."""
        world, device = settings.train.processes, str(next(model.parameters()).device)
        cluster = settings.cluster
        if cluster.backend != "ray" or not cluster.address:  # a cluster's placement group checks for itself
            check_processes(world, device)
        lora = settings.model.lora.enabled
        t0 = time.perf_counter()
        # with LoRA the reference is the policy with its adapter off: each rank makes it from its own shard (the
        # driver's stays the loop's starting model, which it holds anyway; every forward pass runs on the ranks)
        driver_ref = ref_model
        setup = {"settings": settings, "pad_id": pad_id, "device": device, "lora_ref": lora and ref_model is not None,
                 "threads": max(1, torch.get_num_threads() // world), "deterministic": settings.train.deterministic}
        if lora:
            ref_model = None
        if settings.cluster.backend == "ray":  # actors in a placement group, on any node of the cluster
            from posttrain.learn.distributed.ray_learner import RayRankGroup

            ranks = RayRankGroup(world, setup, model, ref_model, settings.cluster.address,
                                 reserve_cpus=settings.cluster.rollout_workers + world,
                                 critic=critic.model if critic is not None else None)
            where = f"Ray actors on {ranks.address}"
        else:
            model.share_memory()  # rank 0 writes every update's weights into it (CUDA tensors are shared as they are)
            if critic is not None:
                critic.model.share_memory()  # and every critic update's
            ranks = RankGroup(world, setup, model, ref_model, critic=critic.model if critic is not None else None)
            where = "spawned processes"
        console.print(f"learner: {world} FSDP2 ranks ({'nccl' if device.startswith('cuda') else 'gloo'}, {where}) "
                      f"started in {time.perf_counter() - t0:.1f} s")
        learner = cls(model, RankOptimizer(optimizer, ranks), scheduler, parts, settings, pad_id, driver_ref, critic)
        learner.ranks = ranks
        if critic is not None:  # checkpoints gather (and resumes scatter) the ranks' critic optimizer
            learner.critic_optimizer = RankOptimizer(critic.optimizer, ranks, prefix="critic_")
        return learner

    def extras(self) -> dict:
        """The critic with the ranks' optimizer (checkpointed in the one-process format)."""
        if self.critic is None:
            return {}
        return {name: (model, self.critic_optimizer) for name, (model, _) in self.critic.extras().items()}

    def forward(self, name: str, **inputs: object) -> object:
        """Forward pass ``name`` on the ranks' sharded models (``Rank.forward``)."""
        return self.ranks.call("forward", {"name": name, **inputs})

    def critic_step(self, prepared: Prepared, batch: Batch, step: int) -> dict[str, float]:
        """The ranks' critic update; rank 0 has written the new value weights into the driver's critic."""
        job = {"row_prompts": prepared.row_prompts, "rollouts": batch.rollouts, "mask_NT": prepared.mask_NT,
               "values_NT": self.critic_values(prepared), "rewards_PG": batch.rewards_PG, "inputs": prepared.inputs,
               "step": step}
        return self.ranks.call("critic_update", job)

    def learn(self, prepared: Prepared, batch: Batch, step: int, entropy_state: object | None) -> dict[str, float]:
        """The ranks' critic update, then their policy update."""
        with warnings.catch_warnings():  # the driver's optimizer never steps: the ranks' did
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            return super().learn(prepared, batch, step, entropy_state)

    def policy_step(self, prepared: Prepared, step: int, entropy_state: object | None) -> dict[str, float]:
        """The ranks' update of the chosen rows; rank 0 has written the new weights into the driver's policy."""
        c = prepared.chosen
        job = {"row_prompts": c.row_prompts, "rollouts": c.rollouts, "mask_NT": c.mask_NT, "adv_N": c.adv_N,
               "row_inputs": c.row_inputs, "step": step, "entropy_state": entropy_state,
               "minibatches": c.minibatches, "lrs": [float(g["lr"]) for g in self.optimizer.param_groups]}
        return self.ranks.call("update", job)

    def close(self) -> None:
        """Stop the ranks."""
        self.ranks.close()
