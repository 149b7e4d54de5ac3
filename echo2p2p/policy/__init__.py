"""The policy, as both planes hold it: loading a model (the built-ins, shipped or packaged, a GGUF
file converted once into a cached directory, a local directory, a hub id), weights <-> snapshot
tensors, and the sampling-logprob contract.

This package imports torch and transformers (and gguf, only to convert a GGUF file); it knows
nothing of the network, tasks or rewards.
"""
