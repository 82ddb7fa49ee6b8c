"""The run's trackers: one logger interface (`base.Sink`) and its sinks (JSONL, TensorBoard, Weights & Biases,
MLflow, Prometheus), chosen by `run.loggers` through `cluster.config.sinks.SINKS` and driven by `run_logger.RunLogger`."""
