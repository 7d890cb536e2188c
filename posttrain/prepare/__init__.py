"""Prepare: advantage inputs (providers) -> advantages -> the rows and minibatches to train on
(batch selectors). Runs where the learner is.
"""
