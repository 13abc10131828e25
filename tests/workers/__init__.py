"""Rank-side code of the multi-rank tests: models, workers the launcher runs in each rank, helpers."""
