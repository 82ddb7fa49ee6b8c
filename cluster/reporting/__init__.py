"""One run's files and reports: the run folder and job environment, metrics (JSONL, TensorBoard),
Ray/Prometheus telemetry, start-up timings, the end-of-run summary and its curves."""
