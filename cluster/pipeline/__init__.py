"""The training loop: the sync trainer and the async one, the rollout collector and the async stream's
buffer, prompt data and chunks, dynamic sampling, held-out evaluation, progress and checkpoints, stop
requests and the run's control actor (scaling targets)."""
