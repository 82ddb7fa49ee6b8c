"""The records the run's parts exchange: chunks of prompts and their samples' facts, calls in flight and
their deadlines, groups and a rank's parts, and Ray's failures as the run reads them. Plain data and
rules on it; nothing here starts, places or drives an actor."""
