"""Reward functions run in killable worker processes, off the event loop, under a deadline.

Both planes score with `scorer.Scorer`: the hub every admitted sample (from its token ids), a
peer its claimed rewards. The pure decode rule it applies is `echo2p2p.completions`.
"""
