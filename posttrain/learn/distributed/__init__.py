"""The Learner across ranks: FSDP2 sharding, sharded minibatch steps and Ray learner ranks."""
