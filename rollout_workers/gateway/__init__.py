"""The agent gateway: an OpenAI-compatible endpoint in front of a rollout worker's engine that records
every agent session token for token (`sessions`), batches concurrent calls into engine calls
(`batcher`), and answers in OpenAI's shapes (`gateway`, `server`). docs/agents.md."""
