"""Keys that moved: a stale recipe's key gets an error naming its new place."""

from __future__ import annotations

# The per-token loss weights that were a float each (or a driver's option) are entries of one list now.
_OPSM = 'algorithm.loss_weights = [{ name = "opsm", params = { threshold = 0.5 } }] (threshold: the value you set)'
_TOP_ENTROPY = ('algorithm.loss_weights = [{ name = "top_entropy", params = { rho = 0.2 } }] (rho: the value you '
                "set; 1 was every token: leave the entry out)")
_AAPO = ('algorithm.loss_weights = [{ name = "aapo", params = { lam = 1.0 } }] (lam: the value you set, with '
         'rollout.driver = "hint_reroll"; it is no longer on by default, and 0 was off: leave the entry out)')

# Keys that moved (into the drivers' options, into algorithm.loss_weights): their new place, for the error a
# stale recipe gets. ``rollout.driver_params.*`` keys are checked by RolloutConfig.params (a dict, not a section).
MOVED_KEYS = {
    "rollout.hint_reroll": 'rollout.driver = "hint_reroll"',
    "rollout.partial_states": 'rollout.driver = "partial_states"',
    **{f"rollout.hint_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"hint_reroll\")"
       for k in ("preamble", "train_prompt")},
    "rollout.hint_affinity_lambda": _AAPO,
    "rollout.driver_params.affinity_lambda": _AAPO,
    "algorithm.off_policy_mask_threshold": _OPSM,
    "algorithm.top_entropy_quantile": _TOP_ENTROPY,
    # "partial" meant four things (ReST's partial states, cut rows, partial credit, functools.partial)
    "rollout.partial": 'rollout.on_new_weights (the same values: "finish", "resubmit" or "continue")',
    **{f"rollout.partial_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"partial_states\")"
       for k in ("min_std", "accept", "alpha", "ratio", "share", "capacity", "separator")},
}
