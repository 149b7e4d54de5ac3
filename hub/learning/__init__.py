"""What the learner does: the run's set-up, the learner loop, GRPO, batches, ranks,
evaluation, checkpoints and the journal.
"""
