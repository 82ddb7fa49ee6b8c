"""The shared kernel: small, pure, stateless modules that every package of the project may import
(`cluster/` and each role alike), and that import nothing of the project themselves (tests/test_layout.py).
The registry type every part is named through (`kernel.registry`), how a sample's tokens line up
with their logprobs, masks and padding (`kernel.sequences`), how metric names are declared and
joined (`kernel.metric_names`), and the one strict base of every config section (`kernel.strict`)."""
