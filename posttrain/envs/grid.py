"""``grid``: walk a FrozenLake board to the goal without falling into a hole.

FrozenLake as ROLL ships it for agentic RL (``roll/pipeline/agentic/env/frozen_lake/env.py``: size
4, success when the player reaches G, a format penalty on unparsable actions; GiGPO's recipe uses
-0.1), non-slippery and small enough for the tiny model: a ``size`` x ``size`` board (3 or 4) with
``holes`` holes (default ``size - 1``), start and goal drawn from the example's seed. Every layout
is solvable: a layout whose shortest path is shorter than 2 moves or longer than ``max_turns`` (8)
is redrawn.

Board text: the rows joined by ``/``, ``.`` ice, ``H`` a hole, ``G`` the goal, ``P`` the player
(the start is ice once left): ``P.H/.../H.G``. The prompt is the board; an action is one character
``U`` / ``D`` / ``L`` / ``R`` (up is toward the first row); the reply is the new board. Reaching the
goal: reward 1.0 and done (``success`` 1); stepping into a hole: 0 and done; bumping the edge: the
player stays (the same board comes back, reward 0); anything else as an action: -0.1 and done
(``format_errors`` 1). The driver's turn limit ends a wandering episode (reward 0).

Episode on ``P.H/.../H.G``: ``D`` -> ``..H/P../H.G``, ``R`` -> ``..H/.P./H.G``, ``R`` ->
``..H/..P/H.G``, ``D`` -> reward 1.0, done.

The state key is the board (the layout is the group's, so it names the player's cell): episodes
that walk in circles revisit their anchor states, the dense collisions GiGPO groups on. The expert
follows a shortest path (breadth-first search, moves tried in the order ``R D L U``); with
``noise`` each move is, with that probability, a random move that neither leaves the board nor
falls into a hole, after which it follows a shortest path from where it is.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from posttrain.envs.base import Message, StepResult, register
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

MOVES: dict[str, tuple[int, int]] = {"R": (0, 1), "D": (1, 0), "L": (0, -1), "U": (-1, 0)}
ICE, HOLE, GOAL, PLAYER, START = ".", "H", "G", "P", "S"
ROW_SEPARATOR = "/"


def render(layout: str, pos: tuple[int, int]) -> str:
    """The board text of ``layout`` (rows of ``.``/``H``/``G``/``S`` joined by ``/``) with ``P`` at ``pos``."""
    rows = [list(row.replace(START, ICE)) for row in layout.split(ROW_SEPARATOR)]
    rows[pos[0]][pos[1]] = PLAYER
    return ROW_SEPARATOR.join("".join(row) for row in rows)


def _cells(layout: str) -> list[str]:
    return layout.split(ROW_SEPARATOR)


def find(layout: str, char: str) -> tuple[int, int]:
    """The cell of ``char`` in ``layout``."""
    for r, row in enumerate(_cells(layout)):
        if char in row:
            return r, row.index(char)
    raise ValueError(f"no {char!r} in {layout!r}")


def move(layout: str, pos: tuple[int, int], action: str) -> tuple[int, int]:
    """Where ``action`` takes the player from ``pos`` (it stays at an edge)."""
    rows = _cells(layout)
    dr, dc = MOVES[action]
    r, c = pos[0] + dr, pos[1] + dc
    return (r, c) if 0 <= r < len(rows) and 0 <= c < len(rows[0]) else pos


def shortest_path(layout: str, pos: tuple[int, int]) -> str | None:
    """The moves of a shortest hole-free path from ``pos`` to the goal (BFS, moves in ``RDLU``
    order), or ``None`` if there is none.
    """
    rows = _cells(layout)
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {pos: None}
    queue = deque([pos])
    while queue:
        cell = queue.popleft()
        if rows[cell[0]][cell[1]] == GOAL:
            path = []
            while parent[cell] is not None:
                cell, action = parent[cell]  # type: ignore[misc]
                path.append(action)
            return "".join(reversed(path))
        for action in MOVES:
            nxt = move(layout, cell, action)
            if nxt not in parent and rows[nxt[0]][nxt[1]] != HOLE:
                parent[nxt] = (cell, action)
                queue.append(nxt)
    return None


@dataclass
class GridEpisode:
    """One walk on a layout."""

    layout: str
    pos: tuple[int, int] = (0, 0)

    def reset(self) -> list[Message]:
        """The board with the player on the start."""
        self.pos = find(self.layout, START)
        return [{"role": "user", "content": render(self.layout, self.pos)}]

    def step(self, action: str) -> StepResult:
        """Move one cell."""
        text = action.strip()
        if len(text) != 1 or text not in MOVES:
            return StepResult(reward=-0.1, done=True, info={"success": 0.0, "format_errors": 1.0})
        self.pos = move(self.layout, self.pos, text)
        cell = _cells(self.layout)[self.pos[0]][self.pos[1]]
        if cell == GOAL:
            return StepResult(reward=1.0, done=True, info={"success": 1.0})
        if cell == HOLE:
            return StepResult(reward=0.0, done=True, info={"success": 0.0})
        return StepResult(messages=({"role": "user", "content": render(self.layout, self.pos)},), info={"success": 0.0})

    def state_key(self) -> str:
        """The board (the player's cell on the group's layout)."""
        return render(self.layout, self.pos)


@register("grid")
class Grid:
    """FrozenLake-style walking (see the module docstring)."""

    name = "grid"
    max_turns = 8

    def __init__(self, size: int = 3, holes: int | None = None, noise: float = 0.0) -> None:
        if size not in (3, 4):
            raise ValueError(f"grid: size must be 3 or 4; got {size}")
        holes = size - 1 if holes is None else holes
        if not 0 <= holes <= size * size - 4:
            raise ValueError(f"grid: holes must be in 0..{size * size - 4}; got {holes}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"grid: noise must be in [0, 1]; got {noise}")
        self.size, self.holes, self.noise = size, holes, noise
        self.alphabet = make_alphabet(ICE, HOLE, GOAL, PLAYER, ROW_SEPARATOR, "".join(MOVES))

    def _draw(self, rng: random.Random) -> tuple[str, Example] | None:
        n = self.size * self.size
        cells = rng.sample(range(n), self.holes + 2)  # start, goal, then the holes
        grid = [ICE] * n
        grid[cells[0]], grid[cells[1]] = START, GOAL
        for h in cells[2:]:
            grid[h] = HOLE
        layout = ROW_SEPARATOR.join("".join(grid[r * self.size : (r + 1) * self.size]) for r in range(self.size))
        start = find(layout, START)
        path = shortest_path(layout, start)
        if path is None or not 2 <= len(path) <= self.max_turns:
            return None  # unsolvable, trivial or too long: redraw
        example = Example(render(layout, start), path, path[0], {"layout": layout})
        return f"grid:{layout}", example

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Solvable layouts; ``answer`` is a shortest path, ``demonstration`` its first move."""
        return sample_split(split, n, seed, self._draw)

    def start(self, example: Example) -> GridEpisode:
        """A walk from the start of ``example``'s layout."""
        return GridEpisode(str(example.fields["layout"]))

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """Shortest-path moves, each a random safe move with probability ``noise``."""
        rng = random.Random(seed)
        ep = self.start(example)
        messages = ep.reset()
        rows = _cells(ep.layout)
        for turn in range(self.max_turns):
            path = shortest_path(ep.layout, ep.pos)
            assert path, "every generated layout is solvable from every safe cell reached"
            action = path[0]
            if rng.random() < self.noise:
                safe = [
                    a for a in MOVES
                    if (nxt := move(ep.layout, ep.pos, a)) != ep.pos and rows[nxt[0]][nxt[1]] != HOLE
                ]
                action = rng.choice(safe)
            messages.append({"role": "assistant", "content": action})
            res = ep.step(action)
            if res.done or turn == self.max_turns - 1:  # the transcript ends with the policy's turn
                break
            messages.extend(res.messages)
        return messages
