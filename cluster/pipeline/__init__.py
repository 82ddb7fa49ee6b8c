"""The training loop: one `Run` driving the sync or the async pipeline (`pipelines.py`), the rollout
collector and the async stream's buffer, dynamic sampling, held-out evaluation, progress and
checkpoints, stop requests and the run's control actor (scaling targets)."""
