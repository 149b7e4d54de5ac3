"""The chaos suite (issue 5): real hub and peer processes on loopback, under faults."""
