"""Makers of the shipped base checkpoints (offline, minutes on a CPU)."""
