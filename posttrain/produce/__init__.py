"""Produce: prompts -> rollouts -> rewards. Rollout drivers (one registry), the refill that collects a
step's batch, the pipeline that runs it now or ahead on a producer thread, and reference samples.

It holds no trainer state, so it can run ahead, asynchronously, on other processes.

Every rollout driver lives in its own module and registers itself in ``produce/drivers.py``'s registry,
which imports none of them; this is the one place that imports them all (a package's ``__init__`` runs
before any of its modules, so the registry is complete whatever module of ``produce`` is imported first).
A new driver adds its module to this list.
"""

from posttrain.produce import drivers_external, hint, multi_turn, partial_states, single_turn  # noqa: F401
