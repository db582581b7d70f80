"""Compute kernels: torch reference versions (CPU, oracles) and GPU paths. Know nothing of recipes."""
