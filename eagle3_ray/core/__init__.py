"""What every stage shares: the typed config and the command line, the stage skeleton (version, skip, resume,
finish), run-directory storage, telemetry, Ray start-up, verifier layer ids, the capture/serving contract, the
hidden-state shards, the built-in prompt sets and the verifiers built or converted without a model hub."""
