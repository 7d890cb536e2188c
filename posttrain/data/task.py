"""A :class:`~posttrain.tasks.base.Task` over a fixed pool of loaded examples.

Splits: ``train`` and ``test`` come from separate sources when the spec names one, else a
deterministic held-out fraction (:func:`split_by_hash`): a prompt is held out when a stable hash
of its text (blake2b, like :func:`posttrain.tasks.base.split_of`) falls below ``test_fraction``,
so duplicates of a prompt share a split and the splits are disjoint.

Order: each split is an endless stream of epochs; epoch ``e`` is the pool shuffled by
``random.Random(f"{seed}:{split}:{e}")`` (a string seed: stable across processes). ``examples(split,
n, seed)`` returns the first ``n`` items of the stream, so ``n`` larger than the pool cycles
through fresh permutations (every example once per epoch), and ``stream(split, start, n, seed)``
returns items ``start .. start+n``: a loop that keeps a cursor resumes exactly where it stopped.

Scoring: ``verify`` calls the reward function registered under ``verifier`` in
:data:`posttrain.rewards.REGISTRY` (looked up on first use, so reward modules load lazily) with
the example's fields, ``answer``, ``example`` and ``task``, like the loop's reward scoring does.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence

from posttrain.data.chat import chat_texts
from posttrain.data.formats import extract_math
from posttrain.models.chat import is_chat
from posttrain.tasks.base import Example, Split, make_alphabet

SPLITS: tuple[Split, ...] = ("train", "test")


def hash_unit(key: str) -> float:
    """A stable pseudo-random number in ``[0, 1)`` from ``key`` (blake2b, not the salted ``hash``)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_by_hash(examples: Sequence[Example], test_fraction: float) -> tuple[list[Example], list[Example]]:
    """Split ``examples`` into ``(train, test)``: test holds those with ``hash_unit(prompt) < test_fraction``."""
    train: list[Example] = []
    test: list[Example] = []
    for ex in examples:
        (test if hash_unit(ex.prompt) < test_fraction else train).append(ex)
    return train, test


def filter_by_length(
    examples: Sequence[Example], tokenizer_len_fn: Callable[[Example], int], max_prompt_tokens: int
) -> tuple[list[Example], int]:
    """Keep the examples whose prompt is at most ``max_prompt_tokens`` tokens long.

    ``tokenizer_len_fn(example)`` counts the example's prompt tokens as the model sees them, e.g.
    ``lambda ex: len(encode_example(tokenizer, ex, system_prompt))`` (chat template included; a chat
    row's whole conversation).

    Returns:
        ``(kept, n_dropped)``.

    """
    kept = [ex for ex in examples if tokenizer_len_fn(ex) <= max_prompt_tokens]
    return kept, len(examples) - len(kept)


class DatasetTask:
    """Examples loaded from data files or ``datasets``; see the module docstring.

    Args:
        train: the training pool.
        test: the held-out pool.
        name: the task's name in logs.
        verifier: the reward registered under this name scores completions (``verify``).
        verifier_params: extra keyword arguments for the verifier (e.g. a code timeout).
        extract: reads the answer out of a completion (``extract``).
        system_prompt: the system message for the chat template; its characters are part of
            ``alphabet`` so a character-level tokenizer can encode it.

    """

    def __init__(
        self,
        train: Sequence[Example],
        test: Sequence[Example],
        *,
        name: str = "dataset",
        verifier: str = "math",
        verifier_params: Mapping[str, object] | None = None,
        extract: Callable[[str], str | None] = extract_math,
        system_prompt: str | None = None,
    ) -> None:
        if verifier == "task":
            raise ValueError("verifier 'task' calls task.verify, which would call itself; name a reward")
        self.name = name
        self.verifier = verifier
        self.verifier_params = dict(verifier_params or {})
        self.system_prompt = system_prompt
        self._extract = extract
        self._reward: Callable[..., float | None] | None = None
        self.verify_errors = 0  # verifier calls that raised (each scored 0.0)
        self.counts: dict[str, int] = {}  # what loading and filtering did, for the log
        """What loading and filtering did (records read, prompts dropped), for the log."""
        """Verifier calls that raised (each scored 0.0)."""
        self.pools: dict[Split, list[Example]] = {"train": list(train), "test": list(test)}
        texts = [t for pool in self.pools.values() for ex in pool for t in (ex.prompt, ex.demonstration)]
        texts += [t for pool in self.pools.values() for ex in pool if is_chat(ex) for t in chat_texts(ex)]
        self.alphabet = make_alphabet(*texts, (system_prompt + "\n") if system_prompt else "")

    def __getstate__(self) -> dict[str, object]:
        """Pickle without the example pools and the cached reward function.

        A task is pickled to go to the reward worker processes with every chunk of calls, where
        only ``verify`` and ``extract`` run; shipping the whole dataset each time would cost more
        than the scoring. An unpickled task verifies and extracts but has empty pools.
        """
        state = dict(self.__dict__)
        state["pools"] = {split: [] for split in self.pools}
        state["_reward"] = None
        return state

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(p)}" for s, p in self.pools.items())
        return f"DatasetTask(name={self.name!r}, {sizes}, verifier={self.verifier!r})"

    def __len__(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def _pool(self, split: Split) -> list[Example]:
        if split not in self.pools:
            raise ValueError(f"unknown split {split!r}; choices: {', '.join(SPLITS)}")
        pool = self.pools[split]
        if not pool:
            raise ValueError(
                f"the {split} split of task {self.name!r} is empty; give a test source or a larger "
                "test_fraction (or fewer filtered prompts)"
            )
        return pool

    def stream(self, split: Split, start: int, n: int, seed: int) -> list[Example]:
        """Items ``start .. start + n`` of the split's epoch-shuffled stream (module docstring)."""
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
        pool = self._pool(split)
        out: list[Example] = []
        pos = start
        while len(out) < n:
            epoch, offset = divmod(pos, len(pool))
            order = list(range(len(pool)))
            random.Random(f"{seed}:{split}:{epoch}").shuffle(order)
            take = order[offset : offset + n - len(out)]
            out += [pool[i] for i in take]
            pos += len(take)
        return out

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """The first ``n`` examples of the split's stream: shuffled by ``seed``, cycling past the pool."""
        return self.stream(split, 0, n, seed)

    def drop_long_prompts(
        self, tokenizer_len_fn: Callable[[Example], int], max_prompt_tokens: int
    ) -> dict[str, int]:
        """Drop prompts longer than ``max_prompt_tokens`` from both pools; returns the count per split.

        Run it once at setup, before any sampling: the stream order depends on the pool.
        """
        dropped: dict[str, int] = {}
        for split, pool in self.pools.items():
            self.pools[split], dropped[split] = filter_by_length(pool, tokenizer_len_fn, max_prompt_tokens)
            self.counts[f"{split}_too_long_dropped"] = dropped[split]
        return dropped

    def extract(self, completion: str) -> str | None:
        """The answer written in ``completion`` (the preset's extractor), or ``None``."""
        return self._extract(completion)

    def verify(self, completion: str, example: Example) -> float:
        """Score ``completion`` with the verifier reward; ``None`` or an error scores 0.0.

        Errors are counted in ``verify_errors``, not raised: the loop calls ``verify`` for its
        accuracy metric outside the guarded reward scoring. An unknown verifier name does raise.
        """
        if self._reward is None:
            from posttrain.rewards import REGISTRY  # imports every reward module

            self._reward = REGISTRY.get(self.verifier)
        fields = {**self.verifier_params, **example.fields, "answer": example.answer, "example": example, "task": self}
        try:
            value = self._reward(example.prompt, completion, **fields)
        except Exception:  # noqa: BLE001 - a failing verifier scores the completion 0
            self.verify_errors += 1
            return 0.0
        return 0.0 if value is None else float(value)
