"""Run infrastructure every trainer shares: the harness (sinks, progress, cadence, summary), run
set-up (run directory, task, model, tokenizer), checkpoints and the optimizer.
"""
