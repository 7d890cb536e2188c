"""Learn: the Learner (every forward pass on a model), the update's minibatch loop, chunked log-probs,
the fused output head, the critic, and the distributed ranks (``distributed/``).
"""
