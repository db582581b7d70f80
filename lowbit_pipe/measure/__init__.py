"""Figures of a model's output: error metrics, the Euler sampler, image grids, timing."""
