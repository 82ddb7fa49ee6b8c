"""Prompt data: files and rows read, chat messages checked and rendered by the policy's template, prompts
tokenized once and handed out in a seeded, resumable order; how a run prompted, carried into its exports."""
