"""Training jobs: the typed job config, the per-rank training loop, metrics and the job summary (torch)."""
