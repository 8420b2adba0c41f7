"""Prefect tasks: thin wrappers that call the library and log to MLflow."""
