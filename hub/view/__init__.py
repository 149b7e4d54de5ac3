"""What shows the run: the dashboard and its feed, /status, /metrics, the run log,
experiment trackers, `echo2-hub status` and `echo2-hub report`.
"""
