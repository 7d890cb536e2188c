"""Produce: prompts -> rollouts -> rewards. Rollout drivers (one registry), the refill that collects a
step's batch, the pipeline that runs it now or ahead on a producer thread, and reference samples.

It holds no trainer state, so it can run ahead, asynchronously, on other processes.
"""
