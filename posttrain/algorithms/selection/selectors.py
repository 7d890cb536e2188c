"""The batch selectors' parameters and their check (``algorithm.batch_selector`` and
``batch_selector_params``): what the config validates without importing the loop. The selectors
themselves run in ``posttrain/prepare/selectors.py``.
"""

from __future__ import annotations

from posttrain.errors import unknown_name

#: selector -> its parameters with their defaults (the papers' where they give one)
SELECTORS: dict[str, dict[str, float | int | str]] = {
    "none": {},
    "shuffle_r1": {"prune_ratio": 0.5, "weight": "sum", "replay_times": 8, "power": 1.0},
    "rorecomp": {"correct_above": 0.0, "top_k": 0, "compensation_every": 4, "compensation_size": 0, "capacity": 1024},
}
_WEIGHTS = ("sum", "max", "mean", "pos")


def check_selector(name: str, params: dict, group_size: int) -> None:
    """Raise ``ValueError`` naming the key, the value and what is allowed, for a bad selector config."""
    if name not in SELECTORS:
        raise ValueError(unknown_name("algorithm.batch_selector", "batch selector", name, sorted(SELECTORS)))
    accepted = SELECTORS[name]
    bad = sorted(set(params) - set(accepted))
    if bad:
        raise ValueError(
            f"algorithm.batch_selector_params: {name!r} has no parameter(s) {bad}; accepted: {sorted(accepted)}"
        )
    p = {**accepted, **params}
    for key, value in params.items():
        default = accepted[key]
        ok = isinstance(value, str) if isinstance(default, str) else (
            isinstance(value, int | float) and not isinstance(value, bool)
            and (isinstance(value, int) or isinstance(default, float))
        )
        if not ok:
            raise ValueError(f"algorithm.batch_selector_params.{key}: expected {type(default).__name__}, got {value!r}")
    rules = {
        "prune_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "weight": (lambda v: v in _WEIGHTS, f"one of {list(_WEIGHTS)}"),
        "replay_times": (lambda v: v >= 1, ">= 1"),
        "power": (lambda v: v > 0, "> 0"),
        "top_k": (lambda v: v >= 0, ">= 0 (0: median split)"),
        "compensation_every": (lambda v: v >= 0, ">= 0 (0: never)"),
        "compensation_size": (lambda v: v >= 0, ">= 0 (0: the priority batch's size)"),
        "capacity": (lambda v: v >= 1, ">= 1"),
    }
    for key in params:
        test, allowed = rules.get(key, (lambda v: True, ""))
        if not test(params[key]):
            raise ValueError(f"algorithm.batch_selector_params.{key}: must be {allowed}; got {params[key]!r}")
    if name == "shuffle_r1" and int((group_size // 2) * (1 - p["prune_ratio"])) < 1:
        raise ValueError(
            f"algorithm.batch_selector: 'shuffle_r1' keeps int((G // 2) * (1 - prune_ratio)) pairs a group, 0 with "
            f"rollout.group_size={group_size} and prune_ratio={p['prune_ratio']}; use G >= 4 or a smaller prune_ratio"
        )
