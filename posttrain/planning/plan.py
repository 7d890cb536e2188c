"""``posttrain plan``: the memory a GRPO run's parts will take, from the model's config alone.

For the policy (and PPO's critic, and the KL reference when it is a second copy) on
``model.device``: weights (``model.dtype``), gradients and AdamW's two moments of what trains
(everything, or the LoRA adapters), the activations one micro-batch saves for its backward, and the
rollout engine's KV cache for a step's generation. The activations are

    tokens x layers x (16 x hidden + 3 x intermediate) x bytes per element

a fit to three measurements of SmolLM2-135M (hidden 576, intermediate 1536): 13,530 elements per
token and layer saved in fp32 on the CPU (7.3 GB over 4,496 positions), about 14,200 in bf16 and
13,000 in fp32 on an H200 (peak allocations over 68,736 positions, weights and optimizer taken
off); the formula gives 13,824. A micro-batch's tokens are ``train.micro_batch_tokens`` (an upper
bound), or, when that is 0, a whole minibatch's positions: each distinct prompt once at the
longest prompt's length (a group shares its prefix) plus every completion's ``max_new_tokens``. With
``train.gradient_checkpointing`` a layer saves only its input (``hidden`` elements a token) and one layer's
activations live at a time while the backward recomputes it, ``tokens x (layers x hidden + 16 x hidden + 3 x
intermediate)``, and every row runs its own prompt (a checkpointed layer keeps no cache). With ``train.packing``
a micro-batch holds real tokens only (no padding to the longest row), and every row runs its own prompt (a
pack shares none): the plan, a bound reached when every completion runs to ``max_new_tokens``, counts the
same completion tokens, the typical update fewer (``docs/memory.md``). The output head
adds at most one chunk of logits (``chunked.py``: at most 1 GiB). The engine keeps each prompt's K/V once
for its group and every completion's own.

:func:`check` refuses a run whose total exceeds the device's memory (a GPU's total, the machine's
RAM), naming the setting that would cut the largest part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from posttrain.config import Config, ConfigError
from posttrain.learn.parts import LearnParts
from posttrain.run.setup import build_task, longest_prompt, run_dir_model

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEAD_CHUNK_BYTES = 1 << 30  # the fused head keeps at most this much of a chunk's probabilities
GiB = float(1 << 30)


@dataclass(frozen=True)
class Arch:
    """A decoder's sizes, from its Hugging Face config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: object) -> Arch:
        """Read a ``PretrainedConfig`` (LLaMA-style names)."""
        h, heads = config.hidden_size, config.num_attention_heads
        return cls(
            hidden=h,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or h // heads,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def body(self) -> int:
        """Non-embedding parameters: attention, MLP and norms of every layer, and the final norm."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (2 * h * q + 2 * h * kv + 3 * h * self.intermediate + 2 * h) + h

    @property
    def head(self) -> int:
        """The output head's (and the embedding's) parameters, vocab x hidden."""
        return self.hidden * self.vocab

    @property
    def params(self) -> int:
        """Parameters as stored: embedding, body, and the head unless it is the embedding."""
        return self.body + self.head * (1 if self.tied else 2)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters of rank ``rank`` on the named projections of every layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)


@dataclass(frozen=True)
class Part:
    """One line of the plan."""

    name: str
    bytes: float
    note: str


def estimate(cfg: Config, arch: Arch, prompt_tokens: int) -> list[Part]:
    """The parts of a GRPO run of ``cfg`` on ``arch`` with prompts of up to ``prompt_tokens`` tokens."""
    b = BYTES[cfg.model.dtype]
    r, lora = cfg.rollout, cfg.model.lora
    p = arch.params
    trainable = arch.lora_params(lora.rank, list(lora.target_modules)) if lora.enabled else p
    rows = r.prompts_per_step * r.group_size
    rows_mb = -(-rows // cfg.train.minibatches)
    ckpt, packed = cfg.train.gradient_checkpointing, cfg.train.packing
    # a minibatch's positions: each distinct prompt once (its group shares the prefix), every completion; each row
    # runs its own prompt when checkpointed layers keep no cache or a pack shares none
    prompts = rows_mb if ckpt or packed else min(rows_mb, r.prompts_per_step)
    per_minibatch = prompts * prompt_tokens + rows_mb * completion_tokens(cfg)
    tokens = min(cfg.train.micro_batch_tokens, per_minibatch) if cfg.train.micro_batch_tokens else per_minibatch
    layer = 16 * arch.hidden + 3 * arch.intermediate  # elements a layer saves per token (module docstring)
    # checkpointed: each layer's input, and one layer's own activations while the backward recomputes it
    act = tokens * (arch.layers * arch.hidden + layer if ckpt else arch.layers * layer) * b
    m = cfg.train.processes  # ranks on this host, each running a micro-batch of its own at a time
    act_ranks = m if m > 1 and cfg.train.micro_batch_tokens else 1
    head = min(tokens * arch.vocab * 4, HEAD_CHUNK_BYTES)
    kv = 2 * arch.layers * arch.kv_heads * arch.head_dim * b * (r.prompts_per_step * prompt_tokens
                                                                + rows * completion_tokens(cfg))
    what = "LoRA adapters" if lora.enabled else "all parameters"
    parts = [
        Part("policy weights", p * b, f"{p / 1e6:.1f}M parameters in {cfg.model.dtype}"),
        Part("gradients", trainable * b, f"{trainable / 1e6:.2f}M trainable ({what})"),
        Part("AdamW moments", 2 * trainable * b, "two per trainable parameter"),
        Part("activations", act * act_ranks, f"{tokens:,} tokens a micro-batch"
             + ("" if cfg.train.micro_batch_tokens else " (train.micro_batch_tokens = 0: a whole minibatch)")
             + (", layers checkpointed (their inputs, one layer's activations)" if ckpt else "")
             + (", packed: real tokens, at most these (every completion at max_new_tokens)" if packed else "")
             + (f", one on each of {m} ranks" if act_ranks > 1 else "")),
        Part("output head chunk", head, "logits of one chunk, at most 1 GiB"),
        Part("engine KV cache", kv, f"{rows} completions of {completion_tokens(cfg)} tokens, prompts once"),
    ]
    learn = LearnParts.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    ref_copy = learn.needs_reference and not lora.enabled  # with LoRA: the adapter switched off
    if ref_copy:
        parts.append(Part("reference model", p * b, "a frozen copy (the KL term, a loss reading it, or its samples)"))
    if cfg.model.autocast != "off":  # models/precision.py: autocast's bf16 copy of each weight, held for a pass
        parts.append(Part("autocast weight copies", p * 2, f"a {cfg.model.autocast} copy of the weights during a "
                          "forward and backward pass or a generate call (model.autocast)"))
    from posttrain.models.parameterization import needs_reference

    if needs_reference(cfg.algorithm.parameterization):  # e.g. ref_logit_mix: the frozen model mixed into the logits
        parts.append(Part("parameterization's reference", p * b,
                          f"a frozen copy in the policy (algorithm.parameterization = "
                          f"{cfg.algorithm.parameterization!r}); its K/V double the engine's"))
        parts[5] = Part("engine KV cache", 2 * kv, f"{rows} completions of {completion_tokens(cfg)} tokens, prompts "
                        "once, both trunks")
    if r.max_staleness > 0:  # produce/pipeline.py: the producer's own model, and the learner's published weights
        plain = r.engine == "vllm" or cfg.cluster.backend == "ray"  # engines over plain models: a LoRA policy merged
        snapshot = p if plain else trainable
        parts.append(Part("async producer", p * b + (r.max_staleness + 2) * snapshot * b,
                          f"a copy of the policy and up to {r.max_staleness + 2} weight snapshots "
                          f"({'merged, ' if plain and lora.enabled else ''}rollout.max_staleness = {r.max_staleness})"))
    if m > 1:  # learn/distributed/fsdp_learner.py: the ranks' shards add up to a second copy beside the driver's
        copies = 2 if ref_copy else 1
        parts.append(Part("learner ranks' weight shards", copies * p * b,
                          f"{m} FSDP2 ranks hold 1/{m} of the policy{' and reference' if copies == 2 else ''} each "
                          "(gradients and AdamW moments above are split among them)"))
    if cfg.algorithm.advantage == "gae":  # with M > 1 ranks: the driver's copy plus the ranks' shards of it
        parts.append(Part("critic (weights, gradients, AdamW, activations)", (4 + (m > 1)) * p * b + act,
                          "PPO's value model, the policy's size" + (f", sharded on the {m} ranks" if m > 1 else "")))
    return parts


def check_run(cfg: Config, model: torch.nn.Module, prompt_tokens: int) -> None:
    """:func:`check` for a run about to start, with prompts of up to ``prompt_tokens`` tokens (a
    LLaMA-style ``model``; other architectures are not estimated).
    """
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if not all(hasattr(model.config, k) for k in needed):
        return
    check(estimate(cfg, Arch.of(model.config), prompt_tokens), next(model.parameters()).device)


def capacity(device: torch.device) -> tuple[float, str]:
    """Total memory of ``device`` in bytes, and what it is."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name} memory"
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"


def advice(largest: Part) -> str:
    """The setting that cuts ``largest``."""
    return {
        "activations": "set train.gradient_checkpointing = true (layers recompute in the backward) or "
        "train.micro_batch_tokens (tokens per forward/backward; the gradients are the same either way)",
        "engine KV cache": "lower rollout.prompts_per_step or rollout.max_new_tokens",
        "async producer": "lower rollout.max_staleness, or use LoRA (the snapshots are then the adapter only)",
        "learner ranks' weight shards": "train.processes = 1 on one machine (the driver keeps a full copy)",
        "reference model": "use LoRA (model.lora.rank > 0: the reference is the base, no copy) or kl_coef = 0",
    }.get(largest.name, "use LoRA (model.lora.rank > 0), a 16-bit model.dtype, or a smaller model")


def check(parts: list[Part], device: torch.device) -> None:
    """Raise :class:`ConfigError` when the parts add up to more than ``device`` holds."""
    total = sum(x.bytes for x in parts)
    have, what = capacity(device)
    if total > have:
        largest = max(parts, key=lambda x: x.bytes)
        raise ConfigError(
            f"this run needs about {total / GiB:.1f} GiB on {device.type} but {what} is {have / GiB:.1f} GiB; "
            f"the largest part is the {largest.name} ({largest.bytes / GiB:.1f} GiB): {advice(largest)} "
            "(`posttrain plan RECIPE` prints every part)"
        )


def completion_tokens(cfg: Config) -> int:
    """The longest completion row: ``rollout.max_new_tokens``, or a multi-turn episode's whole budget
    after its prompt (``task.env.max_tokens``: every turn and reply).
    """
    return cfg.task.env.max_tokens if cfg.task.env is not None else cfg.rollout.max_new_tokens


def model_arch(cfg: Config, task: object) -> tuple[Arch, object]:
    """The policy's architecture and tokenizer, without loading its weights."""
    from transformers import AutoConfig

    from posttrain.models import load_tokenizer
    from posttrain.models.load import resolve_source
    from posttrain.models.tiny import build_char_tokenizer

    if cfg.model.path == "tiny":
        t, tok = cfg.model.tiny, build_char_tokenizer(task.alphabet)
        return Arch(t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads, t.num_heads,
                    t.hidden_size // t.num_heads, len(tok), True), tok
    path = run_dir_model(cfg.model.path)
    src = resolve_source(path)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return Arch.of(AutoConfig.from_pretrained(src.location, **kw)), load_tokenizer(path)


def run_plan(cfg: Config, console: object, as_json: bool = False) -> None:
    """``posttrain plan``: print every part, the total against the device, and whether it fits (``as_json``: one
    JSON object, ``{"device", "parts": [{"name", "bytes", "gib", "what"}], "total_gib", "capacity_gib", "fits",
    "advice"}``, and no error when it does not fit).
    """
    from rich.table import Table

    from posttrain.models import resolve_device

    device = resolve_device(cfg.model)
    task = build_task(cfg)
    arch, tokenizer = model_arch(cfg, task)
    prompt = longest_prompt(cfg, task, tokenizer)
    parts = estimate(cfg, arch, prompt)
    total = sum(x.bytes for x in parts)
    have, what = capacity(device)
    if as_json:
        import json

        largest = max(parts, key=lambda x: x.bytes)
        print(json.dumps({"device": device.type, "longest_prompt": prompt,
                          "parts": [{"name": x.name, "bytes": int(x.bytes), "gib": x.bytes / GiB, "what": x.note}
                                    for x in parts],
                          "total_gib": total / GiB, "capacity_gib": have / GiB, "fits": total <= have,
                          "advice": None if total <= have else f"the {largest.name}: {advice(largest)}"}))
        return
    table = Table(title=f"memory plan on {device.type} (longest prompt {prompt} tokens)")
    for col, just in (("part", "left"), ("size", "right"), ("what", "left")):
        table.add_column(col, justify=just)
    for x in parts:
        table.add_row(x.name, size(x.bytes), x.note)
    table.add_row("total", size(total), f"{what}: {have / GiB:.1f} GiB")
    console.print(table)
    check(parts, device)
    console.print(f"fits: {size(total)} of {have / GiB:.1f} GiB ({100 * total / have:.1f} %)")


def size(n: float) -> str:
    """``n`` bytes as GiB, or MiB below 1 GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"
