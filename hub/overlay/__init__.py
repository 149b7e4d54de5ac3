"""The hub's side of the overlay: the tracker, what it publishes (versions, deltas,
catch-ups, model files) and its own evidence about relays and gossip.
"""
