r"""LLM-as-judge rewards: a prompted language model reads each (prompt, completion) and its verdict
is parsed into a reward, generated through posttrain's own rollout engine.

``[[reward]] name = "llm_judge"`` with ``params = {path = "...", parse = "score"}``. Per pair the
rubric (a template with ``{prompt}``, ``{completion}`` and ``{answer}``; ``{{``/``}}`` for literal
braces) is rendered, sent as one user turn through the judge tokenizer's chat template
(:func:`~posttrain.models.load.encode_chat`) and answered by the judge with ``max_new_tokens``
at ``temperature`` (0: greedy, deterministic). The whole batch goes to the judge in one
``engine.generate`` call (``batch_size`` pairs per call when set), ``samples`` judgements a pair.

Rewards, by ``parse``:

- ``"yes_no"`` (Kwon et al. 2023, "Reward Design with Language Models", arXiv:2303.00767;
  catalog L151): r = 1 if the first whole word "yes" or "no" of the judgement (any case) is
  "yes", 0 if it is "no". The paper's parser maps anything else to 0; here it is unparseable
  (below) unless ``unparsed = 0.0`` asks for the paper's rule.
- ``"score"`` (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
  arXiv:2306.05685, single-answer grading with "Rating: [[5]]"): s = the last ``[[s]]`` of the
  judgement, else its last number, where "7/10" and "7 out of 10" read as 7; the reward is
  r = (s - min_score) / (max_score - min_score), and s outside [min_score, max_score] is
  unparseable. "Score: 7/10" with the defaults min 0, max 10 gives 0.7. Departure: Zheng et al.
  grade 1-10 and let the judge explain first; the default rubric asks for the rating only.
- ``"regex"``: s = group 1 (else the whole match) of the last match of ``pattern``, as a number,
  normalized as for ``"score"``.

With ``samples = k`` the reward is the mean of the k judgements that parse (temperature > 0).
A pair none of whose judgements parse scores ``unparsed`` when given, else it fails (``None``,
counted in ``reward/llm_judge/errors`` and written with the judge's text to
``reward_failures.jsonl``); never a silent 0. A pair whose judge prompt with ``max_new_tokens``
does not fit the judge's context fails the same way. A batch that takes longer than
``timeout_s`` fails whole (``reward/llm_judge/timeouts``) and the run goes on: the hf engine's
generation stops at its next forward pass (a pre-hook on the judge's input embeddings); a vllm
generation runs to its end in the background and the next batch waits for it.

The judge loads once per process (a second copy even when it is the policy's own path) and is
trusted code that runs in the trainer's process, like the ``reward_model`` reward. At start-up
the trainer calls :func:`describe`: unknown parameters, a rubric with an unknown placeholder, a
bad mode or a judge that does not load stop the run there, before training.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import lru_cache

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.errors import ConfigError
from posttrain.models.load import _DTYPES, check_model_path, encode_chat, load_model, load_tokenizer
from posttrain.rewards.judge_api import API_KEYS, LOCAL_KEYS, endpoint, judge_remote
from posttrain.rewards.judge_parse import (
    PARSES,
    PLACEHOLDERS,
    SCORE_RUBRIC,
    YES_NO_RUBRIC,
    Parse,
    check_rubric,
    default_rubric,
    normalize,
    parse_regex,
    parse_score,
    parse_yes_no,
    render,
)
from posttrain.rewards.pool import Outcome
from posttrain.rewards.registry import register
from posttrain.rewards.wire import check_keys, check_positive, check_url
from posttrain.rollout import ENGINES, RolloutEngine, SamplingParams, make_engine

__all__ = ["PARSES", "PLACEHOLDERS", "SCORE_RUBRIC", "YES_NO_RUBRIC", "JudgeSettings", "check", "check_rubric",
           "default_rubric", "describe", "judge_batch", "judge_for", "llm_judge_reward", "normalize", "parse_regex",
           "parse_score", "parse_yes_no", "render"]

# what load errors name: this reward's parameter, not the policy's model.path
PATH_KEY = "llm_judge's params.path"


@dataclass(frozen=True)
class JudgeSettings:
    """The ``llm_judge`` reward's parameters, validated (see :func:`llm_judge_reward`)."""

    path: str | None = None
    engine: str = "hf"
    engine_params: tuple[tuple[str, object], ...] = ()
    rubric: str | None = None
    system: str | None = None
    parse: Parse = "score"
    pattern: str | None = None
    min_score: float = 0.0
    max_score: float = 10.0
    unparsed: float | None = None
    max_new_tokens: int = 32
    temperature: float = 0.0
    samples: int = 1
    timeout_s: float | None = None
    batch_size: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    api_base: str | None = None  # the OpenAI-compatible backend (judge_api.py); then model names the judge
    model: str | None = None
    api_key_env: str | None = None
    max_concurrency: int = 4
    retries: int = 2
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"llm_judge's params.{key} = {getattr(self, key)!r}: {why}")

        if self.engine not in ENGINES:
            raise bad("engine", f"not one of {list(ENGINES)}")
        if self.parse not in PARSES:
            raise bad("parse", f"not one of {list(PARSES)}")
        if (self.parse == "regex") != (self.pattern is not None):
            raise bad("pattern", "parse = 'regex' needs a pattern, and only it takes one")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise bad("pattern", f"not a regular expression ({e})") from e
        if not self.min_score < self.max_score:
            raise bad("max_score", f"must be above min_score = {self.min_score}")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"not one of {sorted(_DTYPES)}")
        batch = 1 if self.batch_size is None else self.batch_size
        for key, value in (("max_new_tokens", self.max_new_tokens), ("samples", self.samples), ("batch_size", batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, "must be an integer >= 1")
        if self.engine == "hf" and self.engine_params:
            raise bad("engine_params", "the hf engine takes none (they are for engine = 'vllm')")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0: greedy)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise bad("timeout_s", "must be positive (or left out: no limit)")
        if self.samples > 1 and self.temperature == 0:
            raise bad("samples", "several greedy (temperature = 0) judgements are identical; set temperature > 0")
        if self.api_base is not None:
            check_url("llm_judge's params.api_base", self.api_base)
            if not isinstance(self.model, str) or not self.model:
                raise bad("model", "a judge behind api_base needs the model's name on that server")
            for key, integer, zero in (("max_concurrency", True, False), ("retries", True, True),
                                       ("backoff_s", False, True)):
                check_positive(f"llm_judge's params.{key}", getattr(self, key), integer=integer, zero=zero)
        elif self.path is None:
            raise ConfigError("llm_judge's params.path is required: the judge model (directory, hub id or alias), "
                              "or api_base and model for a judge behind an OpenAI-compatible API")
        check_rubric(self.the_rubric)

    @property
    def the_rubric(self) -> str:
        """The rubric in use: ``rubric``, else :func:`default_rubric` of the parse mode."""
        return self.rubric if self.rubric is not None else default_rubric(self.parse, self.min_score, self.max_score)

    @classmethod
    def of(cls, params: Mapping[str, object]) -> JudgeSettings:
        """Settings from a ``[[reward]]`` params table: unknown keys and a missing ``path`` are errors."""
        names = [f.name for f in fields(cls)]
        check_keys("llm_judge", params, names)
        remote = "api_base" in params
        if not remote and "path" not in params:
            raise ConfigError("llm_judge's params.path is required: the judge model (directory, hub id or alias), "
                              "or api_base and model for a judge behind an OpenAI-compatible API")
        wrong = [k for k in (LOCAL_KEYS if remote else API_KEYS) if k in params and k != "api_base"]
        if wrong:
            where = "a judge behind api_base" if remote else "a judge loaded here (path)"
            raise ConfigError(f"llm_judge's params: {wrong} do(es) not apply to {where}; it takes "
                              f"{[k for k in names if k not in (API_KEYS if not remote else LOCAL_KEYS)]}")
        given = dict(params)
        given["engine_params"] = tuple(sorted(dict(given.get("engine_params") or {}).items()))
        return cls(**given)

    def score(self, text: str) -> float | None:
        """One judgement's reward by the parse mode, or ``None`` when it does not parse."""
        if self.parse == "yes_no":
            return parse_yes_no(text)
        if self.parse == "score":
            return parse_score(text, self.min_score, self.max_score)
        return parse_regex(text, re.compile(str(self.pattern)), self.min_score, self.max_score)


class JudgeTimeout(TimeoutError):
    """Judging a batch took longer than ``timeout_s``."""


class JudgeCancelled(RuntimeError):
    """A generation stopped because its batch had timed out."""


class Judge:
    """A judge model loaded once, generating through posttrain's rollout engine (:func:`make_engine`).

    ``engine`` is public: every judgement is one ``engine.generate`` call. Calls are serialized;
    with a timeout each runs on a worker thread of its own, which ends with the call, so a batch past
    its deadline can be abandoned.
    """

    def __init__(self, path: str, engine: str = "hf", engine_params: Mapping[str, object] | None = None,
                 device: str = "cpu", dtype: str = "float32", seed: int = 0) -> None:
        check_model_path(path, PATH_KEY)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(path, key=PATH_KEY)
        self.model = load_model(path, dtype, device, key=PATH_KEY).eval().requires_grad_(False)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.engine: RolloutEngine = make_engine(engine, self.model, self.tokenizer, engine_params, seed)
        self.seed = seed
        self.calls = 0
        self._active: threading.Event | None = None  # the cancel flag of the generation now running
        self._lock = threading.Lock()
        # both hf decode paths (generic and fast_llama) embed the tokens of every forward pass here
        self.model.get_input_embeddings().register_forward_pre_hook(self._stop_if_cancelled)

    def _stop_if_cancelled(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        active = self._active
        if active is not None and active.is_set():
            raise JudgeCancelled("llm_judge: the generation was stopped after its batch timed out")

    def _run(self, cancel: threading.Event | None, prompts: list[list[int]], sampling: SamplingParams,
             seed: int) -> list[str]:
        with self._lock:
            if cancel is not None and cancel.is_set():
                raise JudgeCancelled("llm_judge: timed out before it started")
            self._active = cancel
            try:
                return list(self.engine.generate(prompts, sampling, seed).texts)
            finally:
                self._active = None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, *, batch_size: int | None = None,
                 timeout_s: float | None = None) -> list[str]:
        """The judgements of tokenized ``prompts``, ``sampling.n`` per prompt (prompt-major), from one
        ``engine.generate`` call per ``batch_size`` prompts (all in one call when ``None``).

        Raises:
            JudgeTimeout: the calls together took longer than ``timeout_s``.

        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        step = batch_size or max(len(prompts), 1)
        texts: list[str] = []
        for start in range(0, len(prompts), step):
            chunk, seed = prompts[start : start + step], self.seed + self.calls
            self.calls += 1
            if deadline is None:
                texts += self._run(None, chunk, sampling, seed)
                continue
            cancel = threading.Event()
            worker = ThreadPoolExecutor(1, thread_name_prefix="llm-judge")
            try:
                future = worker.submit(self._run, cancel, chunk, sampling, seed)
            finally:
                # the thread ends with its call: a thread that ran torch's parallel kernels and stays alive
                # slowed the main thread's training by ~1.4x for the rest of the process (OpenMP keeps a
                # team of workers per such thread; measured on 2 cores: the quick demo 84 s, 125 s after a judged call)
                worker.shutdown(wait=False)
            try:
                texts += future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                cancel.set()  # the hf engine stops at its next forward pass
                raise JudgeTimeout(
                    f"llm_judge: judging {len(prompts)} pairs took longer than timeout_s = {timeout_s}; the batch "
                    "scores None and the run goes on (raise params.timeout_s, or lower max_new_tokens)"
                ) from None
        return texts


@lru_cache(maxsize=2)
def cached_judge(path: str, engine: str = "hf", engine_params: tuple[tuple[str, object], ...] = (),
                 device: str = "cpu", dtype: str = "float32", seed: int = 0) -> Judge:
    """One :class:`Judge` per (path, engine, engine_params, device, dtype, seed) in this process."""
    return Judge(path, engine, dict(engine_params), device, dtype, seed)


def judge_for(s: JudgeSettings) -> Judge:
    """The process's judge for settings ``s`` (loaded on first use)."""
    return cached_judge(s.path, s.engine, s.engine_params, s.device, s.dtype, s.seed)


def verdict(s: JudgeSettings, texts: Sequence[str]) -> float | Outcome:
    """One pair's reward from its ``samples`` judgements: the mean of those that parse, else
    ``unparsed``, else a failed :class:`Outcome` quoting the judgements.
    """
    kept = [v for v in (s.score(t) for t in texts) if v is not None]
    if kept:
        return sum(kept) / len(kept)
    if s.unparsed is not None:
        return float(s.unparsed)
    return Outcome(None, "error", f"unparseable judgement(s) for parse = {s.parse!r}: {list(texts)!r:.300}")


def judge_batch(s: JudgeSettings, prompts: Sequence[str], completions: Sequence[str],
                answers: Sequence[object] | None = None) -> list[float | Outcome]:
    """Judge every (prompt, completion[, answer]) with settings ``s``; see the module docstring."""
    if len(prompts) != len(completions) or (answers is not None and len(answers) != len(completions)):
        raise ValueError(f"{len(prompts)} prompts and {len(answers or [])} answers for {len(completions)} completions")
    answers = list(answers) if answers is not None else [None] * len(completions)
    if s.api_base is not None:
        return judge_over_api(s, prompts, completions, answers)
    judge = judge_for(s)
    out: list[float | Outcome] = [Outcome(None, "error", "not judged")] * len(completions)
    todo: list[tuple[int, list[int]]] = []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True)):
        ids = encode_chat(judge.tokenizer, render(s.the_rubric, p, c, a), s.system)
        if len(ids) + s.max_new_tokens > judge.context:
            out[i] = Outcome(None, "error", f"the judge prompt has {len(ids)} tokens; with max_new_tokens = "
                             f"{s.max_new_tokens} it does not fit the judge's context of {judge.context}")
        else:
            todo.append((i, ids))
    if not todo:
        return out
    sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, n=s.samples)
    try:
        texts = judge.generate([ids for _, ids in todo], sampling, batch_size=s.batch_size, timeout_s=s.timeout_s)
    except JudgeTimeout as e:
        return [Outcome(None, "timeout", str(e))] * len(completions)
    k = s.samples
    for j, (i, _) in enumerate(todo):
        out[i] = verdict(s, texts[j * k : (j + 1) * k])
    return out


def judge_over_api(s: JudgeSettings, prompts: Sequence[str], completions: Sequence[str],
                   answers: Sequence[object]) -> list[float | Outcome]:
    """Judge every pair through the OpenAI-compatible server at ``s.api_base`` (:mod:`~posttrain.rewards.judge_api`)."""
    try:
        ep = endpoint(str(s.api_base), s.api_key_env, s.timeout_s, s.retries, s.backoff_s)
    except ConfigError as e:  # the key's variable went away after start-up: every pair fails, the run goes on
        return [Outcome(None, "error", str(e))] * len(completions)
    system = [{"role": "system", "content": s.system}] if s.system else []
    conversations = [[*system, {"role": "user", "content": render(s.the_rubric, p, c, a)}]
                     for p, c, a in zip(prompts, completions, answers, strict=True)]
    got = judge_remote(ep, str(s.model), conversations, max_tokens=s.max_new_tokens, temperature=s.temperature,
                       n=s.samples, seed=s.seed, max_concurrency=s.max_concurrency)
    return [g if isinstance(g, Outcome) else verdict(s, g) for g in got]


@register("llm_judge")
def llm_judge_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    path: str | None = None,
    engine: str = "hf",
    engine_params: Mapping[str, object] | None = None,
    rubric: str | None = None,
    system: str | None = None,
    parse: Parse = "score",
    pattern: str | None = None,
    min_score: float = 0.0,
    max_score: float = 10.0,
    unparsed: float | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    samples: int = 1,
    timeout_s: float | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    api_base: str | None = None,
    model: str | None = None,
    api_key_env: str | None = None,
    max_concurrency: int = 4,
    retries: int = 2,
    backoff_s: float = 0.5,
    answer: Sequence[object] | None = None,
    **_: object,
) -> list[float | Outcome]:
    """A prompted LLM judges each completion (Kwon et al. 2023, arXiv:2303.00767; Zheng et al. 2023,
    arXiv:2306.05685; catalog L151, seed ``papers/004_f298e9ec572f7f27.txt:151``):
    yes_no -> 1/0, score -> (s - min) / (max - min); batched.

    Parameters: ``path`` the judge (directory, hub id or alias); ``engine`` "hf" or "vllm" (with
    ``engine_params`` as ``rollout.engine_params``); ``rubric`` a template over ``{prompt}``,
    ``{completion}``, ``{answer}`` (default: :func:`default_rubric`), ``system`` an optional system
    message; ``parse`` "yes_no", "score" or "regex" (with ``pattern``), scores normalized from
    [``min_score``, ``max_score``]; ``unparsed`` what a judgement that does not parse scores
    (``None``: a counted failure); ``max_new_tokens``, ``temperature`` (0: greedy), ``samples``
    judgements averaged; ``timeout_s`` for the whole batch; ``batch_size`` pairs per generate
    call (default all); ``device``, ``dtype``, ``seed``. ``answer`` is the examples' field.
    A judge behind an OpenAI-compatible API instead of ``path``: ``api_base`` (".../v1"), ``model``,
    ``api_key_env`` (a variable holding the key), ``max_concurrency`` requests, ``retries`` after
    ``backoff_s * 2**k`` s, ``timeout_s`` per attempt (:mod:`~posttrain.rewards.judge_api`).
    Returns per pair a reward in [0, 1] (or ``unparsed``) or a failed :class:`Outcome` with its reason.
    """
    settings = JudgeSettings(
        path=path, engine=engine, engine_params=tuple(sorted(dict(engine_params or {}).items())), rubric=rubric,
        system=system, parse=parse, pattern=pattern, min_score=min_score, max_score=max_score, unparsed=unparsed,
        max_new_tokens=max_new_tokens, temperature=temperature, samples=samples, timeout_s=timeout_s,
        batch_size=batch_size, device=device, dtype=dtype, seed=seed, api_base=api_base, model=model,
        api_key_env=api_key_env, max_concurrency=max_concurrency, retries=retries, backoff_s=backoff_s,
    )
    return judge_batch(settings, prompts, completions, answer)


def check(params: Mapping[str, object]) -> None:
    """Validate a ``[[reward]]`` params table without loading anything (:meth:`JudgeSettings.of` and
    the model path's checks); raises :class:`ConfigError` or :class:`ModelLoadError`.
    """
    s = JudgeSettings.of(params)
    if s.api_base is None:
        check_model_path(str(s.path), PATH_KEY)


def describe(params: Mapping[str, object]) -> str:
    """Check the params and load the judge (the trainer calls this at start-up, so a bad key, rubric or
    path stops the run before training); one log line saying how the judge will run.
    """
    s = JudgeSettings.of(params)
    if s.api_base is not None:
        ep = endpoint(s.api_base, s.api_key_env, s.timeout_s, s.retries, s.backoff_s)  # a missing key stops here
        key = f", key from ${s.api_key_env}" if s.api_key_env else ""
        return (f"reward 'llm_judge': judge {s.model!r} at {ep.url}{key}, {s.max_concurrency} request(s) in flight, "
                f"parse {s.parse!r}, {s.samples} judgement(s) at temperature {s.temperature:g}, up to "
                f"{s.max_new_tokens} tokens, timeout {ep.timeout_s:g} s an attempt, {s.retries} retries")
    if s.engine == "vllm":
        from posttrain.rollout.vllm_engine import INSTALL_VLLM, check_params, vllm_available

        if not vllm_available():
            raise ConfigError(f"llm_judge's params.engine = 'vllm' but vllm is not installed: {INSTALL_VLLM}")
        try:
            check_params(dict(s.engine_params))
        except ValueError as e:
            raise ConfigError(f"llm_judge's params.engine_params: {e}") from e
    judge = judge_for(s)
    limit = f"{s.timeout_s:g} s" if s.timeout_s is not None else "none"
    return (f"reward 'llm_judge': judge {s.path!r} on the {s.engine} engine ({s.device}, {s.dtype}, context "
            f"{judge.context}), parse {s.parse!r}, {s.samples} judgement(s) at temperature {s.temperature:g}, "
            f"up to {s.max_new_tokens} tokens, timeout {limit}")


llm_judge_reward.batched = True  # type: ignore[attr-defined]
llm_judge_reward.describe = describe  # type: ignore[attr-defined]  # printed (and so checked) at start-up
llm_judge_reward.check = check  # type: ignore[attr-defined]  # for a config-time check that loads nothing
