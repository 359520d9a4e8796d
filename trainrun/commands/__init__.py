"""The commands beside training, each from a run's files: `export` (an inference model), `evaluate`, `generate`,
`doctor` (the machine and the launch), `compare` (two runs' statistics)."""
