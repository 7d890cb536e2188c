"""Learner ranks as Ray actors (``train.processes = M > 1`` with ``cluster.backend = "ray"``).

The same FSDP2 ranks as the spawned ones (``learn/distributed/fsdp.py``'s
:class:`~posttrain.learn.distributed.fsdp.Rank`), placed by Ray: one placement group of M bundles (one
CPU each, or one GPU and one CPU on CUDA), packed onto as few nodes as hold them, so ranks can live on
other machines than the driver. Rank 0's actor names the rendezvous (its node's address and a free port
there); every rank joins the process group (gloo on the CPU, NCCL on GPUs) and builds its policy from
the model's config and the weights the driver put once in Ray's object store; with ``model.lora`` the
adapters are injected first (the
run's ``[model.lora]`` travels in the config), so the policy, its frozen base and the KL reference
(each rank's root with the adapter off) are the spawned ranks'. There is no shared memory across
machines: after each update rank 0 returns the weights the update trained (with LoRA the adapter's
alone) with the metrics, and the driver loads them into its policy (the copy its engine samples from).

A rank that dies, raises or does not answer within the timeout stops the run with the rank's
error and how to resume (the last checkpoint resumes at any M, on either backend); a cluster that
cannot place the M bundles is refused before anything starts.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from posttrain.errors import ConfigError, RankError

if TYPE_CHECKING:
    from posttrain.config.model import LoraSettings

PLACEMENT_TIMEOUT_S = 60.0


def build_model(config: object, state: dict[str, torch.Tensor], device: str, auto: type | None = None,
                lora: LoraSettings | None = None) -> torch.nn.Module:
    """A model of ``config`` (an ``auto`` class's: a causal LM by default) with ``state`` loaded, on
    ``device``; with ``lora`` (the run's ``[model.lora]``) the adapters injected first, as
    :func:`~posttrain.models.lora.apply_lora` did to the driver's policy, so its base and adapter tensors
    load under their own names.

    Raises:
        ValueError: ``state`` holds tensors the model has not (an adapter's, into a plain model).

    """
    from transformers import AutoModelForCausalLM

    from posttrain.models.attention import use_attention

    model = use_attention((auto or AutoModelForCausalLM).from_config(config).to(next(iter(state.values())).dtype))
    if lora is not None:
        from posttrain.models.lora import apply_lora

        apply_lora(model, lora)  # in place: the base frozen, the adapters trainable
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys  # missing: tied weights come once
    if unexpected:
        raise ValueError(f"{type(model).__name__} has no tensors {unexpected[:3]} of the driver's policy")
    return model.to(device)


class RankActor:
    """One learner rank's process (wrapped as a Ray actor)."""

    def node_address(self) -> tuple[str, int]:
        """The address of the node and a free port on it: the process group's rendezvous (rank 0's)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, rank: int, world: int, address: str, port: int, setup: dict, config: object,
              weights: dict, ref_weights: dict | None, critic_config: object | None = None,
              critic_weights: dict | None = None) -> int:
        """Join the group, build the policy (and reference; PPO's critic from its own config and weights)
        from ``config`` and ``weights``, shard them.
        """
        from transformers import AutoModelForTokenClassification

        from posttrain.learn.distributed.fsdp import Rank
        from posttrain.learn.shard import Shard

        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
        torch.set_num_threads(setup["threads"])
        if setup["deterministic"]:
            torch.use_deterministic_algorithms(True, warn_only=True)
        cuda = setup["device"].startswith("cuda")
        if cuda:  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        self.rank = rank
        device, lora = "cuda" if cuda else "cpu", setup["settings"].model.lora
        policy = build_model(config, weights, device, lora=lora if lora.enabled else None)
        ref = build_model(config, ref_weights, device) if ref_weights else None
        value = (build_model(critic_config, critic_weights, device, AutoModelForTokenClassification)
                 if critic_weights else None)
        self.worker = Rank(Shard(rank, world), dict(setup, local_device=f"{device}:0" if cuda else device), policy,
                           ref, value)
        return os.getpid()

    def serve(self, command: str, payload: object) -> object:
        """Run ``command`` (a collective on every rank); rank 0's result, with the new weights after an
        update (the policy's that train: with LoRA the adapter's alone; the critic's all).
        """
        result = self.worker.serve(command, payload)
        if self.rank != 0:
            return None
        if command == "update":  # write_weights updated these alone
            written = {k: self.worker.driver_weights[k] for k in self.worker.trained}
        elif command == "critic_update":
            written = self.worker.driver_critic
        else:
            return result
        return {"metrics": result, "weights": {k: v.detach().cpu() for k, v in written.items()}}

    def stop(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


class RayRankGroup:
    """M :class:`RankActor` in one placement group; the interface of the spawned ``RankGroup``."""

    def __init__(self, world: int, setup: dict, model: torch.nn.Module, ref_model: torch.nn.Module | None,
                 address: str, reserve_cpus: int, timeout_s: float = 3600.0,
                 critic: torch.nn.Module | None = None) -> None:
        from posttrain.rollout.ray_engine import start_ray

        start_ray(address, cpus=reserve_cpus)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.model, self.critic, self.world, self.timeout_s = model, critic, world, timeout_s
        cuda = setup["device"].startswith("cuda")
        bundle = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
        self.pg = placement_group([bundle] * world, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise ConfigError(
                f"train.processes = {world}: the Ray cluster cannot place {world} learner ranks of {bundle} "
                f"(it has {ray.cluster_resources()}); lower train.processes or add nodes"
            ) from None
        actor = ray.remote(RankActor)
        self.actors = [
            actor.options(num_cpus=1, num_gpus=1 if cuda else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=r)).remote()
            for r in range(world)
        ]
        self.address, port = ray.get(self.actors[0].node_address.remote())
        weights = ray.put({k: v.detach().cpu() for k, v in model.state_dict().items()})
        ref = ray.put({k: v.detach().cpu() for k, v in ref_model.state_dict().items()}) if ref_model else None
        value = ray.put({k: v.detach().cpu() for k, v in critic.state_dict().items()}) if critic is not None else None
        value_config = critic.config if critic is not None else None
        self.pids = self._get([a.start.remote(r, world, self.address, port, setup, model.config, weights, ref,
                                              value_config, value) for r, a in enumerate(self.actors)], "start")

    def _get(self, calls: list, what: str) -> list:
        """Every rank's answer; a dead rank, a rank's exception or the timeout raises :class:`RankError`."""
        import ray

        try:
            return ray.get(calls, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            cause = f"the learner ranks gave no answer in {self.timeout_s:.0f} s"
        except ray.exceptions.RayActorError as e:
            cause = f"a learner rank's actor died ({type(e).__name__})"
        except ray.exceptions.RayTaskError as e:
            cause = f"a learner rank raised {str(e).strip().splitlines()[-1]}"
        self.close()
        raise RankError(f"{cause} during {what}; the run stops here (resume from its last checkpoint with --resume)")

    def call(self, command: str, payload: object = None) -> object:
        """Run ``command`` on every rank; rank 0's result (after an update: its metrics, the weights loaded)."""
        result = self._get([a.serve.remote(command, payload) for a in self.actors], command)[0]
        if command in ("update", "critic_update"):
            with torch.no_grad():
                (self.model if command == "update" else self.critic).load_state_dict(result["weights"], strict=False)
            return result["metrics"]
        return result

    def close(self) -> None:
        """Stop the actors and free their placement group (Ray keeps running for the process's next run)."""
        import ray

        from posttrain.rollout.ray_engine import stop_actors

        stop_actors(getattr(self, "actors", []), "stop", timeout_s=10)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
