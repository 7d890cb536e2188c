"""PPO's critic: a value model trained beside the policy, for estimators that read ``values`` (GAE)
or ``turn_values`` (Turn-PPO).

The loop builds it only when ``algorithm.advantage`` requires ``values`` (``LearnParts.needs_values``)
and, each step, (1) reads V(s_t) for the sampled responses (no grad; ``Learner.values``, micro-batched
like every forward the learner runs), (2) passes them to the estimator as ``values [P, G, T]``,
(3) regresses V on the GAE returns R_t = A_t + V(s_t) (the un-whitened advantages of
``advantages.gae_advantages_and_returns`` with the estimator's gamma and lam) with the clipped value loss,
over the same epochs and minibatches as the policy. For ``turn_ppo`` the state is the history before a
turn: V(s_k) is read at each turn's first sampled token, the targets are the turn-level GAE returns
(``advantages.turn_gae``), and only those tokens are fit (``Critic.targets``).

Alignment: V(s_t) is the value of the state *before* response token t (prompt + y_<t), read at the
position whose hidden state also gives the policy's logits for y_t: the last prompt token for
t = 0, token t-1 after it. This is verl's ``values[:, -T-1:-1]`` and OpenRLHF's
``values[:, :-1][:, -num_actions:]``.

The value model is ``AutoModelForTokenClassification`` with one output loaded from a causal LM
(the policy's starting checkpoint by default): the backbone's weights are the checkpoint's, the head
starts at zero when the checkpoint has none (V = 0 everywhere at first: deterministic, and the
first step's GAE is the critic-free return), and a reward model's or saved critic's head is kept.
Checkpoints hold it in ``critic/`` (Hugging Face format) and its AdamW state in
``trainer_state.pt``, so a resumed run continues it exactly.

Departures from verl: constant critic lr (no schedule), the critic's loss is always the token mean,
the head starts at zero (verl: Hugging Face's random init).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel
from transformers import logging as hf_logging

from posttrain.algorithms import advantages
from posttrain.algorithms.advantages import _token_rewards, gae_advantages_and_returns, turn_gae, turn_start_targets
from posttrain.algorithms.value import ValueHead, explained_variance
from posttrain.algorithms.value import head as value_head
from posttrain.config import ConfigError, LearnSettings
from posttrain.config.learn import CriticConfig
from posttrain.learn.logprobs import RootForward, build_batch
from posttrain.learn.shard import LOCAL, Shard, grad_norm_of, plan_micro_batches, spread
from posttrain.models.load import ModelLoadError
from posttrain.rollout import Rollout
from posttrain.run.optim import make_optimizer
from posttrain.run.setup import run_dir_model
from posttrain.seeds import derive_seed

CRITIC_DIR = "critic"  # the critic's subdirectory in a checkpoint
POLICY_FROZEN = {"train/nonfinite": 0.0, "train/optimizer_steps": 0.0}  # the update metrics of a warm-up step
_HEADS = ("score", "classifier")  # the value head's attribute in Hugging Face token classifiers
SCALAR = value_head("scalar")  # one output per position, fit by PPO's clipped squared error (critic.head's default)


def load_value_model(path: str, dtype: str = "float32", device: str = "cpu",
                     outputs: int = 1) -> tuple[PreTrainedModel, str]:
    """Load ``path`` as a token-level value model (``outputs`` per position: the value head's, ``critic.head``);
    returns it and a line
    for the log. Head weights the checkpoint lacks start at zero (all of them for a causal LM, the
    bias for a reward model, whose score has none); any other missing weight is an error. The
    run's global RNG is untouched (Hugging Face initialises missing weights randomly before we
    zero them).
    """
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"critic: could not read a model config from {path!r}: {e}") from e
    config.num_labels = outputs
    config.classifier_dropout = 0.0  # HF's default 0.1 head dropout would make V(s_t) noisy in training
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report (lm_head unused, head new) is expected: our line says it
    try:
        with torch.random.fork_rng(devices=[]):
            model, info = AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=getattr(torch, dtype), output_loading_info=True
            )
    except ValueError as e:  # no token-classification class for this architecture
        raise ModelLoadError(
            f"critic: {path!r} ({config.model_type}) has no AutoModelForTokenClassification head in this "
            f"transformers version; set critic.path to a model that has one ({e})"
        ) from e
    except OSError as e:
        raise ModelLoadError(f"critic: could not load {path!r}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    head_name = next((h for h in _HEADS if isinstance(getattr(model, h, None), torch.nn.Linear)), None)
    if head_name is None:
        raise ModelLoadError(f"critic: {type(model).__name__} has no linear value head ({' or '.join(_HEADS)})")
    missing = sorted(info["missing_keys"])
    other = [k for k in missing if not k.startswith(head_name + ".")]
    if other:
        raise ModelLoadError(f"critic: {path!r} lacks weights {other[:5]}: it is not a checkpoint of this model")
    with torch.no_grad():  # zero what the checkpoint lacks (all of a causal LM's head; a bias a RM has none of)
        for name, p in getattr(model, head_name).named_parameters():
            if f"{head_name}.{name}" in missing:
                p.zero_()
    head = "its value head" if not missing else f"value head {missing} new (zeros)"
    return model.to(device), f"critic: {type(model).__name__} from {path} with {head}"


def completion_outputs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
) -> Tensor:
    """The value model's outputs for every completion token, ``[N, T, K]`` (K: the head's outputs; not masked), on
    the device of ``completion_ids_NT`` (the model may sit elsewhere).

    Read at the position that predicts token t (the same positions as the policy's log-probs in
    ``learn/logprobs.py``): prompts are left-padded to a common length L, so state s_t is output
    L - 1 + t of the concatenated sequence.
    """
    if isinstance(model, RootForward):  # an FSDP-sharded critic: the whole computation is the root's forward
        return model(completion_outputs, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id)
    ids, attn, pos = build_batch(prompt_ids, completion_ids_NT, completion_mask_NT, pad_id)
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device), use_cache=False)
    t = completion_ids_NT.shape[1]
    return out.logits[:, -t - 1 : -1].to(completion_ids_NT.device)


def completion_values(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    head: ValueHead = SCALAR,
) -> Tensor:
    """V(s_t) for every completion token, float ``[N, T]`` (not masked): the ``head``'s value of
    :func:`completion_outputs` (the one output itself for the ``scalar`` head).
    """
    return head.value(completion_outputs(model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id))


def _estimator_param(settings: LearnSettings, key: str) -> float:
    """``key`` (gamma, lam) of the configured estimator: its ``advantage_params`` value, else its
    default, else 1.0 (an estimator without it discounts nothing).
    """
    sig = inspect.signature(advantages.REGISTRY.get(settings.algorithm.advantage)).parameters
    default = sig[key].default if key in sig else 1.0
    return float(settings.algorithm.advantage_params.get(key, default))


@dataclass
class Critic:
    """The value model, its optimizer and settings; what the loop calls at steps 4 and 5."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    cfg: CriticConfig
    gamma: float  # the estimator's, so the critic's targets are the returns its advantages imply
    lam: float
    note: str  # one line for the log: what was loaded
    turn_level: bool = False  # turn_ppo: V(s_k) at each turn's first token, fit there on turn-level GAE targets
    head: ValueHead = field(default_factory=lambda: SCALAR)  # critic.head: its outputs, V read off them, its loss

    @classmethod
    def build(cls, settings: LearnSettings, policy_path: str, ckpt: Path | None, device: str = "cpu") -> Critic:
        """A fresh critic from ``critic.path`` (default ``policy_path``), or the one in ``ckpt``."""
        if ckpt is not None:
            path = ckpt / CRITIC_DIR
            if not path.is_dir():
                raise ConfigError(
                    f"--resume: checkpoint {ckpt} holds no {CRITIC_DIR}/ (the run did not train a critic); "
                    f"algorithm.advantage={settings.algorithm.advantage!r} needs one: resume with the run's own "
                    "algorithm"
                )
        else:
            path = run_dir_model(settings.critic.path) if settings.critic.path else policy_path
        head = value_head(settings.critic.head, **settings.critic.head_params)
        model, note = load_value_model(str(path), settings.model.dtype, device, outputs=head.outputs)
        return cls.around(model, settings, note)

    @classmethod
    def around(cls, model: torch.nn.Module, settings: LearnSettings, note: str = "") -> Critic:
        """The critic of ``settings`` over a value model already built (a learner rank's sharded copy)."""
        optimizer = make_optimizer(model, settings.critic.lr, settings.train.betas, 0.0)
        gamma, lam = _estimator_param(settings, "gamma"), _estimator_param(settings, "lam")
        turn_level = "turn_values" in advantages.REGISTRY.required(settings.algorithm.advantage)
        head = value_head(settings.critic.head, **settings.critic.head_params)
        return cls(model, optimizer, settings.critic, gamma, lam, note, turn_level, head)

    def extras(self) -> dict[str, tuple[PreTrainedModel, torch.optim.Optimizer]]:
        """What checkpoints save and restore beside the policy."""
        return {CRITIC_DIR: (self.model, self.optimizer)}

    def warming_up(self, step: int) -> bool:
        """True while the policy waits for the critic (``critic.warmup_steps``; ``step`` = steps done)."""
        return step < self.cfg.warmup_steps

    def returns(
        self, rewards_PG: Tensor, values_PGT: Tensor, mask_PGT: Tensor, token_rewards_PGT: Tensor | None = None
    ) -> Tensor:
        """The critic's targets R_t = A_t + V(s_t) (GAE, un-whitened), ``[P, G, T]``, 0 where masked;
        r_t = the outcome on the last token + ``token_rewards`` (the KL penalty in the reward).
        """
        tok_PGT = _token_rewards(rewards_PG.float(), mask_PGT, token_rewards_PGT)
        _, ret = gae_advantages_and_returns(tok_PGT, values_PGT, mask_PGT, gamma=self.gamma, lam=self.lam)
        return ret * mask_PGT.to(ret.dtype)

    def targets(
        self, rewards_PG: Tensor, values_NT: Tensor, mask_NT: Tensor, inputs: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """What the critic regresses onto and where: (targets ``[N, T]``, fit mask ``[N, T]``).

        Token level (gae): the GAE returns at every response token (:meth:`returns`). Turn level
        (turn_ppo): R_k = A_k + V(s_k) of ``advantages.turn_gae`` on the turn arrays, placed on each
        reached turn's first sampled token, the only tokens fit (the values the estimator reads).
        """
        P, G = rewards_PG.shape
        if not self.turn_level:
            tok_PGT = inputs.get("token_rewards")
            return self.returns(rewards_PG, values_NT.view(P, G, -1), mask_NT.view(P, G, -1), tok_PGT).view(
                P * G, -1), mask_NT
        _, tgt_PGK = turn_gae(inputs["turn_rewards"], inputs["turn_values"], inputs["turn_mask"],
                              gamma=self.gamma, lam=self.lam)
        ret_PGT, fit_PGT = turn_start_targets(tgt_PGK, inputs["turn_ids"], inputs["turn_mask"])
        return ret_PGT.reshape(P * G, -1), fit_PGT.reshape(P * G, -1) * mask_NT.float()

    def update(
        self,
        settings: LearnSettings,
        step: int,
        row_prompts: list[list[int]],
        rollouts: Rollout,
        mask_NT: Tensor,
        values_NT: Tensor,
        rewards_PG: Tensor,
        pad_id: int,
        inputs: dict[str, Tensor],
        shard: Shard = LOCAL,
    ) -> dict[str, float]:
        """Epochs x minibatches of AdamW steps on the clipped value loss; returns ``critic/*`` metrics.

        The minibatches are the policy's (same seed, same permutation) when no batch selector
        picks the policy's rows; with one, the critic still trains on all of this step's rows (the
        only ones it has values for). ``values_NT`` (``Learner.values``, before this update) are
        both the regression's clipping anchor and, through GAE, part of its targets; ``inputs`` are the
        step's advantage inputs (the KL's ``token_rewards``; turn_ppo's turn arrays). Each minibatch is one
        :func:`value_step` in micro-batches of ``train.micro_batch_tokens``, those of ``shard`` on this process.
        """
        returns_NT, mask_NT = self.targets(rewards_PG, values_NT, mask_NT, inputs)
        n_rows = rollouts.token_ids.shape[0]
        off_policy = settings.train.epochs > 1 or settings.train.minibatches > 1
        gen = torch.Generator().manual_seed(derive_seed(settings.seed, "minibatch", step))  # as policy_update's
        sums = {"critic/value_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/grad_norm": 0.0}
        count, nonfinite = 0, 0
        self.model.train()
        for _ in range(settings.train.epochs):
            order = torch.randperm(n_rows, generator=gen) if off_policy else torch.arange(n_rows)
            for idx in order.chunk(settings.train.minibatches):
                mask = mask_NT[idx]
                if mask.sum() == 0:
                    continue
                prompts = [row_prompts[i] for i in idx.tolist()]
                got = value_step(self, prompts, rollouts.token_ids[idx], rollouts.attention_mask[idx], values_NT[idx],
                                 returns_NT[idx], mask, pad_id, budget=settings.train.micro_batch_tokens, shard=shard)
                if got is None:
                    nonfinite += 1
                    continue
                for key, value in zip(sums, got, strict=True):  # loss, clipped fraction, gradient norm
                    sums[key] += value
                count += 1
        out = {k: v / count for k, v in sums.items()} if count else {}
        keep = mask_NT.bool()
        out.update(
            {
                "critic/values_mean": float(values_NT[keep].mean()) if keep.any() else float("nan"),
                "critic/returns_mean": float(returns_NT[keep].mean()) if keep.any() else float("nan"),
                "critic/explained_variance": explained_variance(values_NT, returns_NT, mask_NT),
                "critic/nonfinite": float(nonfinite),
            }
        )
        return out


def value_step(
    critic: Critic, prompts: list[list[int]], ids_NT: Tensor, attn_NT: Tensor, values_NT: Tensor,
    returns_NT: Tensor, mask_NT: Tensor, pad_id: int, *, budget: int = 0, shard: Shard = LOCAL,
) -> tuple[float, float, float] | None:
    """One AdamW step of the critic on one minibatch's clipped value loss (token mean, verl's critic
    default); ``(loss, clipped fraction, gradient norm)`` on every rank, or ``None`` (no step) when the loss or
    the gradient norm is not finite. The rows run in micro-batches of at most ``budget`` tokens, those of
    ``shard`` here (``learn/shard.py``), each run's loss over the whole minibatch's token count.
    """
    width = ids_NT.shape[1]
    runs = spread(plan_micro_batches([len(p) + width for p in prompts], budget), len(prompts), shard.world)
    total = mask_NT.sum()
    critic.optimizer.zero_grad(set_to_none=True)
    done = []
    for _, rows, live in shard.deal(runs):
        out = completion_outputs(critic.model, [prompts[i] for i in rows.tolist()], ids_NT[rows], attn_NT[rows],
                                 pad_id=pad_id)
        dev = out.device  # the critic's; values, returns and masks live on the CPU
        loss_NT, clipped_NT = critic.head.loss(out, values_NT[rows].to(dev), returns_NT[rows].to(dev),
                                               mask_NT[rows].to(dev), cliprange=critic.cfg.cliprange_value)
        loss = critic.cfg.loss_coef * loss_NT.sum() / total.to(dev)
        (loss * shard.scale(live)).backward()
        if live:
            done.append((float(loss.detach()), float(clipped_NT.sum())))
    grad_norm = grad_norm_of(torch.nn.utils.clip_grad_norm_(critic.model.parameters(), critic.cfg.grad_clip))
    gathered = [item for part in shard.gather(done) for item in part]
    loss = sum(x for x, _ in gathered)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        critic.optimizer.zero_grad(set_to_none=True)
        return None
    critic.optimizer.step()
    return loss, sum(c for _, c in gathered) / float(total), grad_norm
