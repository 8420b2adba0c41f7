"""Prefect flows: prep, train, evaluate, compare, experiment (end to end)."""
