"""What a run trains on: the task, its reward and environment, datasets as tasks.
"""
