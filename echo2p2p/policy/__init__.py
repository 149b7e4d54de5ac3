"""The policy, as both planes hold it: loading a model (the built-in one and its shipped assets,
a local directory, a hub id), weights <-> snapshot tensors, and the sampling-logprob contract.

This package imports torch and transformers; it knows nothing of the network, tasks or rewards.
"""
