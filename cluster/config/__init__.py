"""The run's configuration: one YAML file validated by a typed schema (`schema.RunConfig`), composed of
the roles' own sections (learner, rollout, reward, reference) and the run-level ones (`sections`)."""
