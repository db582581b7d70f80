"""One run while it runs: the stages over one Context (runner), SIGINT / SIGTERM as an orderly stop (interrupts),
the MLflow callback (tracking), a sweep's failed jobs ending it with exit 1 (sweep_outcome)."""
