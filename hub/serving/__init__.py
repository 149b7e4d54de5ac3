"""What serves the peers: the frame pump and `Hub`, admission, leases and quotas, the door,
tokens, trust's consequences, spot-checks, counters.
"""
