"""Keys that moved: a stale recipe's key gets an error naming its new place."""

from __future__ import annotations

# Keys that moved into the drivers' options: their new place, for the error a stale recipe gets.
MOVED_KEYS = {
    "rollout.hint_reroll": 'rollout.driver = "hint_reroll"',
    "rollout.partial_states": 'rollout.driver = "partial_states"',
    **{f"rollout.hint_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"hint_reroll\")"
       for k in ("preamble", "train_prompt", "affinity_lambda")},
    **{f"rollout.partial_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"partial_states\")"
       for k in ("min_std", "accept", "alpha", "ratio", "share", "capacity", "separator")},
}
