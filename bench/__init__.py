"""Benchmarks: scripts that print a table and end with one JSON line (`python bench/NAME.py`).

A package so that what one benchmark shares with another, or with a test, is imported by name
(`bench.emulation`, the emulated network the gossip sweep and the core's tests both run);
not installed with echo2p2p.
"""
