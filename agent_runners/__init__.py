"""The agent runners: a role that runs the user's own agent code against the gateway of a rollout
worker (`rollout_workers.gateway`), one session per episode (docs/agents.md)."""
