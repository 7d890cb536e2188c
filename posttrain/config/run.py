"""Run infrastructure every trainer shares: ``[cluster]`` (placement), ``[eval]``, ``[diagnostics]``,
``[checkpoint]`` and ``[log]``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.base import Section


class ClusterConfig(Section):
    """Where a training run's rollouts are sampled: in this process (``local``), or by
    ``rollout_workers`` Ray actors, each with its own copy of the policy and the run's engine (hf or
    vllm), that split every generation batch by prompts and take the learner's weights through Ray's
    object store at every sync (``posttrain/rollout/ray_engine.py``; ``pip install 'posttrain[ray]'``).
    With ``train.processes > 1`` the learner's FSDP2 ranks are Ray actors too (``learn/distributed/ray_learner.py``).
    """

    backend: Literal["local", "ray"] = Field(
        "local", description="local: this process; ray: rollout worker actors (each with rollout.engine) and, "
        "with train.processes > 1, the learner's ranks as actors"
    )
    address: str = Field("", description="a Ray cluster to join (host:port or 'auto'); empty: start a local Ray")
    rollout_workers: int = Field(2, ge=1, description="engine actors (backend = ray), one CPU each")


class EvalConfig(Section):
    """Held-out evaluation during training (every N steps; ``every=0``: only at the end) and in
    ``posttrain eval``: ``n`` samples per prompt give pass@k and maj@k for each k in ``k``;
    ``n = 1`` with ``temperature = 0`` is greedy pass@1.
    """

    every: int = Field(0, ge=0)
    prompts: int = Field(200, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    k: list[int] = Field([1], description="the k of pass@k and maj@k, each in 1..n")

    @model_validator(mode="after")
    def _k_in_range(self) -> EvalConfig:
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad or not self.k:
            raise ValueError(f"eval.k: every k must be in 1..eval.n={self.n}; got {self.k}")
        return self


class DiagnosticsConfig(Section):
    """Expensive per-step diagnostics (an extra forward pass): effective rank of the final hidden
    states with VERL's ERV / ERA, and the token-level divergence from the starting model. The cheap
    ones (entropy, ratios, clip fractions, Affinity, group statistics) are logged every step.
    """

    every: int = Field(10, ge=0, description="run them every N steps; 0 turns them off")
    samples: int = Field(64, ge=1, description="completions they look at")
    divergence: bool = Field(True, description="JS divergence from the starting model (keeps a frozen copy)")
    top_q: float = Field(0.2, gt=0, le=1, description="fraction of highest-entropy tokens for policy/entropy_top")
    rank_stride: int = Field(
        0, ge=0, description="diag/erv and diag/era: VERL's prefix stride (the effective rank of each response's "
        "first t + 1 hidden states for t = stride, 2 stride, ...); 0 (ours): max(1, length // 16) per response, "
        "about 16 SVDs a response whatever its length; VERL's code takes it as a setting",
    )


class CheckpointConfig(Section):
    """Checkpoints: every N steps (0 = only at the end) and how many to keep."""

    every: int = Field(50, ge=0)
    keep: int = Field(2, ge=1)


class LogConfig(Section):
    """Logging: metrics.jsonl and TensorBoard always (TensorBoard can be turned off), Weights &
    Biases, MLflow and Trackio when chosen (and installed), progress bar, sampled completions, plots.
    """

    tensorboard: bool = True
    progress: bool = True
    samples_every: int = Field(10, ge=1)
    samples: int = Field(4, ge=0)
    plot_groups: bool = Field(True, description="at the end, one PNG per metric group vs step and wall time")
    prompt_stats: bool = Field(
        True,
        description="append each trained prompt's pass rate per step to prompt_stats.jsonl "
        "(for `posttrain rank-prompts`, 1-shot RLVR)",
    )
    record_batches: bool = Field(
        False,
        description="keep each step's produced batch (token ids, masks, rewards, behaviour log-probs, RNG and loop "
        "state) in <run>/batches/step_N.pt, for `posttrain replay RUN --step N`; costs disk every step (about "
        "26 KiB for the tiny recipe; the size per step is printed after the first step) and batches are never pruned",
    )
    wandb: bool = Field(False, description="log to Weights & Biases (pip install posttrain[wandb])")
    wandb_project: str = "posttrain"
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline needs no network")
    mlflow: bool = Field(False, description="log to MLflow (pip install posttrain[mlflow])")
    mlflow_uri: str | None = Field(
        None, description="tracking URI; default a file store in <run>/mlruns (MLFLOW_ALLOW_FILE_STORE is set for it)"
    )
    trackio: bool = Field(
        False,
        description="log to Trackio, local only (pip install posttrain[trackio]); its database is "
        "$TRACKIO_DIR/<project>.db, default ~/.cache/huggingface/trackio; a failure warns once, the run goes on",
    )
    trackio_project: str = Field("posttrain", description="Trackio project (one database, one dashboard)")
