"""One run's files and reports: the run folder and job environment, metrics (JSONL, TensorBoard),
Ray/Prometheus telemetry, start-up timings and the end-of-run summary."""
