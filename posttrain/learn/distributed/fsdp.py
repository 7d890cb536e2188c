"""A learner rank: one of ``train.processes`` processes that hold the policy sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``; gloo on the CPU, NCCL on GPUs) and update it together.

The rank's policy is ``RootForward(model)`` with every decoder layer sharded on its own (one
all-gather per layer in each pass) and the wrapper as the root (embeddings, final norm and output
head, tied or not). Its optimizer is the one-process optimizer (``run/optim.py``) over the
sharded parameters, so each rank keeps the Adam moments of its shard only.

The driver (``learn/distributed/fsdp_learner.py``) hands every rank its policy in shared memory: the rank
shards a copy, and after every update rank 0 writes the full weights back into that shared memory,
in place, which *is* the driver's policy (no transfer through a pipe: 538 MB of SmolLM2-135M took
2.3 s that way). Commands and answers cross as ``torch.save`` bytes over queues; rank 0 answers
(the update's metrics, the optimizer's full state for a checkpoint in the one-process format: a
checkpoint resumes at any number of processes).
"""

from __future__ import annotations

import copy
import io
import os
import traceback

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.learn.critic import Critic
from posttrain.learn.forwards import FORWARDS
from posttrain.learn.logprobs import RootForward
from posttrain.learn.parts import LearnParts
from posttrain.learn.shard import Shard
from posttrain.learn.update import policy_update
from posttrain.models.checkpointing import enable_checkpointing
from posttrain.models.precision import autocast_dtype, compute
from posttrain.run.optim import make_optimizer


def dumps(obj: object) -> bytes:
    """``obj`` as ``torch.save`` bytes (what crosses a process boundary here: no shared-memory handles
    that die with their sender).
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes) -> object:
    """The object that :func:`dumps` wrote (trusted: written by this run's own processes)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the largest ``ModuleList`` (``model.model.layers`` in a
    Hugging Face causal LM).
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no ModuleList of decoder layers to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shard_policy(model: torch.nn.Module, mesh: object) -> RootForward:
    """``model`` sharded over ``mesh``: each decoder layer, then the :class:`RootForward` root."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(RootForward(model), mesh=mesh)


def full_tensor(t: object) -> object:
    """A DTensor's full value (a collective), anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def write_weights(root: RootForward, into: dict[str, Tensor] | None, names: set[str] | None = None) -> None:
    """Gather every weight of the sharded policy (those in ``names``, by the model's own names, when
    given) and copy it into ``into`` (the driver's shared tensors) where given. A collective: every
    rank calls it with the same ``names``.
    """
    for k, v in root.state_dict().items():
        name = k.removeprefix("module.")
        if names is not None and name not in names:
            continue
        full = full_tensor(v)
        if into is not None:
            into[name].copy_(full)


class AdapterOffRoot(RootForward):
    """The reference of a sharded LoRA policy: the policy's own FSDP root run with its adapter switched
    off inside the root's forward (as :class:`~posttrain.models.lora.AdapterDisabled` in one process; no
    second copy).
    """

    def __init__(self, root: RootForward) -> None:
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "root", root)  # not a submodule: its parameters are the policy's

    def forward(self, fn: object, *args: object, **kwargs: object) -> object:
        """``fn(model, ...)`` with the adapter off, as the policy root's forward (its all-gathers included)."""
        return self.root(_adapter_off, fn, *args, **kwargs)

    def parameters(self, recurse: bool = True) -> object:
        """The policy's parameters (their device)."""
        return self.root.parameters(recurse)


def _adapter_off(model: torch.nn.Module, fn: object, *args: object, **kwargs: object) -> object:
    """``fn(model, ...)`` with every LoRA layer of ``model`` switched off (peft's ``disable_adapter``,
    on the model peft injected its layers into), in eval mode and without gradient; then as before.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    was_training = model.training
    model.eval()
    for m in layers:
        m.enable_adapters(False)
    try:
        with torch.no_grad():
            return fn(model, *args, **kwargs)
    finally:
        for m in layers:
            m.enable_adapters(True)
        model.train(was_training)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict with every sharded tensor gathered (a collective): the format of a
    one-process optimizer over the same parameters.
    """
    sd = optimizer.state_dict()
    state = {i: {k: full_tensor(v).cpu() if isinstance(v, Tensor) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Load a one-process optimizer state dict: each full tensor is cut to this rank's shard of its parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and isinstance(v, Tensor) and v.shape == p.shape else v
                    for k, v in s.items()}
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def copy_to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` that shares no storage with it (sharding then leaves the
    driver's tensors alone).
    """
    return copy.deepcopy(model).to(device)


class Rank:
    """The sharded policy, reference and optimizer of one rank (and PPO's critic, with its own
    optimizer, sharded alike), and the commands it serves.
    """

    def __init__(self, shard: Shard, setup: dict, model: torch.nn.Module, ref: torch.nn.Module | None,
                 critic: torch.nn.Module | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from posttrain.plugins import import_plugins

        self.shard, self.settings, self.pad_id = shard, setup["settings"], setup["pad_id"]
        import_plugins(self.settings.plugins)  # a spawned rank or a Ray actor looks the user's loss up by name too
        kind = "cuda" if setup["device"].startswith("cuda") else "cpu"
        mesh = init_device_mesh(kind, (shard.world,))
        # a spawned rank r uses GPU r; a Ray actor sees only its own GPU (setup["local_device"])
        device = torch.device(setup.get("local_device") or (f"cuda:{shard.rank}" if kind == "cuda" else "cpu"))
        # the driver's tensors (shared memory): rank 0 writes each update's weights back into them
        self.driver_weights = dict(model.state_dict()) if shard.rank == 0 else None
        self.device, self.autocast = device, autocast_dtype(self.settings.model.autocast)  # bf16 matmuls
        policy = copy_to(model, device)
        if self.settings.train.gradient_checkpointing:  # on the rank's own copy (learn/build.py leaves the driver's)
            enable_checkpointing(policy)
        self.root = shard_policy(policy, mesh)
        self.ref = shard_policy(copy_to(ref, device), mesh) if ref is not None else None
        if setup.get("lora_ref"):  # a LoRA policy's reference: its own root with the adapter off
            self.ref = AdapterOffRoot(self.root)
        # what an update changes (with LoRA the adapter alone): what rank 0 writes back to the driver
        self.trained = {k for k, p in model.named_parameters() if p.requires_grad}
        self.parts = LearnParts.from_config(self.settings.algorithm, self.settings.max_new_tokens)
        t = self.settings.train
        self.optimizer = make_optimizer(self.root, t.lr, t.betas, t.weight_decay, t.optimizer)
        self.critic, self.driver_critic = None, None
        if critic is not None:  # rank 0 writes each critic update back into the driver's critic, as the policy
            self.driver_critic = dict(critic.state_dict()) if shard.rank == 0 else None
            self.critic = Critic.around(shard_policy(copy_to(critic, device), mesh), self.settings)

    def update(self, job: dict) -> dict:
        """One rollout batch's update; its metrics (on every rank), the driver's policy updated in place."""
        for group, lr in zip(self.optimizer.param_groups, job["lrs"], strict=True):
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep it a tensor, updated in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        with compute(self.device, self.autocast):
            metrics = policy_update(
                self.root, self.ref, self.optimizer, self.parts, self.settings, job["row_prompts"], job["rollouts"],
                job["mask_NT"], job["adv_N"], job["row_inputs"], self.pad_id, job["step"],
                entropy_state=job["entropy_state"], minibatches=job["minibatches"],
                shard=self.shard,
            )
        write_weights(self.root, self.driver_weights, self.trained)
        return metrics

    def critic_update(self, job: dict) -> dict:
        """The critic's update on one rollout batch (:meth:`Critic.update` with the minibatch steps
        dealt to the ranks); its metrics, the driver's critic updated in place.
        """
        metrics = self.critic.update(self.settings, job["step"], job["row_prompts"], job["rollouts"], job["mask_NT"],
                                     job["values_NT"], job["rewards_PG"], self.pad_id, job["inputs"], shard=self.shard)
        write_weights(self.critic.model, self.driver_critic)
        return metrics

    def forward(self, job: dict) -> object:
        """A forward pass without gradient of :data:`~posttrain.learn.forwards.FORWARDS` (the Learner's: entropies,
        reference log-probs, values, prompt log-probs) over the sharded models, this rank's share of the
        micro-batches; the whole result on every rank.
        """
        fn, role = FORWARDS[job.pop("name")]
        model = {"policy": self.root, "reference": self.ref,
                 "critic": self.critic.model.eval() if self.critic is not None else None}[role]
        if model is None:
            raise ValueError(f"the ranks hold no {role} model")
        return fn(model, **job, pad_id=self.pad_id, temperature=self.settings.temperature,
                  budget=self.settings.train.micro_batch_tokens, shard=self.shard, packing=self.settings.train.packing)

    def serve(self, command: str, payload: object) -> object:
        """Run ``command`` (every rank runs each one: most are collectives)."""
        if command == "update":
            return self.update(payload)
        if command == "forward":
            return self.forward(payload)
        if command == "critic_update":
            return self.critic_update(payload)
        optimizer = self.critic.optimizer if command.startswith("critic_") else self.optimizer
        if command.removeprefix("critic_") == "optimizer_state":
            return full_optimizer_state(optimizer)
        if command.removeprefix("critic_") == "load_optimizer_state":
            load_full_optimizer_state(optimizer, payload)
            return None
        raise ValueError(f"unknown learner command {command!r}")


def rank_main(rank: int, world: int, port: int, setup_bytes: bytes, model: torch.nn.Module,
              ref_model: torch.nn.Module | None, critic: torch.nn.Module | None, inbox: object,
              outbox: object) -> None:
    """A spawned rank's process: join the group, shard, then serve the driver's commands until ``stop``.
    Rank 0 answers each command with its result; every rank reports an exception (then exits).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        setup = loads(setup_bytes)
        torch.set_num_threads(setup["threads"])
        if setup["deterministic"]:
            torch.use_deterministic_algorithms(True, warn_only=True)
        cuda = setup["device"].startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        worker = Rank(Shard(rank, world), setup, model, ref_model, critic)
        outbox.put(("ready", rank, None))
        while True:
            command, payload = inbox.get()
            if command == "stop":
                break
            result = worker.serve(command, loads(payload) if payload is not None else None)
            if rank == 0:
                outbox.put(("done", rank, dumps(result)))
    except BaseException:  # noqa: BLE001 (the driver shows it; the other ranks are stopped by the driver)
        outbox.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
