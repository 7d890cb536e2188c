"""Produce: prompts -> rollouts -> rewards. Rollout drivers (one registry), the refill that collects a
step's batch, the pipeline that runs it now or ahead on a producer thread, and reference samples.

It holds no trainer state, so it can run ahead, asynchronously, on other processes.

Every rollout driver lives in its own module of ``produce/drivers/`` and registers itself in
``produce/drivers/registry.py``, which imports none of them; ``produce/drivers/__init__.py`` imports every
module of its folder, so the registry is complete whenever any of it is imported, and a new driver is one new
file.
"""
