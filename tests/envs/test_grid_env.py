"""grid: hand-played walks on a FrozenLake board (posttrain/envs/grid.py)."""

from __future__ import annotations

import pytest

from posttrain.envs import make_env
from posttrain.envs.grid import shortest_path
from posttrain.tasks.base import Example

LAYOUT = "S.H/.../H.G"  # start top-left, holes top-right and bottom-left, goal bottom-right
EX = Example("P.H/.../H.G", "RDRD", "R", {"layout": LAYOUT})


def _play(actions):
    ep = make_env("grid", {}).start(EX)
    first = ep.reset()
    out = []
    for action in actions:
        res = ep.step(action)
        out.append(([m["content"] for m in res.messages], res.reward, res.done, dict(res.info)))
    return first, out, ep


def test_walk_to_the_goal():
    first, out, _ = _play(["D", "R", " R\n", "D"])
    assert first == [{"role": "user", "content": "P.H/.../H.G"}]
    assert out == [
        (["..H/P../H.G"], 0.0, False, {"success": 0.0}),
        (["..H/.P./H.G"], 0.0, False, {"success": 0.0}),
        (["..H/..P/H.G"], 0.0, False, {"success": 0.0}),
        ([], 1.0, True, {"success": 1.0}),
    ]


def test_edges_and_holes():
    _, out, ep = _play(["U", "L"])  # bump the top and left edges: stay
    assert [o[0] for o in out] == [["P.H/.../H.G"], ["P.H/.../H.G"]] and ep.pos == (0, 0)
    _, out, _ = _play(["R", "R"])  # into the hole at the top right
    assert out[1] == ([], 0.0, True, {"success": 0.0})


@pytest.mark.parametrize("action", ["", "X", "u", "RD", "up", "R."])
def test_unparsable_move(action):
    _, out, _ = _play([action])
    assert out == [([], -0.1, True, {"success": 0.0, "format_errors": 1.0})]


def test_state_key_is_the_board():
    _, _, a = _play(["R", "L"])  # back on the start
    _, _, b = _play(["U"])  # never left it
    _, _, c = _play(["D"])
    assert a.state_key() == b.state_key() == "P.H/.../H.G"
    assert c.state_key() == "..H/P../H.G"


def test_expert_follows_the_bfs_path():
    assert shortest_path(LAYOUT, (0, 0)) == "RDRD"
    assert shortest_path("SH./H../..G", (0, 0)) is None
    transcript = make_env("grid", {}).demonstration(EX, 0)
    assert [m["content"] for m in transcript] == [
        "P.H/.../H.G", "R", ".PH/.../H.G", "D", "..H/.P./H.G", "R", "..H/..P/H.G", "D"]


@pytest.mark.parametrize("params", [{"size": 3}, {"size": 4}, {"size": 4, "holes": 6}, {"size": 3, "holes": 0}])
def test_every_layout_is_solvable(params):
    env = make_env("grid", params)
    holes = params.get("holes", params["size"] - 1)
    for ex in env.examples("train", 100, 0) + env.examples("test", 20, 0):
        layout = str(ex.fields["layout"])
        rows = layout.split("/")
        assert len(rows) == params["size"] and all(len(r) == params["size"] for r in rows)
        assert (layout.count("S"), layout.count("G"), layout.count("H")) == (1, 1, holes)
        start = next((r, row.index("S")) for r, row in enumerate(rows) if "S" in row)
        path = shortest_path(layout, start)
        assert path == ex.answer and 2 <= len(path) <= env.max_turns and ex.demonstration == path[0]


def test_noisy_expert_never_falls_into_a_hole():
    env = make_env("grid", {"size": 4, "noise": 0.5})
    for i, ex in enumerate(env.examples("train", 50, 1)):
        ep = env.start(ex)
        ep.reset()
        for m in env.demonstration(ex, i):
            if m["role"] == "assistant":
                res = ep.step(m["content"])
                assert not res.done or res.info["success"] == 1.0


@pytest.mark.parametrize("params", [{"size": 5}, {"size": 3, "holes": 6}, {"noise": 2.0}])
def test_bad_parameters(params):
    with pytest.raises(ValueError, match="grid:"):
        make_env("grid", params)
